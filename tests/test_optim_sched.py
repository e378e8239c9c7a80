"""Optimizers, weight-decay groups, the model.optim key check, and every lr schedule against hand-computed values."""

from __future__ import annotations

import copy
import math
import subprocess
import sys

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from nxdt.config.errors import ConfigError
from nxdt.config.optim_keys import OPTIMIZERS, SCHEDULERS, check_optim
from nxdt.optim.optimizers import (
    AdamWFP32OptState,
    Novograd,
    build_optimizer,
    param_groups,
    register_optimizer,
)
from nxdt.optim.schedulers import build_scheduler

LR = 3e-4


def lrs(sched_cfg, n, lr=LR, max_steps=None):
    """The lr used by optimizer steps 0..n (the scheduler is stepped after each optimizer step)."""
    p = nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=lr)
    sched = build_scheduler(opt, sched_cfg, max_steps)
    out = []
    for _ in range(n + 1):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def close(a, b):
    return a == pytest.approx(b, rel=1e-12, abs=1e-15)


# --------------------------------------------------------------------------- schedulers


def test_linear_annealing_with_warmup():
    lr = lrs({"name": "LinearAnnealingWithWarmUp", "warmup_steps": 10, "max_steps": 100}, 120)
    assert lr[0] == 0.0
    assert close(lr[5], 3e-4 * (5 / 10))  # inside warmup
    assert close(lr[10], 3e-4 * (100 - 10) / (100 - 10))  # end of warmup = peak
    assert close(lr[55], 3e-4 * (100 - 55) / (100 - 10))  # mid-decay
    assert lr[100] == 0.0  # max_steps
    assert lr[120] == 0.0  # past max_steps


def test_warmup_policy():
    lr = lrs({"name": "WarmupPolicy", "warmup_steps": 10, "max_steps": 100, "min_lr": 1e-5}, 110)
    assert close(lr[0], 3e-4 * (0 + 1) / (10 + 1))
    assert close(lr[5], 3e-4 * (5 + 1) / (10 + 1))
    assert close(lr[10], 3e-4)
    assert close(lr[50], 3e-4)
    assert close(lr[100], 3e-4)  # NeMo: min_lr only when step > max_steps
    assert close(lr[101], 1e-5)
    assert close(lr[110], 1e-5)


def test_warmup_ratio_and_max_steps_default_to_trainer():
    # sched.max_steps absent: the given trainer.max_steps (100) is used; warmup = int(0.1 * 100).
    lr = lrs({"name": "WarmupPolicy", "warmup_ratio": 0.1, "min_lr": 1e-5}, 101, max_steps=100)
    assert close(lr[5], 3e-4 * (5 + 1) / (10 + 1))
    assert close(lr[100], 3e-4)
    assert close(lr[101], 1e-5)
    # sched.max_steps wins over trainer.max_steps
    lr = lrs({"name": "WarmupPolicy", "warmup_steps": 0, "min_lr": 1e-5, "max_steps": 20}, 21, max_steps=100)
    assert close(lr[20], 3e-4) and close(lr[21], 1e-5)


def test_warmup_hold_policy():
    cfg = {"name": "WarmupHoldPolicy", "warmup_steps": 10, "hold_steps": 20, "max_steps": 100, "min_lr": 1e-5}
    lr = lrs(cfg, 110)
    assert close(lr[5], 3e-4 * (5 + 1) / (10 + 1))
    assert close(lr[10], 3e-4)
    assert close(lr[29], 3e-4)  # hold: warmup_steps <= step < warmup + hold
    assert close(lr[50], 3e-4)  # NeMo's WarmupHoldPolicy is constant after the hold
    assert close(lr[100], 3e-4)
    assert close(lr[101], 1e-5)
    assert close(lr[110], 1e-5)


def test_cosine_annealing_without_constant_steps():
    cfg = {"name": "CosineAnnealing", "warmup_steps": 10, "constant_steps": 0, "min_lr": 1e-5, "max_steps": 110}
    lr = lrs(cfg, 120)
    assert close(lr[0], 3e-4 * (0 + 1) / (10 + 1))
    assert close(lr[5], 3e-4 * (5 + 1) / (10 + 1))
    assert close(lr[10], 3e-4)
    # mid-decay: step 60 is 50 of 100 decay steps: cos(pi/2) = 0
    assert close(lr[60], (3e-4 - 1e-5) * 0.5 * (1 + math.cos(math.pi * 50 / 100)) + 1e-5)
    assert close(lr[35], (3e-4 - 1e-5) * 0.5 * (1 + math.cos(math.pi * 25 / 100)) + 1e-5)
    assert close(lr[110], 1e-5)  # cos(pi) = -1
    assert close(lr[120], 1e-5)


def test_cosine_annealing_with_constant_steps():
    # Megatron-style: warmup lr*step/warmup, cosine over 130-20-10 = 100 steps, min_lr for the last 20.
    cfg = {"name": "CosineAnnealing", "warmup_steps": 10, "constant_steps": 20, "min_lr": 1e-5, "max_steps": 130}
    lr = lrs(cfg, 140)
    assert lr[0] == 0.0
    assert close(lr[5], 3e-4 * 5 / 10)
    assert close(lr[10], 3e-4)
    assert close(lr[60], 1e-5 + 0.5 * (math.cos(math.pi * 50 / 100) + 1.0) * (3e-4 - 1e-5))
    assert close(lr[85], 1e-5 + 0.5 * (math.cos(math.pi * 75 / 100) + 1.0) * (3e-4 - 1e-5))
    assert close(lr[110], 1e-5)  # end of decay
    assert close(lr[120], 1e-5)  # constant phase
    assert close(lr[130], 1e-5)  # max_steps
    assert close(lr[140], 1e-5)


def test_square_annealing():
    cfg = {"name": "SquareAnnealing", "warmup_steps": 10, "max_steps": 110}  # min_lr defaults to 1e-5 (NeMo)
    lr = lrs(cfg, 120)
    assert close(lr[5], 3e-4 * (5 + 1) / (10 + 1))
    assert close(lr[10], 3e-4)
    assert close(lr[60], 3e-4 * ((100 - 50) / 100) ** 2)
    assert close(lr[100], 1e-5)  # 3e-4 * (10/100)**2 = 3e-6 is below min_lr
    assert close(lr[110], 1e-5)
    assert close(lr[120], 1e-5)


def test_warmup_annealing():
    cfg = {"name": "WarmupAnnealing", "warmup_steps": 10, "max_steps": 110, "min_lr": 1e-5}
    lr = lrs(cfg, 120)
    assert close(lr[5], 3e-4 * (5 + 1) / (10 + 1))
    assert close(lr[10], 3e-4)
    assert close(lr[60], 1e-5 + (1 - 50 / 100) * (3e-4 - 1e-5))
    assert close(lr[110], 1e-5)
    assert close(lr[120], 1e-5)


def test_noam_annealing():
    # lr 1, d_model 16: normalize = 16**-0.5 = 0.25; warmup 4: 4**-1.5 = 1/8
    cfg = {"name": "NoamAnnealing", "d_model": 16, "warmup_steps": 4, "min_lr": 0.05, "max_steps": 20}
    lr = lrs(cfg, 40, lr=1.0)
    assert close(lr[0], 0.25 * min(1 ** -0.5, 1 / 8))  # step 0 counts as 1
    assert close(lr[2], 0.25 * min(2 ** -0.5, 2 / 8))  # inside warmup
    assert close(lr[4], 0.25 * 0.5)  # end of warmup: 4**-0.5 == 4/8
    assert close(lr[16], 0.25 * 16 ** -0.5)  # decay
    assert close(lr[20], 0.25 * 20 ** -0.5)  # max_steps does not stop Noam (NeMo)
    assert close(lr[36], 0.05)  # 0.25/6 < min_lr: floored
    assert close(lr[40], 0.05)


def test_step_and_exponential_lr():
    lr = lrs({"name": "StepLR", "step_size": 10, "gamma": 0.5, "max_steps": 100}, 25)
    assert close(lr[9], 3e-4) and close(lr[10], 3e-4 * 0.5) and close(lr[25], 3e-4 * 0.25)
    lr = lrs({"name": "ExponentialLR", "gamma": 0.9}, 3, max_steps=-1)
    assert close(lr[3], 3e-4 * 0.9**3)


def test_no_sched_is_constant_and_missing_max_steps_is_an_error():
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=LR)
    assert build_scheduler(opt, None, 100) is None
    with pytest.raises(ConfigError, match=r"model\.optim\.sched\.max_steps"):
        build_scheduler(opt, {"name": "CosineAnnealing", "warmup_steps": 1}, -1)
    with pytest.raises(ConfigError, match="min_lr"):
        build_scheduler(opt, {"name": "CosineAnnealing", "min_lr": 1.0}, 100)
    with pytest.raises(ConfigError, match="warmup_steps or warmup_ratio"):
        build_scheduler(opt, {"name": "WarmupPolicy", "warmup_steps": 1, "warmup_ratio": 0.1}, 100)


def test_scheduler_state_dict_resumes():
    cfg = OmegaConf.create({"name": "CosineAnnealing", "warmup_steps": 5, "constant_steps": 3, "min_lr": 1e-5})

    def make():
        opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=LR)
        return opt, build_scheduler(opt, cfg, 40)

    opt_a, sched_a = make()
    for _ in range(17):
        opt_a.step()
        sched_a.step()
    opt_b, sched_b = make()
    opt_b.load_state_dict(opt_a.state_dict())
    sched_b.load_state_dict(sched_a.state_dict())
    for _ in range(10):
        for o, s in ((opt_a, sched_a), (opt_b, sched_b)):
            o.step()
            s.step()
        assert opt_a.param_groups[0]["lr"] == opt_b.param_groups[0]["lr"]


# --------------------------------------------------------------------------- optimizers


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.proj = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.frozen = nn.Linear(4, 4)
        self.frozen.requires_grad_(False)

    def forward(self, ids):
        return self.head(self.norm(self.proj(self.embed(ids)) + self.frozen(self.embed(ids))))


def _names(model, group):
    by_id = {id(p): n for n, p in model.named_parameters()}
    return sorted(by_id[id(p)] for p in group["params"])


def test_weight_decay_groups():
    torch.manual_seed(0)
    m = Tiny()
    decay, no_decay = param_groups(m, 0.1)
    assert _names(m, decay) == ["embed.weight", "proj.weight"] and decay["weight_decay"] == 0.1
    assert _names(m, no_decay) == ["norm.bias", "norm.weight", "proj.bias"] and no_decay["weight_decay"] == 0.0

    decay, no_decay = param_groups(m, 0.1, do_layer_norm_weight_decay=True)
    assert _names(m, decay) == ["embed.weight", "norm.weight", "proj.weight"]
    assert _names(m, no_decay) == ["norm.bias", "proj.bias"]

    opt = build_optimizer(m, {"name": "adamw", "lr": 1e-3, "weight_decay": 0.1})
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert sum(len(g["params"]) for g in opt.param_groups) == 5  # tied once, frozen out


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_every_optimizer_builds_and_steps(name):
    torch.manual_seed(0)
    m = Tiny()
    cfg = {"name": name, "lr": 0.01, "capturable": False, "sched": None}
    if "weight_decay" in OPTIMIZERS[name]:
        cfg["weight_decay"] = 0.01
    if "betas" in OPTIMIZERS[name]:
        cfg["betas"] = [0.9, 0.95]
    opt = build_optimizer(m, OmegaConf.create(cfg))
    before = [p.detach().clone() for p in m.parameters()]
    m(torch.tensor([[1, 2, 3]])).square().mean().backward()
    opt.step()
    changed = [not torch.equal(a, p) for a, p in zip(before, m.parameters()) if p.requires_grad]
    assert all(changed), name
    if "betas" in cfg:
        assert opt.param_groups[0]["betas"] == (0.9, 0.95)


@pytest.mark.parametrize("name", ["adamw", "adam", "adamw_fp32OptState"])
def test_capturable_true_trains_on_cpu(name):
    """NxDT's Megatron configs set `capturable: True` (an XLA / CUDA-graph option): torch's Adam(W)
    asserts on it at the first CPU step; nxdt leaves it out off CUDA/XLA and the run trains."""
    cfg = OmegaConf.create({"name": name, "lr": 0.05, "weight_decay": 0.01, "betas": [0.9, 0.999],
                            "capturable": True, "sched": None})
    torch.manual_seed(0)
    plain = Tiny()
    plain(torch.tensor([[1, 2, 3]])).square().mean().backward()
    with pytest.raises(AssertionError, match="capturable=True"):  # the hazard: torch's own kernel on CPU
        torch.optim.AdamW([p for p in plain.parameters() if p.requires_grad], capturable=True).step()
    torch.manual_seed(0)
    m = Tiny()
    opt = build_optimizer(m, cfg)
    assert all(not g.get("capturable", False) for g in opt.param_groups)
    ids = torch.tensor([[1, 2, 3, 4]])
    losses = []
    for _ in range(2):
        opt.zero_grad()
        loss = m(ids).square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert m(ids).square().mean().item() < losses[0]


def test_adamw_fp32_opt_state_matches_torch_adamw():
    torch.manual_seed(0)
    for amsgrad in (False, True):
        p_ref = nn.Parameter(torch.randn(5, 3))
        p_ours = nn.Parameter(p_ref.detach().clone())
        kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, amsgrad=amsgrad)
        ref = torch.optim.AdamW([p_ref], foreach=False, **kw)
        ours = AdamWFP32OptState([p_ours], **kw)
        for _ in range(4):
            g = torch.randn(5, 3)
            p_ref.grad, p_ours.grad = g.clone(), g.clone()
            ref.step()
            ours.step()
            assert torch.equal(p_ref, p_ours)
        assert "master" not in ours.state[p_ours]


def test_adamw_fp32_opt_state_keeps_fp32_for_bf16_params():
    p = nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    opt = AdamWFP32OptState([p], lr=1e-4, weight_decay=0.0)
    p.grad = torch.ones(4, dtype=torch.bfloat16)
    opt.step()
    state = opt.state[p]
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == state["master"].dtype == torch.float32
    assert p.dtype == torch.bfloat16
    # the 1e-4 step is lost to bf16 rounding in p but kept in the fp32 master copy
    assert torch.allclose(state["master"], torch.full((4,), 1 - 1e-4), atol=1e-7)
    assert torch.equal(p, state["master"].to(torch.bfloat16))
    # a checkpoint round trip does not cast the state to bf16
    q = nn.Parameter(p.detach().clone())
    opt2 = AdamWFP32OptState([q], lr=1e-4, weight_decay=0.0)
    opt2.load_state_dict(opt.state_dict())
    assert opt2.state[q]["exp_avg"].dtype == opt2.state[q]["master"].dtype == torch.float32
    assert torch.equal(opt2.state[q]["master"], state["master"])  # not rounded through bf16


def test_novograd_matches_hand_computed_updates():
    p = nn.Parameter(torch.tensor([3.0, 4.0]))
    opt = Novograd([p], lr=0.1, betas=(0.95, 0.98), eps=0.0, weight_decay=0.1)
    # step 1: v = |g|^2 = 0.09 + 0.16 = 0.25 (first step copies), g' = g/sqrt(v) + wd*p, m = g'
    g1 = torch.tensor([0.3, 0.4])
    p.grad = g1.clone()
    opt.step()
    m1 = [0.3 / 0.5 + 0.1 * 3.0, 0.4 / 0.5 + 0.1 * 4.0]
    p1 = [3.0 - 0.1 * m1[0], 4.0 - 0.1 * m1[1]]
    assert torch.allclose(p, torch.tensor(p1), atol=1e-6)
    assert torch.equal(p.grad, g1)  # the gradient is not modified in place
    # step 2: v = 0.98 * 0.25 + 0.02 * |g|^2 with |g|^2 = 0.36 + 0.64 = 1.0; m = 0.95 * m1 + g'
    p.grad = torch.tensor([0.6, 0.8])
    opt.step()
    v2 = 0.98 * 0.25 + 0.02 * 1.0
    m2 = [0.95 * m1[0] + 0.6 / math.sqrt(v2) + 0.1 * p1[0], 0.95 * m1[1] + 0.8 / math.sqrt(v2) + 0.1 * p1[1]]
    assert torch.allclose(p, torch.tensor([p1[0] - 0.1 * m2[0], p1[1] - 0.1 * m2[1]]), atol=1e-6)


def test_register_optimizer():
    class MySGD(torch.optim.SGD):
        pass

    register_optimizer("my_sgd", MySGD)
    try:
        opt = build_optimizer(Tiny(), {"name": "my_sgd", "lr": 0.1, "momentum": 0.9, "weight_decay": 0.01})
        assert isinstance(opt, MySGD) and opt.param_groups[0]["momentum"] == 0.9
    finally:
        from nxdt.config import optim_keys
        from nxdt.optim import optimizers

        optimizers.OPTIMIZER_CLASSES.pop("my_sgd")
        optim_keys.OPTIMIZERS.pop("my_sgd")


# --------------------------------------------------------------------------- key check


def _error(optim):
    with pytest.raises(ConfigError) as e:
        check_optim(optim)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_check_optim_messages():
    check_optim({"name": "adamw", "lr": 1e-3, "weight_decay": 0.01, "capturable": False, "betas": [0.9, 0.999]})
    check_optim({"name": "sgd", "lr": 1e-3, "sched": None})
    check_optim(OmegaConf.create({"name": "adamw_fp32OptState", "lr": 3e-4, "weight_decay": 0.01, "capturable": False,
                                  "betas": [0.9, 0.999],
                                  "sched": {"name": "LinearAnnealingWithWarmUp", "warmup_steps": 100,
                                            "max_steps": 1000}}))

    msg = _error({"name": "adamww", "lr": 1e-3})
    assert msg.startswith("model.optim.name: unknown optimizer 'adamww'") and "did you mean 'adamw'?" in msg
    assert "adafactor" in msg  # the valid names are listed
    assert "did you mean 'adamw'?" in _error({"name": "AdamW"})

    assert _error({"name": "adamw", "lr": 1e-3, "beta": [0.9, 0.9]}) == \
        "model.optim.beta: unknown key (did you mean 'betas'?)"
    assert _error({"name": "adamw", "lr": 1, "sched": {"name": "CosineAnnealing", "warmup_step": 10}}) == \
        "model.optim.sched.warmup_step: unknown key (did you mean 'warmup_steps'?)"
    msg = _error({"name": "adamw", "lr": 1, "sched": {"name": "CosineAnealing"}})
    assert msg.startswith("model.optim.sched.name: unknown scheduler 'CosineAnealing'")
    assert "did you mean 'CosineAnnealing'?" in msg
    assert "model.optim.weight_decay: unknown key; optimizer 'rprop' takes" in _error(
        {"name": "rprop", "lr": 1, "weight_decay": 0.1})
    assert _error({"name": "adamw", "sched": {"name": "NoamAnnealing"}}) == \
        "model.optim.sched.d_model: required by scheduler 'NoamAnnealing'"
    with pytest.raises(ConfigError, match=r"^my\.path\.foo: unknown key"):
        check_optim({"name": "sgd", "foo": 1}, path="my.path")


def test_every_scheduler_has_its_keys_registered():
    from nxdt.optim.schedulers import SCHEDULER_CLASSES

    assert set(SCHEDULERS) == set(SCHEDULER_CLASSES)


def test_optim_keys_import_no_torch():
    code = "import sys, nxdt.config.optim_keys; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_adamw_is_fused_by_default_and_matches_the_reference_loop():
    """Plain fp32 params get the fused kernel unless the config picks an implementation."""
    import torch

    from nxdt.optim.optimizers import build_optimizer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 4))
    reference = copy.deepcopy(model)
    cfg = {"name": "adamw", "lr": 1e-2, "weight_decay": 0.1, "betas": [0.9, 0.95]}
    fused = build_optimizer(model, cfg)
    assert fused.defaults["fused"] is True
    plain = build_optimizer(reference, {**cfg, "foreach": False})
    assert not plain.defaults.get("fused")
    for step in range(5):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
        for m, opt in ((model, fused), (reference, plain)):
            opt.zero_grad()
            m(x).pow(2).mean().backward()
            opt.step()
    for a, b in zip(model.parameters(), reference.parameters()):
        assert torch.allclose(a, b, atol=1e-6, rtol=0)


def test_dtensor_params_get_the_fused_kernel_too(tmp_path):
    """Tensor-parallel / FSDP2 parameters are DTensors: fused as well, the same numbers as the fused
    step on plain tensors (bit for bit: the kernel runs on the local shard) and as the unfused loop
    within 1e-6."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from nxdt.optim.optimizers import build_optimizer

    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        torch.manual_seed(0)
        plain = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4))
        unfused, sharded = copy.deepcopy(plain), copy.deepcopy(plain)
        for module in sharded:
            for name, param in list(module.named_parameters()):
                module.register_parameter(name, torch.nn.Parameter(distribute_tensor(param.detach(), mesh, [Shard(0)])))
        cfg = {"name": "adamw", "lr": 1e-2, "weight_decay": 0.1, "betas": [0.9, 0.95]}
        opts = [build_optimizer(plain, cfg), build_optimizer(sharded, cfg), build_optimizer(unfused, {**cfg, "foreach": False})]
        assert [o.defaults.get("fused") for o in opts] == [True, True, None]
        for step in range(5):
            gen = torch.Generator().manual_seed(step)
            grads = [torch.randn(p.shape, generator=gen) for p in plain.parameters()]
            for model, opt in zip((plain, sharded, unfused), opts):
                for p, g in zip(model.parameters(), grads):
                    p.grad = distribute_tensor(g, mesh, [Shard(0)]) if hasattr(p, "full_tensor") else g.clone()
                opt.step()
        for a, b, c in zip(plain.parameters(), sharded.parameters(), unfused.parameters()):
            assert torch.equal(a, b.full_tensor())
            assert torch.allclose(a, c, atol=1e-6, rtol=0)
    finally:
        dist.destroy_process_group()
