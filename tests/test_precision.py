"""Precision presets, stochastic rounding, fp16 loss scaling and the NaN/inf guard.

The preset curves drive nxdt.precision.precision's object through nxdt.training.step.train_step
(the step NxdtLightningModule runs, without Lightning) on a tiny Llama in-process; one end-to-end
run of examples/train.py proves the wiring into the Lightning module.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import TINY_OVERRIDES, read_scalars, run_pool

from nxdt.config import ConfigError, apply_env

from nxdt.spec import build_spec, load_config
from nxdt.models import build_model
from nxdt.parallel.activation_checkpointing import apply_activation_checkpointing, checkpointed_modules
from nxdt.precision.precision import TORCH_DTYPES, DynamicLossScaler, NumericalInstabilityError, Precision
from nxdt.spec.precision import precision_settings
from nxdt.training.builder import build_harness
from nxdt.training.loss import masked_token_loss
from nxdt.training.step import microbatch_forward_backward, split_microbatches, train_step
from nxdt.precision.stochastic_rounding import round_to, stochastic_round_to_bf16

VOCAB = 256
STEPS = 100
MODEL = ["model.num_layers=1", "model.hidden_size=64", "model.ffn_hidden_size=128", "model.num_attention_heads=4",
         "model.num_kv_heads=2", "model.max_position_embeddings=64", "model.encoder_seq_length=16",
         "data.seq_length=16", "trainer.devices=1", "model.optim.sched.warmup_steps=5"]


def make_cfg(*overrides: str):
    return load_config(["--config-name", "tiny_llama_cpu", *MODEL, *overrides], world_size=1, check_paths=False,
                       quiet=True)


def _data(steps: int = 20) -> torch.Tensor:
    """Batches with a learnable rule (next = 3·tok + 1 mod V) from random starts: [steps, 4, 17]."""
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, VOCAB, (steps, 4, 17), generator=g)
    for t in range(1, 17):
        data[..., t] = (data[..., t - 1] * 3 + 1) % VOCAB
    noise = torch.rand(data.shape, generator=g) < 0.3  # some randomness so the loss stays away from 0
    return torch.where(noise, torch.randint(0, VOCAB, data.shape, generator=g), data)


def _as_batch(b: torch.Tensor) -> dict[str, torch.Tensor]:
    """Rows of _data as a training batch: next-token labels, every token counted."""
    return {"input_ids": b[:, :-1], "labels": b[:, 1:], "loss_mask": torch.ones(b.shape[0], b.shape[1] - 1)}


def _step(h, batch, step: int, microbatches: int = 1, loss_fn=masked_token_loss, clip: float | None = None):
    """One train_step of the harness `h` on `batch`, `microbatches` of gradient accumulation."""
    fwd_bwd = microbatch_forward_backward(h.model, h.precision, microbatches, loss_fn=loss_fn)
    return train_step(h.model, h.optimizer, h.scheduler, h.precision, fwd_bwd, batch, step=step, clip=clip)


def train_curve(*overrides: str, steps: int = STEPS, lr: float = 3e-3, sched: bool = True) -> tuple[list[float], Precision]:
    # one intra-op thread: these tiny models are overhead-bound, and a shared machine makes
    # multi-threaded runs of them up to 10x slower
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train_curve(*overrides, steps=steps, lr=lr, sched=sched)
    finally:
        torch.set_num_threads(threads)


def _train_curve(*overrides: str, steps: int, lr: float, sched: bool) -> tuple[list[float], Precision]:
    h = build_harness(make_cfg(f"model.optim.lr={lr}", *overrides), VOCAB, max_steps=steps if sched else None)
    data, losses = _data(), []
    for step in range(steps):
        # two micro-batches of 2 rows: accumulation
        m = _step(h, _as_batch(data[step % len(data)]), step, microbatches=2, clip=1.0)
        losses.append(float(m.loss))
    return losses, h.precision


# ----------------------------------------------------------------------------- stochastic rounding
def test_stochastic_rounding_is_unbiased():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, generator=g) * torch.logspace(-3, 3, 64)
    n = 20000
    rounded = stochastic_round_to_bf16(x.expand(n, 64).contiguous(), generator=g).float()
    lo = x.to(torch.bfloat16).float()  # a neighbour; the bracket [down, up] has width one ulp
    ulp = (torch.nextafter(lo.to(torch.bfloat16), torch.full_like(lo, math.inf).to(torch.bfloat16)).float() - lo).abs()
    mean = rounded.mean(0)
    # each draw is one of the two neighbours: std <= ulp / 2, so the mean is within 5 sigma
    assert ((mean - x).abs() <= 5 * ulp / (2 * math.sqrt(n))).all(), (mean - x).abs().max()
    # and every draw is one of the two bf16 neighbours of x
    assert ((rounded - x).abs() <= ulp * 1.0001).all()
    # round-to-nearest is biased on the same values (sanity check of the test's power)
    assert ((x.to(torch.bfloat16).float() - x).abs() > 5 * ulp / (2 * math.sqrt(n))).any()


def test_stochastic_rounding_is_exact_on_representable_values():
    g = torch.Generator().manual_seed(2)
    exact = (torch.randn(10000, generator=g) * 100).to(torch.bfloat16).float()
    specials = torch.tensor([0.0, -0.0, 1.0, -1.0, math.inf, -math.inf, 3.3895313892515355e38, 1e-40])
    for x in (exact, specials.to(torch.bfloat16).float()):
        for _ in range(3):
            assert torch.equal(stochastic_round_to_bf16(x, generator=g), x.to(torch.bfloat16))
    nan = stochastic_round_to_bf16(torch.tensor([math.nan, 1.5]))
    assert torch.isnan(nan[0]) and nan[1] == 1.5
    assert round_to(torch.tensor([1.0 + 2**-10]), torch.bfloat16).item() == 1.0  # round-to-nearest twin
    small = torch.full((4000,), 1.0 + 2**-10)  # 1/8 of an ulp above 1: rounds up 1/8 of the time
    up = (stochastic_round_to_bf16(small, generator=g).float() > 1).float().mean().item()
    assert abs(up - 0.125) < 0.03


# ----------------------------------------------------------------------------- loss scaler
def test_scaler_overflow_hysteresis_growth_and_min():
    s = DynamicLossScaler(loss_scale=0, initial_scale_power=4, loss_scale_window=3, hysteresis=2, min_loss_scale=2)
    assert s.scale == 16
    s.update(overflow=True)  # hysteresis 2: the first overflow only uses it up
    assert s.scale == 16 and s.cur_hysteresis == 1
    s.update(overflow=True)
    assert s.scale == 8
    s.update(overflow=True)  # hysteresis is not restored by overflows
    assert s.scale == 4
    for _ in range(2):
        s.update(overflow=False)
    assert s.scale == 4  # not yet a full window of clean steps
    s.update(overflow=False)
    assert s.scale == 8 and s.cur_hysteresis == 2  # grew after 3 clean steps, hysteresis restored
    for _ in range(6):
        s.update(overflow=True)
    assert s.scale == 2  # never below min_loss_scale
    state = s.state_dict()
    t = DynamicLossScaler(loss_scale=0, initial_scale_power=10)
    t.load_state_dict(state)
    assert t.state_dict() == state


def test_static_scale_never_changes():
    s = DynamicLossScaler(loss_scale=128.0)
    for overflow in (True, False, True):
        s.update(overflow)
    assert s.scale == 128.0


def _tiny_harness(*overrides):
    return build_harness(make_cfg(*overrides), VOCAB)


def _batch():
    return _as_batch(_data(1)[0])


def test_fp16_overflow_skips_scales_down_and_stops_after_too_many():
    h = _tiny_harness(
        "precision.fp16.enabled=true", "precision.fp16.initial_scale_power=200", "precision.fp16.hysteresis=1",
        "precision.fp16.max_consecutive_skips=3")
    model, prec = h.model, h.precision
    before = [p.detach().clone() for p in model.parameters()]
    scale0 = prec.loss_scale
    ok = _step(h, _batch(), step=7).applied
    assert not ok and prec.skipped_steps == 1 and prec.loss_scale == scale0 / 2
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))  # no update, fp32 masters back
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert prec.metrics() == {"loss_scale": scale0 / 2, "skipped_steps": 1.0}
    _step(h, _batch(), step=8)
    with pytest.raises(NumericalInstabilityError, match=r"^step 9: 3 steps in a row skipped .*loss scale "):
        _step(h, _batch(), step=9)


def test_fp16_trains_with_a_sane_scale():
    losses, prec = train_curve("precision.fp16.enabled=true", "precision.fp16.loss_scale_window=10", steps=30)
    assert losses[-1] < losses[0] - 0.3
    assert prec.loss_scale >= 2.0**16  # grew from 2**16 or stayed: no collapse
    state = prec.state_dict()
    other = Precision.from_spec(build_spec(make_cfg("precision.fp16.enabled=true")), rank=0)
    other.load_state_dict(state)
    assert other.loss_scale == prec.loss_scale and other.state_dict()["scaler"] == state["scaler"]


# ----------------------------------------------------------------------------- NaN / inf guard
def test_nonfinite_gradient_stops_naming_the_step_and_parameter():
    h = _tiny_harness()
    h.model.model.layers[0].mlp.up_proj.weight.register_hook(lambda g: g * math.nan)
    with pytest.raises(NumericalInstabilityError,
                       match=r"^step 5: non-finite gradient of model\.layers\.0\.mlp\.up_proj\.weight"):
        _step(h, _batch(), step=5)


def test_nonfinite_loss_is_skipped_with_on_nonfinite_skip():
    h = _tiny_harness("precision.on_nonfinite=skip", "precision.type=mixed_precision")
    model, prec = h.model, h.precision
    before = [p.detach().clone() for p in model.parameters()]

    def nan_loss(logits, labels, loss_mask):
        return masked_token_loss(logits, labels, loss_mask) * math.nan

    ok = _step(h, _batch(), step=3, loss_fn=nan_loss).applied
    assert not ok and prec.skipped_steps == 1 and prec.metrics() == {"skipped_steps": 1.0}
    assert all(torch.equal(a, p) and p.dtype == torch.float32 for a, p in zip(before, model.parameters()))
    ok = _step(h, _batch(), step=4).applied
    assert ok and prec.consecutive_skips == 0
    assert not all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    with pytest.raises(NumericalInstabilityError, match=r"^step 1: non-finite loss \(nan\)"):
        prec2 = Precision.from_spec(build_spec(make_cfg()), rank=0)
        prec2.check_step(1, torch.tensor(math.nan), torch.tensor(1.0), model)


# ----------------------------------------------------------------------------- presets
@pytest.fixture(scope="module")
def fp32_curve():
    return train_curve("precision.type=fp32")[0]


# preset overrides -> tolerance on |loss - fp32 loss| over 100 steps (bf16 compute changes the
# trajectory by ~1e-2; a wrong cast, lost master weights or dropped grads diverge by > 0.1)
PRESETS = {
    "autocast": (["precision.type=autocast"], 0.05),
    "mixed_precision": (["precision.type=mixed_precision"], 0.05),
    "mixed_precisionSR": (["precision.type=mixed_precisionSR"], 0.05),
    "mixed_precision_SR": (["precision.type=mixed_precision_SR"], 0.05),
    "bf16SR": (["precision.type=bf16SR"], 0.1),
    "manual": (["precision.type=manual", "precision.xla_downcast_bf16=1", "precision.master_weights=true",
                "precision.fp32_grad_acc=true"], 0.05),
}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_loss_curve_tracks_fp32(name, fp32_curve):
    overrides, tol = PRESETS[name]
    losses, prec = train_curve(*overrides)
    gap = max(abs(a - b) for a, b in zip(losses, fp32_curve))
    print(f"\n{name}: max |loss - fp32 loss| over {STEPS} steps = {gap:.4f} (tolerance {tol}); "
          f"final {losses[-1]:.4f} vs fp32 {fp32_curve[-1]:.4f}")
    assert fp32_curve[-1] < fp32_curve[0] - 1.0  # the reference itself learns
    assert gap < tol
    assert prec.skipped_steps == 0


class _WeightCasts(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the bf16 copies made of each parameter (by its storage) while active."""

    def __init__(self, model):
        super().__init__()
        self.params = {p.data_ptr() for p in model.parameters()}
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if (func is torch.ops.aten._to_copy.default and args[0].data_ptr() in self.params
                and out.dtype == torch.bfloat16):
            self.count += 1
        return out


@pytest.mark.parametrize("granularity", [None, "full"])
def test_autocast_casts_each_weight_once_a_step_not_once_a_microbatch(granularity):
    """Issue 19 item 5: four micro-batches of gradient accumulation (and activation checkpointing's
    recomputation) under precision.type=autocast reuse one bf16 copy of each weight a step; the
    loss and every gradient equal autocast around each micro-batch alone, bit for bit."""
    ac = [f"model.activations_checkpoint_granularity={granularity}"] if granularity else []
    cfg = make_cfg("precision.type=autocast", *ac)
    h = build_harness(cfg, VOCAB)
    if granularity:
        apply_activation_checkpointing(h.model, cfg.model)
        assert checkpointed_modules(h.model)
    batch = _as_batch(_data(1)[0].repeat(2, 1))  # 8 rows: 4 micro-batches of 2
    linear_weights = sum(1 for m in h.model.modules() if isinstance(m, torch.nn.Linear))
    counter = _WeightCasts(h.model)
    with counter:
        loss = microbatch_forward_backward(h.model, h.precision, 4)(batch)
    assert counter.count == linear_weights  # once each (before: 32, and 60 with the recomputation)
    grads = {n: p.grad.clone() for n, p in h.model.named_parameters()}

    h.model.zero_grad(set_to_none=True)
    reference = 0.0
    for mb in split_microbatches(batch, 4):  # the textbook way: autocast around each forward
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = h.model(input_ids=mb["input_ids"])
        mb_loss = masked_token_loss(logits, mb["labels"], mb["loss_mask"]) / 4
        mb_loss.backward()
        reference = reference + mb_loss.detach()
    assert torch.equal(loss, reference)
    assert all(torch.equal(p.grad, grads[n]) for n, p in h.model.named_parameters())


def test_preset_settings_and_dtypes():
    bf16, fp32 = torch.bfloat16, torch.float32
    expect = {
        "fp32": ("fp32", fp32, False), "autocast": ("autocast", bf16, False),
        "mixed_precision": ("master", bf16, False), "mixed_precisionSR": ("master", bf16, True),
        "mixed_precision_SR": ("master", bf16, True), "bf16SR": ("lowp", bf16, True),
    }
    for ptype, (mode, dtype, sr) in expect.items():
        s = precision_settings(make_cfg(f"precision.type={ptype}").precision)
        assert (s.mode, TORCH_DTYPES[s.compute_dtype], s.stochastic) == (mode, dtype, sr), ptype
    s = precision_settings(make_cfg("precision.type=manual").precision)
    assert s.mode == "fp32"  # neither XLA_USE_BF16 nor XLA_DOWNCAST_BF16: fp32
    s = precision_settings(make_cfg("precision.type=manual", "precision.xla_use_bf16=1",
                                    "precision.neuron_rt_stochastic_rounding_en=1").precision)
    assert (s.mode, s.stochastic, s.fp32_grad_acc) == ("lowp", True, False)
    # bf16SR keeps bf16 parameters and bf16 optimizer state; mixed precision keeps fp32 masters
    h = _tiny_harness("precision.type=bf16SR", "model.optim.name=adamw")
    _step(h, _batch(), step=0)
    assert all(p.dtype == bf16 for p in h.model.parameters())
    states = [v for st in h.optimizer.state.values() for v in st.values() if torch.is_tensor(v) and v.dim() > 0]
    assert states and all(v.dtype == bf16 for v in states)
    h = _tiny_harness("precision.type=mixed_precision")
    _step(h, _batch(), step=0)
    assert all(p.dtype == fp32 for p in h.model.parameters())
    policy = h.precision.fsdp_mp_policy()
    assert policy.param_dtype == bf16 and policy.reduce_dtype == fp32


def test_bf16SR_beats_round_to_nearest_when_updates_vanish():
    """lr 3e-5 with bf16 weights: the Adam updates (~lr) are below half an ulp of most weights.
    Round-to-nearest loses them (the loss does not move); stochastic rounding keeps them on
    average and follows fp32. The data cycles every 20 steps: compare the same 20 batches."""
    kw = dict(lr=3e-5, steps=60, sched=False)
    flat = "model.optim.sched.min_lr=0"  # no scheduler here; the config's min_lr must not exceed lr
    fp32, _ = train_curve("precision.type=fp32", flat, **kw)
    sr, _ = train_curve("precision.type=bf16SR", flat, **kw)
    rtn, _ = train_curve("precision.type=manual", "precision.xla_use_bf16=1", flat, **kw)  # bf16 params, no SR

    def drop(c):
        return sum(c[:20]) / 20 - sum(c[40:]) / 20

    drops = {"fp32": drop(fp32), "bf16SR": drop(sr), "bf16 round-to-nearest": drop(rtn)}
    print("\nloss drop (steps 0-19 vs 40-59) at lr 3e-5: " + ", ".join(f"{k} {v:.4f}" for k, v in drops.items()))
    assert drops["fp32"] > 0.01
    assert drops["bf16SR"] > 0.7 * drops["fp32"]
    assert drops["bf16 round-to-nearest"] < 0.3 * drops["fp32"]


# ----------------------------------------------------------------------------- config and env
def test_fp16_with_bf16_presets_is_a_config_error():
    with pytest.raises(ConfigError, match="precision.fp16.enabled"):
        make_cfg("precision.fp16.enabled=true", "precision.type=bf16SR")


@pytest.mark.parametrize("ptype", ["mixed_precision", "mixed_precisionSR", "mixed_precision_SR", "bf16SR", "fp32",
                                   "autocast", "manual"])
def test_env_keeps_the_users_variables(ptype):
    cfg = make_cfg(f"precision.type={ptype}")
    environ = {"XLA_USE_BF16": "user", "XLA_DOWNCAST_BF16": "user", "NEURON_RT_STOCHASTIC_ROUNDING_EN": "user",
               "NEURON_CC_FLAGS": "--auto-cast=all -O2"}
    apply_env(cfg, environ, is_xla=True)
    assert environ["XLA_USE_BF16"] == environ["XLA_DOWNCAST_BF16"] == "user"
    assert environ["NEURON_RT_STOCHASTIC_ROUNDING_EN"] == "user"
    # the user's --auto-cast wins over the preset's; other preset flags are appended once
    assert environ["NEURON_CC_FLAGS"].startswith("--auto-cast=all -O2")
    assert environ["NEURON_CC_FLAGS"].count("--auto-cast") == 1
    if ptype not in ("fp32", "manual"):
        assert environ["NEURON_CC_FLAGS"].endswith("--enable-mixed-precision-accumulation")


# ----------------------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def cli_runs(kjv_prefix, tmp_path_factory):
    """Two runs of examples/train.py's entry in one single-process launch (conftest.run_pool):
    mixed precision trains; a learning rate of 1e30 makes the loss non-finite: exit 3."""
    root = tmp_path_factory.mktemp("precision_cli")
    common = ["--config-name", "tiny_llama_cpu", *TINY_OVERRIDES, "trainer.devices=1", "trainer.max_steps=4",
              "trainer.val_check_interval=4", f"data.data_prefix=[1.0,{kjv_prefix}]"]
    argv = {
        "mixed_precision": [*common, "precision.type=mixed_precision", "model.optim.lr=1e-2",
                            "model.optim.sched.warmup_steps=1", "trainer.limit_val_batches=1",
                            f"exp_manager.explicit_log_dir={root / 'mixed_precision'}"],
        "nan": [*common, "model.optim.lr=1e30", "trainer.gradient_clip_val=0", "model.optim.sched.warmup_steps=0",
                "exp_manager.create_checkpoint_callback=false", f"exp_manager.explicit_log_dir={root / 'nan'}"],
    }
    return root, run_pool(argv, 1, root / "pool", expect={"nan": 3})


def test_train_cli_mixed_precision(cli_runs):
    root, _ = cli_runs
    losses = [v for _, v in sorted(read_scalars(root / "mixed_precision")["reduced_train_loss"].items())]
    assert len(losses) == 4 and all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0] - 0.3


def test_train_cli_stops_on_nan_with_one_line(cli_runs):
    proc = cli_runs[1]["nan"]  # exit 3: run_pool checked
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "non-finite" in errors[0] and "step " in errors[0], proc.stderr[-3000:]


# ----------------------------------------------------------------------------- XLA dispatch (no torch-xla needed)
def test_xla_dispatch_and_precision_on_xla(monkeypatch):
    import sys
    import types

    from nxdt import device as xla

    cfg = make_cfg()
    assert xla.use_xla(make_cfg("trainer.accelerator=xla"), environ={})
    assert not xla.use_xla(make_cfg("trainer.accelerator=cpu"), environ={"PJRT_DEVICE": "CPU"})
    monkeypatch.setattr(xla, "xla_available", lambda: True)
    assert xla.use_xla(cfg, environ={"PJRT_DEVICE": "CPU"}) and not xla.use_xla(cfg, environ={})
    monkeypatch.setattr(xla, "xla_available", lambda: False)
    assert not xla.use_xla(cfg, environ={"PJRT_DEVICE": "CPU"})  # auto: only when torch_xla is installed

    # on XLA the env vars cast: master / low-precision modes keep the built dtypes; autocast and fp16 stay
    for ptype, mode in (("mixed_precision", "fp32"), ("bf16SR", "fp32"), ("autocast", "autocast"), ("fp32", "fp32")):
        assert Precision.from_spec(build_spec(make_cfg(f"precision.type={ptype}")), rank=0, on_xla=True).mode == mode
    fp16 = Precision.from_spec(build_spec(make_cfg("precision.fp16.enabled=true")), rank=0, on_xla=True)
    assert fp16.mode == "master" and fp16.compute_dtype == torch.float16

    # off XLA a step closure runs at once; on XLA it is handed to xm.add_step_closure
    seen = []
    xla.in_step_closure(seen.append, torch.tensor(1.0))
    assert seen == [torch.tensor(1.0)]
    closures = []
    xm = types.SimpleNamespace(add_step_closure=lambda fn, args: closures.append((fn, args)))
    fake = types.ModuleType("torch_xla")
    fake.core = types.SimpleNamespace(xla_model=xm)
    monkeypatch.setitem(sys.modules, "torch_xla", fake)
    monkeypatch.setitem(sys.modules, "torch_xla.core", fake.core)
    monkeypatch.setitem(sys.modules, "torch_xla.core.xla_model", xm)
    monkeypatch.setattr(xla, "is_xla_tensor", lambda t: torch.is_tensor(t))
    prec = Precision.from_spec(build_spec(cfg), rank=0, on_xla=True)
    model = build_model(cfg, VOCAB)
    # the stop check is deferred (no sync before the update); it raises when the closure runs
    assert prec.check_step(4, torch.tensor(math.nan), torch.tensor(1.0), model) is True
    assert len(closures) == 1
    fn, args = closures[0]
    with pytest.raises(NumericalInstabilityError, match="^step 4: non-finite loss"):
        fn(*args)


def test_state_dict_is_plain_and_restores_the_sr_stream():
    cfg = make_cfg("precision.type=mixed_precisionSR")
    a = Precision.from_spec(build_spec(cfg), rank=0)
    x = torch.randn(1000)
    a._round(x, torch.bfloat16)
    state = a.state_dict()
    assert isinstance(state["sr_generators"]["cpu"], list)  # no tensors: safe in any checkpoint metadata
    b = Precision.from_spec(build_spec(cfg), rank=3)
    b.load_state_dict(state)
    assert torch.equal(a._round(x, torch.bfloat16), b._round(x, torch.bfloat16))
