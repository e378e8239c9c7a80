"""GPT-NeoX's optimizers: lion and sm3 step by step against values worked out by hand (plain
floats below, not the optimizer's code), their state across a save/load, the config path, the
refusal of NeoX's DeepSpeed-only names, and a 5-step lion run whose loss falls."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from conftest import REPO, TINY_OVERRIDES, read_scalars, train_in_process
from torch import nn

from nxdt.config import optim_keys
from nxdt.config.errors import ConfigError
from nxdt.spec import load_config
from nxdt.planner.estimate import Bytes, rank_memory, sm3_accumulator_elems
from nxdt.optim.neox import SM3, Lion
from nxdt.optim.optimizers import _init_args, build_optimizer, resolve_optimizer

P0 = [[1.0, -2.0, 0.5], [0.0, 3.0, -1.0]]
G1 = [[0.5, -1.0, 0.0], [2.0, -0.25, 1.0]]
G2 = [[-0.1, -1.0, 0.3], [-0.5, 0.02, -0.05]]  # lion: rows end where momentum outvotes g


def _t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


def _steps(opt, p, grads):
    for g in grads:
        p.grad = _t(g).to(p.dtype)
        opt.step()


def _close(p, rows, tol=1e-12):
    assert torch.allclose(p.detach().double(), _t(rows), atol=tol, rtol=0), (p, rows)


# ----------------------------------------------------------------------------- lion
def test_lion_two_steps_by_hand():
    p = nn.Parameter(_t(P0))
    opt = Lion([p], lr=0.1, betas=(0.9, 0.99))
    _steps(opt, p, [G1])
    # m = 0, so c = 0.1·g: sign(G1) = [[1, -1, 0], [1, -1, 1]]; p -= 0.1·sign
    _close(p, [[0.9, -1.9, 0.5], [-0.1, 3.1, -1.1]])
    m1 = [[0.005, -0.01, 0.0], [0.02, -0.0025, 0.01]]  # 0.01·G1
    _close(opt.state[p]["exp_avg"], m1)
    _steps(opt, p, [G2])
    # c = 0.9·m1 + 0.1·G2 = [[-0.0055, -0.109, 0.03], [-0.032, -0.00025, 0.004]]:
    # entry (1,1) has g = +0.02 but c < 0; entry (1,2) has g = -0.05 but c > 0 (the momentum wins)
    _close(p, [[1.0, -1.8, 0.4], [0.0, 3.2, -1.2]])
    # m2 = 0.99·m1 + 0.01·G2
    _close(opt.state[p]["exp_avg"], [[0.00395, -0.0199, 0.003], [0.0148, -0.002275, 0.0094]])


def test_lion_decoupled_weight_decay():
    p = nn.Parameter(_t(P0))
    opt = Lion([p], lr=0.1, betas=(0.9, 0.99), weight_decay=0.5)
    _steps(opt, p, [G1])
    # p·(1 - 0.1·0.5) = 0.95·P0 = [[0.95, -1.9, 0.475], [0, 2.85, -0.95]], then - 0.1·sign(G1)
    _close(p, [[0.85, -1.8, 0.475], [-0.1, 2.95, -1.05]])


# ----------------------------------------------------------------------------- sm3
G2_SM3 = [[1.0, 0.5, -2.0], [-1.0, 0.0, 0.5]]
# step 1: ν = G1² = [[0.25, 1, 0], [4, 0.0625, 1]] → rows r = [1, 4], columns c = [4, 1, 1];
# update = G1/|G1| = sign(G1) (0 where g = 0: 0/√eps).
# step 2: min(r_i, c_j) = [[1, 1, 1], [4, 1, 1]]; ν = that + G2² = [[2, 1.25, 5], [5, 1, 1.25]]
# (Adagrad would have 0.0625 at (1,1): SM3 keeps the row/column bound 1 instead);
# r = [5, 5], c = [5, 1.25, 5]; update = G2/√ν.
P1_SM3 = [[0.9, -1.9, 0.5], [-0.1, 3.1, -1.1]]
U2_SM3 = [[1 / math.sqrt(2), 0.5 / math.sqrt(1.25), -2 / math.sqrt(5)],
          [-1 / math.sqrt(5), 0.0, 0.5 / math.sqrt(1.25)]]


def test_sm3_two_steps_by_hand():
    p = nn.Parameter(_t(P0))
    opt = SM3([p], lr=0.1)
    _steps(opt, p, [G1])
    _close(p, P1_SM3)
    state = opt.state[p]
    _close(state["accumulator_0"], [[1.0], [4.0]])
    _close(state["accumulator_1"], [[4.0, 1.0, 1.0]])
    _steps(opt, p, [G2_SM3])
    _close(p, [[a - 0.1 * u for a, u in zip(ra, ru)] for ra, ru in zip(P1_SM3, U2_SM3)])
    _close(state["accumulator_0"], [[5.0], [5.0]])
    _close(state["accumulator_1"], [[5.0, 1.25, 5.0]])
    assert state["step"] == 2 and "momentum_buffer" not in state


def test_sm3_momentum():
    p = nn.Parameter(_t(P0))
    opt = SM3([p], lr=0.1, momentum=0.5)
    _steps(opt, p, [G1, G2_SM3])
    # buf1 = 0.5·sign(G1); buf2 = 0.5·buf1 + 0.5·U2; p2 = P0 - 0.1·buf1 - 0.1·buf2
    sign = [[1, -1, 0], [1, -1, 1]]
    buf2 = [[0.25 * s + 0.5 * u for s, u in zip(rs, ru)] for rs, ru in zip(sign, U2_SM3)]
    _close(opt.state[p]["momentum_buffer"], buf2)
    _close(p, [[p0 - 0.05 * s - 0.1 * b for p0, s, b in zip(r0, rs, rb)] for r0, rs, rb in zip(P0, sign, buf2)])


def test_sm3_vector_with_beta_keeps_the_running_max():
    p = nn.Parameter(_t([1.0, -1.0]))
    opt = SM3([p], lr=0.1, beta=0.5)
    _steps(opt, p, [[2.0, 0.5]])
    # ν = 0.5·0 + 0.5·g² = [2, 0.125]; update = g/√(g²/2) = √2 for both
    _close(p, [1.0 - 0.1 * math.sqrt(2), -1.0 - 0.1 * math.sqrt(2)])
    _steps(opt, p, [[0.0, 1.0]])
    # ν = 0.5·[2, 0.125] + 0.5·[0, 1] = [1, 0.5625]; accumulator max([2, 0.125], ν) = [2, 0.5625]
    _close(opt.state[p]["accumulator_0"], [2.0, 0.5625])
    _close(p, [1.0 - 0.1 * math.sqrt(2), -1.0 - 0.1 * math.sqrt(2) - 0.1 / 0.75])


def test_sm3_on_a_vector_is_adagrad():
    ours, ref = nn.Parameter(_t([0.3, -0.2, 1.0])), nn.Parameter(_t([0.3, -0.2, 1.0]))
    a, b = SM3([ours], lr=0.05), torch.optim.Adagrad([ref], lr=0.05, eps=0.0)
    for g in ([1.0, -2.0, 0.5], [0.5, 1.0, -1.0], [-2.0, 0.25, 3.0]):
        _steps(a, ours, [g])
        _steps(b, ref, [g])
    assert torch.allclose(ours, ref, atol=1e-12, rtol=0)


def test_sm3_accumulators_are_one_per_dimension():
    p = nn.Parameter(torch.zeros(2, 3, 4))
    opt = SM3([p], lr=0.1)
    g = torch.arange(24.0).reshape(2, 3, 4) - 10  # g² is largest at index 0 (100) and 23 (169)
    p.grad = g
    opt.step()
    shapes = [tuple(opt.state[p][f"accumulator_{i}"].shape) for i in range(3)]
    assert shapes == [(2, 1, 1), (1, 3, 1), (1, 1, 4)]
    assert sum(math.prod(s) for s in shapes) == sm3_accumulator_elems(p.shape) == 9
    # g[i, j, k] = 12i + 4j + k - 10; acc_d = max of g² over the other two dimensions:
    # i: -10..1 → 100, 2..13 → 169;  j: {-10..-7, 2..5} → 100, {-6..-3, 6..9} → 81, {-2..1, 10..13} → 169;
    # k: {-10, -6, -2, 2, 6, 10} → 100, then 121, 144, 169
    assert opt.state[p]["accumulator_0"].flatten().tolist() == [100.0, 169.0]
    assert opt.state[p]["accumulator_1"].flatten().tolist() == [100.0, 81.0, 169.0]
    assert opt.state[p]["accumulator_2"].flatten().tolist() == [100.0, 121.0, 144.0, 169.0]


# ----------------------------------------------------------------------------- state dicts
@pytest.mark.parametrize("make", [lambda ps: Lion(ps, lr=0.1, weight_decay=0.1),
                                  lambda ps: SM3(ps, lr=0.1, momentum=0.5, beta=0.5)], ids=["lion", "sm3"])
def test_state_dict_round_trip_continues_identically(make):
    a = nn.Parameter(_t(P0).float())
    opt_a = make([a])
    _steps(opt_a, a, [G1, G2])
    saved, weights = copy.deepcopy(opt_a.state_dict()), a.detach().clone()
    b = nn.Parameter(weights.clone())
    opt_b = make([b])
    opt_b.load_state_dict(saved)
    _steps(opt_a, a, [G2_SM3])
    _steps(opt_b, b, [G2_SM3])
    assert torch.equal(a, b)
    assert opt_a.state_dict()["state"].keys() == opt_b.state_dict()["state"].keys()


def test_sm3_state_stays_fp32_for_bf16_params_across_a_load():
    p = nn.Parameter(_t(P0).to(torch.bfloat16))
    opt = SM3([p], lr=0.1, momentum=0.5)
    _steps(opt, p, [G1])
    fresh = SM3([nn.Parameter(p.detach().clone())], lr=0.1, momentum=0.5)
    fresh.load_state_dict(copy.deepcopy(opt.state_dict()))  # torch alone would cast them to bf16
    state = next(iter(fresh.state.values()))
    assert {k: v.dtype for k, v in state.items() if torch.is_tensor(v)} == {
        "accumulator_0": torch.float32, "accumulator_1": torch.float32, "momentum_buffer": torch.float32}


# ----------------------------------------------------------------------------- config
class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(3, 2)


def test_keys_and_defaults_match_the_classes():
    assert optim_keys.OPTIMIZERS["lion"] == _init_args(Lion) == {"lr": 1e-4, "betas": (0.9, 0.99), "weight_decay": 0.0}
    assert optim_keys.OPTIMIZERS["sm3"] == _init_args(SM3) == {"lr": 0.1, "momentum": 0.0, "beta": 0.0, "eps": 1e-30}


def test_config_path_builds_lion_and_sm3():
    cfg = load_config(["--config-path", str(REPO / "conf"), "--config-name", "tiny_llama_cpu",
                       "model.optim.name=lion", "model.optim.lr=0.1", "model.optim.betas=[0.9,0.99]",
                       "model.optim.weight_decay=0.5"], check_paths=False, quiet=True)
    cls, kwargs = resolve_optimizer(cfg.model.optim)
    assert cls is Lion and kwargs == {"lr": 0.1, "betas": (0.9, 0.99), "weight_decay": 0.5}
    m = Tiny()
    with torch.no_grad():
        m.proj.weight.copy_(torch.tensor(P0))
        m.proj.bias.copy_(torch.tensor([1.0, -1.0]))
    opt = build_optimizer(m, cfg.model.optim)
    assert isinstance(opt, Lion) and [g["weight_decay"] for g in opt.param_groups] == [0.5, 0.0]
    m.proj.weight.grad, m.proj.bias.grad = torch.tensor(G1), torch.tensor([-3.0, 0.0])
    opt.step()
    _close(m.proj.weight, [[0.85, -1.8, 0.475], [-0.1, 2.95, -1.05]], tol=1e-6)  # as the weight-decay test
    _close(m.proj.bias, [1.1, -1.0], tol=1e-6)  # no decay for a bias; sign(0) = 0

    # sm3 has no weight_decay: the leftover key is named, then sm3 builds one group
    with pytest.raises(ConfigError, match=r"^model\.optim\.weight_decay: unknown key; optimizer 'sm3' takes: "
                                          r"name, sched, capturable, lr, momentum, beta, eps$"):
        optim_keys.check_optim({"name": "sm3", "lr": 0.1, "weight_decay": 0.01})
    opt = build_optimizer(Tiny(), {"name": "sm3", "lr": 0.1, "eps": 1e-20})
    assert isinstance(opt, SM3) and len(opt.param_groups) == 1 and opt.defaults["eps"] == 1e-20


@pytest.mark.parametrize("name", ["OneBitAdam", "onebitadam", "cpu_adam", "CPU_Adam", "CPU_torch_adam"])
def test_deepspeed_only_names_are_refused_with_one_line(name):
    with pytest.raises(ConfigError) as err:
        optim_keys.check_optim({"name": name, "lr": 1e-4})
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"model.optim.name: '{name}': ")
    assert "which nxdt does not use; use adamw (fused on CPU/CUDA)" in msg
    assert ("distributed_strategy.zero1" in msg) == (name.lower() == "onebitadam")


def test_sm3_refused_where_parameters_are_sharded():
    optim_keys.check_optim_parallel({"name": "sm3"}, tp=1, ep=1, fsdp_ways=1)
    optim_keys.check_optim_parallel({"name": "lion"}, tp=4, ep=2, fsdp_ways=8)  # elementwise: fine
    for kw in ({"tp": 2, "ep": 1, "fsdp_ways": 1}, {"tp": 1, "ep": 2, "fsdp_ways": 1}, {"tp": 1, "ep": 1, "fsdp_ways": 4}):
        with pytest.raises(ConfigError, match=r"^model\.optim\.name: sm3 keeps one accumulator per row") as err:
            optim_keys.check_optim_parallel({"name": "sm3"}, **kw)
        assert "\n" not in str(err.value) and "use adagrad" in str(err.value)
    # validation calls it: refused before anything is built (tp2 on 2 ranks)
    with pytest.raises(ConfigError, match=r"^model\.optim\.name: sm3 keeps one accumulator .*tensor_model_parallel_size=2"):
        load_config(["--config-path", str(REPO / "conf"), "--config-name", "tiny_llama_cpu", "model.optim.name=sm3",
                     "~model.optim.weight_decay", "~model.optim.betas", "~model.optim.sched", "trainer.devices=2",
                     "distributed_strategy.tensor_model_parallel_size=2"], check_paths=False, quiet=True)


def test_dtensor_params_sm3_refuses_sharded_steps_replicated_lion_steps_sharded(tmp_path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        sharded = nn.Parameter(distribute_tensor(_t(P0), mesh, [Shard(0)]))
        with pytest.raises(ConfigError, match=r"^model\.optim\.name: sm3 keeps one accumulator"):
            SM3([sharded])
        rep = nn.Parameter(distribute_tensor(_t(P0), mesh, [Replicate()]))
        opt = SM3([rep], lr=0.1)
        for g in (G1, G2_SM3):
            rep.grad = distribute_tensor(_t(g), mesh, [Replicate()])
            opt.step()
        _close(rep.to_local(), [[a - 0.1 * u for a, u in zip(ra, ru)] for ra, ru in zip(P1_SM3, U2_SM3)])
        lion = Lion([sharded], lr=0.1, betas=(0.9, 0.99), weight_decay=0.5)  # elementwise: shards are fine
        sharded.grad = distribute_tensor(_t(G1), mesh, [Shard(0)])
        lion.step()
        _close(sharded.to_local(), [[0.85, -1.8, 0.475], [-0.1, 2.95, -1.05]])  # as the weight-decay test
    finally:
        dist.destroy_process_group()


def test_plan_counts_sm3_accumulators_not_full_size_states():
    fp32 = Bytes(4, 4, 0, 4, 4)
    # a (4096, 11008) matrix + a 4096 norm: 45,092,864 elements; sm3 keeps 15,104 + 4,096 numbers
    n, acc = 4096 * 11008 + 4096, sm3_accumulator_elems((4096, 11008)) + sm3_accumulator_elems((4096,))
    assert acc == 19_200 and sm3_accumulator_elems(()) == 1
    assert rank_memory(n, 0, fp32, 0, zero1=False, dp=1, ep=1, factored=acc)["optimizer"] == 76_800
    # momentum adds one full-size state; ZeRO-1 over 4 ranks divides it all
    assert rank_memory(n, 0, fp32, 1, zero1=True, dp=4, ep=1, factored=acc)["optimizer"] == (4 * n + 76_800) // 4


def test_plan_of_a_tiny_llama_with_sm3(capsys):
    import json

    from nxdt.tools.plan import main as plan_main

    base = ["--config-path", str(REPO / "conf"), "--config-name", "tiny_llama_cpu", "model.num_layers=2",
            "model.hidden_size=64", "model.ffn_hidden_size=176", "model.num_attention_heads=4", "model.num_kv_heads=2",
            "model.optim.name=sm3", "~model.optim.weight_decay", "~model.optim.betas", "--json"]
    # per layer: q, o (64, 64) → 128 each; k, v (32, 64) → 96 each; gate, up (176, 64), down (64, 176)
    # → 240 each; two norms 64 each: 1,296. Embedding and untied lm_head (8192, 64): 8,256 each; final norm 64.
    acc = 2 * 1296 + 2 * 8256 + 64
    for extra, full_states in (([], 0), (["+model.optim.momentum=0.9"], 1)):
        assert plan_main([*base, *extra]) == 0
        p = json.loads(capsys.readouterr().out)
        assert p["vocab_size"] == 8192 and p["parameters"] == 1_141_056
        assert p["memory_per_rank_bytes"]["optimizer"] == 4 * (acc + full_states * 1_141_056)  # fp32 state


# ----------------------------------------------------------------------------- end to end
def test_lion_training_reduces_the_loss(kjv_prefix, tmp_path):
    argv = ["--config-name", "tiny_llama_cpu", *TINY_OVERRIDES, "trainer.devices=1", "trainer.max_steps=5",
            f"data.data_prefix=[1.0,{kjv_prefix}]", "model.optim.name=lion", "model.optim.lr=3e-3",
            "model.optim.betas=[0.9,0.99]", "model.optim.sched.warmup_steps=0", "trainer.limit_val_batches=0",
            "exp_manager.create_checkpoint_callback=false", f"exp_manager.explicit_log_dir={tmp_path / 'lion'}"]
    run = train_in_process(argv)
    assert run.rc == 0, run.err[-3000:]
    losses = [v for _, v in sorted(read_scalars(tmp_path / "lion")["reduced_train_loss"].items())]
    assert len(losses) == 5 and all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0] - 0.3, losses
