"""`precision.type` in PyTorch terms: one object the training step calls at fixed points.

    configure_model:  model = p.convert_model(model)   before parallelize (dtype of the parameters)
                      p.attach(model)                  after parallelize (fp32 grad accumulation hooks)
    each step (nxdt.training.step.train_step):
                      p.begin_step(model)              before the first micro-batch
                      with p.step_autocast(device_type):      autocast preset: one weight cast a step
                          with p.autocast(device_type): forward     (for every micro-batch)
                          with p.backward_context(device_type): backward(p.scale_loss(loss))
                      p.finish_grads(model)            fp32 master weights + fp32 grads back in place, unscaled
                      ok = p.check_step(step, loss, grad_norm, model)   NaN/inf guard, fp16 overflow → skip
                      p.optimizer_step(optimizer) if ok else p.skip_step(optimizer, model)
    checkpoints:      p.state_dict() / p.load_state_dict(d)   (loss scaler, skip counters, SR generator)
    FSDP2/replicate:  p.fsdp_mp_policy()               MixedPrecisionPolicy for the data-parallel wrapper

Modes (what the presets mean on CPU/CUDA; on XLA the env vars of nxdt.config.env do the work):

| preset | parameters between steps | forward/backward | grads accumulated | update |
|---|---|---|---|---|
| fp32 | fp32 | fp32 | fp32 | fp32 |
| autocast | fp32 | torch.autocast(bf16) | fp32 | fp32 |
| mixed_precision | fp32 (master) | bf16 copy of the weights | fp32 | fp32 |
| mixed_precisionSR | fp32 (master) | bf16 copy, made with stochastic rounding | fp32 | fp32 |
| bf16SR | bf16 | bf16 | fp32, rounded once | computed in fp32, written back to bf16 params and optimizer state with stochastic rounding |
| manual | master_weights → like mixed_precision, else like bf16SR (SR from neuron_rt_stochastic_rounding_en); bf16 only when xla_use_bf16 or xla_downcast_bf16 is "1"; fp32_grad_acc chooses fp32 or bf16 accumulation |
| fp16.enabled | fp32 (master) | fp16 copy | fp32 | fp32, with a (dynamic) loss scale |

"master" mode swaps the parameters' storage (`p.data`): bf16 copies for forward and backward,
the fp32 masters back for clipping, the optimizer step and checkpoints. A model wrapped by FSDP2
(`fully_shard` / `replicate`) owns its parameter storage: there the wrapper casts
(`fsdp_mp_policy()`: param bf16, reduce fp32, fp32 accumulation without sync; for
mixed_precisionSR `nxdt.precision.sr_fsdp` makes that cast stochastic) and this object only adds
`torch.autocast` around the forward.
"""

from __future__ import annotations

import logging
import os
from contextlib import nullcontext
from dataclasses import replace
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy

from nxdt.device import in_step_closure
from nxdt.spec.precision import PrecisionSettings
from nxdt.precision.overflow import all_ranks_finite
from nxdt.precision.sr_fsdp import sr_states_of
from nxdt.precision.stochastic_rounding import round_to

log = logging.getLogger(__name__)


class NumericalInstabilityError(RuntimeError):
    """Training stopped on non-finite numbers; the message names the step, the tensor and the scale."""


# --------------------------------------------------------------------------- loss scaler
class DynamicLossScaler:
    """GPT-NeoX / DeepSpeed fp16 loss scaler.

    Dynamic (loss_scale 0): start at 2**initial_scale_power. An overflow skips the step; the
    scale is halved once `hysteresis` overflows have been seen (never below min_loss_scale).
    After `loss_scale_window` steps without overflow the scale doubles and hysteresis is
    restored. Static (loss_scale > 0): the scale never changes; overflows still skip the step.
    This is DeepSpeed's `DynamicLossScaler.update_scale` with consecutive_hysteresis=False.
    """

    def __init__(self, loss_scale: float = 0.0, initial_scale_power: int = 16, loss_scale_window: int = 1000,
                 hysteresis: int = 2, min_loss_scale: float = 1.0, scale_factor: float = 2.0) -> None:
        self.dynamic = loss_scale == 0
        self.scale = float(2.0 ** initial_scale_power) if self.dynamic else float(loss_scale)
        self.window = int(loss_scale_window)
        self.hysteresis = int(hysteresis)
        self.min_scale = float(min_loss_scale)
        self.factor = float(scale_factor)
        self.cur_hysteresis = self.hysteresis
        self.cur_iter = 0
        self.last_overflow_iter = -1

    def update(self, overflow: bool) -> None:
        """Advance the state machine by one step (call once per optimizer step, skipped or not)."""
        if self.dynamic:
            if overflow:
                if self.hysteresis <= 1 or self.cur_hysteresis <= 1:
                    self.scale = max(self.scale / self.factor, self.min_scale)
                else:
                    self.cur_hysteresis -= 1
                self.last_overflow_iter = self.cur_iter
            elif (self.cur_iter - self.last_overflow_iter) % self.window == 0:
                self.cur_hysteresis = self.hysteresis
                self.scale *= self.factor
        self.cur_iter += 1

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "cur_hysteresis": self.cur_hysteresis, "cur_iter": self.cur_iter,
                "last_overflow_iter": self.last_overflow_iter}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.cur_hysteresis = int(state["cur_hysteresis"])
        self.cur_iter = int(state["cur_iter"])
        self.last_overflow_iter = int(state["last_overflow_iter"])


# --------------------------------------------------------------------------- settings
# nxdt.spec.precision names the compute dtype (its PrecisionSettings, the one settings class);
# this is the torch side of the name.
TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def fsdp_mixed_precision_policy(settings: PrecisionSettings):
    """The FSDP2 MixedPrecisionPolicy of a run's precision settings (the Precision object's, so fp16
    all-gathers fp16): bf16/fp16 compute copies with fp32 gradient reduction for the master-weight
    presets, fp32 reduction for bf16SR; None for fp32 / autocast."""
    return Precision(settings).fsdp_mp_policy()


def stochastic_master_weights(settings: PrecisionSettings) -> bool:
    """mixed_precisionSR (or manual with master weights and SR): the bf16 copies are rounded stochastically."""
    return settings.mode == "master" and settings.stochastic


# --------------------------------------------------------------------------- the object
def _is_fsdp_managed(model: nn.Module) -> bool:
    return any(isinstance(m, FSDPModule) for m in model.modules())


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


def _set_data(p: nn.Parameter, value: torch.Tensor) -> None:
    """`p.data = value`, for a DTensor parameter (tensor / sequence parallel) too: setting `.data`
    swaps only the DTensor's outer metadata, its local shard (what the ops compute with) stays the
    old tensor, so the swap is made there as well. Without it a tp/sp norm weight claims bf16 and
    computes in fp32, and activation checkpointing's recompute sees the other dtype."""
    p.data = value
    local = getattr(value, "_local_tensor", None)
    if local is not None:
        p._local_tensor = local


class Precision:
    def __init__(self, settings: PrecisionSettings, *, on_nonfinite: str = "stop", max_consecutive_skips: int = 50,
                 scaler: DynamicLossScaler | None = None, seed: int = 0) -> None:
        self.settings = settings
        self.on_nonfinite = on_nonfinite
        self.max_consecutive_skips = int(max_consecutive_skips)
        self.scaler = scaler
        self.seed = seed
        self.skipped_steps = 0
        self.consecutive_skips = 0
        self.delegated = False  # True when FSDP2 owns the parameter storage (casts done by its policy)
        self._masters: dict[nn.Parameter, torch.Tensor] = {}
        self._acc: dict[nn.Parameter, torch.Tensor] = {}
        self._hooks: list[Any] = []
        self._generators: dict[str, torch.Generator] = {}
        self._sr_states: list = []  # nxdt.precision.sr_fsdp.SRState of FSDP2-sharded SR weights
        self._sr_step = 0
        # XLA: with on_nonfinite=stop (and no fp16), check in a step closure after the graph ran
        # instead of syncing before the update; the run then stops one update late.
        self.lazy_guard = False

    @classmethod
    def from_spec(cls, spec: Any, rank: int | None = None, on_xla: bool = False) -> Precision:
        """From the run spec (nxdt.spec.RunSpec: its precision settings, `cfg.precision`'s fp16 and
        NaN-guard keys, `cfg.seed`); `rank` (default: $RANK) decorrelates SR noise.

        `on_xla`: the XLA env vars (nxdt.config.env) do the bf16 casting and the stochastic
        rounding there, so the master/low-precision modes keep the dtypes as built; autocast and
        fp16 stay; the NaN/inf stop check runs in a step closure (no extra graph sync).
        """
        if rank is None:
            rank = int(os.environ.get("RANK", "0") or 0)
        cfg = spec.cfg
        pcfg = cfg.precision
        settings = spec.precision
        if on_xla and settings.mode in ("master", "lowp") and not settings.fp16:
            settings = replace(settings, mode="fp32", compute_dtype="fp32", stochastic=False)
        f = pcfg.fp16
        scaler = None
        if settings.fp16:
            scaler = DynamicLossScaler(f.loss_scale, f.initial_scale_power, f.loss_scale_window, f.hysteresis,
                                       f.min_loss_scale)
        out = cls(settings, on_nonfinite=pcfg.on_nonfinite, max_consecutive_skips=f.max_consecutive_skips,
                  scaler=scaler, seed=cfg.seed * 1000003 + rank)
        out.lazy_guard = on_xla
        return out

    # ---- properties ----------------------------------------------------------------------------
    @property
    def mode(self) -> str:
        return self.settings.mode

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the forward and backward run in (the settings' name in torch)."""
        return TORCH_DTYPES[self.settings.compute_dtype]

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else 1.0

    def _generator(self, device: torch.device) -> torch.Generator:
        key = str(device)
        if key not in self._generators:
            self._generators[key] = torch.Generator(device=device).manual_seed(self.seed)
        return self._generators[key]

    def _round(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        sr = self.settings.stochastic
        return round_to(x, dtype, sr, self._generator(_local(x).device) if sr else None)

    # ---- configure time ------------------------------------------------------------------------
    def convert_model(self, model: nn.Module) -> nn.Module:
        """Parameter dtype before parallelization: bf16 for the low-precision mode, else fp32 as built.

        Only parameters are converted; buffers (RoPE frequencies) stay fp32.
        """
        if self.mode == "lowp":
            with torch.no_grad():
                for p in model.parameters():
                    if p.is_floating_point():
                        p.data = p.data.to(self.compute_dtype)
        return model

    def fsdp_mp_policy(self):
        """MixedPrecisionPolicy for FSDP2 `fully_shard` / `replicate`, or None (keep the dtypes).

        mixed_precision*, fp16 and manual with master weights: compute in bf16/fp16 copies of the
        fp32 sharded (master) parameters, reduce gradients in fp32 (FSDP2 then also accumulates
        unsynced micro-batch gradients in fp32). bf16SR / manual without master weights: the
        parameters are already bf16; reduce in fp32.
        """
        if self.mode == "master":
            return MixedPrecisionPolicy(param_dtype=self.compute_dtype, reduce_dtype=torch.float32)
        if self.mode == "lowp":
            return MixedPrecisionPolicy(reduce_dtype=torch.float32)
        return None

    def attach(self, model: nn.Module, delegate: bool = False) -> None:
        """After parallelization: choose who casts, and install the fp32 accumulation hooks.

        `delegate=True` (or an FSDP2-wrapped model): this object does not touch the parameter
        storage; master mode then computes under torch.autocast (bf16/fp16, fp32 grads).
        """
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self.delegated = delegate or _is_fsdp_managed(model)
        self._sr_states = sr_states_of(model) if self.settings.stochastic else []
        for state in self._sr_states:  # FSDP2's all-gather rounds with this run's seed (and rank)
            state.seed, state.step = self.seed, self._sr_step
        if self.delegated or self.mode not in ("master", "lowp") or not self.settings.fp32_grad_acc:
            return
        for p in model.parameters():
            if p.requires_grad:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._accumulate))

    def _accumulate(self, p: nn.Parameter) -> None:
        """Post-accumulate-grad hook: move each micro-batch's low-precision grad into an fp32 sum."""
        acc = self._acc.get(p)
        if acc is None:
            self._acc[p] = p.grad.to(torch.float32, copy=True)
        else:
            acc.add_(p.grad)
        p.grad = None

    # ---- forward / backward --------------------------------------------------------------------
    def autocast(self, device_type: str):
        """Context for the forward pass."""
        s = self.settings
        if s.mode == "autocast" or (self.delegated and s.mode == "master"):
            return torch.autocast(device_type=device_type, dtype=self.compute_dtype)
        return nullcontext()

    def _caches_casts_per_step(self) -> bool:
        # not when a data-parallel wrapper owns the weights (FSDP2): its unsharded weights would
        # stay alive in the cast cache across micro-batches, undoing the sharding
        return self.settings.mode == "autocast" and not self.delegated

    def step_autocast(self, device_type: str):
        """Context around all micro-batches of a step, forward and backward (autocast preset).

        torch.autocast keeps the low-precision copy of every weight it casts until its outermost
        context exits: one context around the whole step casts each weight once per step, not once
        per micro-batch, and activation checkpointing's recomputation reuses the copies too. The
        backward runs inside `backward_context` (autocast off, as torch prescribes for backward;
        the nesting keeps the cache). Nothing for the other presets (master mode casts once per
        step in begin_step)."""
        if self._caches_casts_per_step():
            return torch.autocast(device_type=device_type, dtype=self.compute_dtype)
        return nullcontext()

    def backward_context(self, device_type: str):
        """Inside step_autocast: autocast off for the backward, its cast cache kept."""
        if self._caches_casts_per_step():
            return torch.autocast(device_type=device_type, enabled=False)
        return nullcontext()

    def begin_step(self, model: nn.Module) -> None:
        """Before the first micro-batch: master mode swaps in low-precision copies of the fp32 weights."""
        self._acc.clear()
        self._sr_step += 1
        for state in self._sr_states:  # new random bits for this step's bf16 weights under FSDP2
            state.step = self._sr_step
        if self.mode != "master" or self.delegated:
            return
        dtype = self.compute_dtype
        with torch.no_grad():
            for p in model.parameters():
                if not p.is_floating_point():
                    continue
                p.grad = None
                self._masters[p] = p.data
                _set_data(p, self._round(p.data, dtype))

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scaler.scale if self.scaler is not None else loss

    def finish_grads(self, model: nn.Module) -> None:
        """After the last backward: fp32 masters back in the parameters, fp32 grads in .grad, unscaled."""
        if self.mode in ("master", "lowp") and not self.delegated:
            with torch.no_grad():
                for p in model.parameters():
                    master = self._masters.pop(p, None)
                    acc = self._acc.pop(p, None)
                    grad = acc if acc is not None else p.grad
                    p.grad = None
                    if master is not None:
                        _set_data(p, master)
                    if grad is not None:
                        p.grad = grad.to(p.dtype)
        if self.scaler is not None and self.scaler.scale != 1.0:
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, 1.0 / self.scaler.scale)

    # ---- guard ---------------------------------------------------------------------------------
    def check_step(self, step: int, loss: torch.Tensor | None, grad_norm: torch.Tensor, model: nn.Module) -> bool:
        """True: apply this step. False: skip it (fp16 overflow, or a NaN/inf with on_nonfinite=skip).

        Raises NumericalInstabilityError (on_nonfinite=stop, or too many skips in a row).
        Call after finish_grads and before clipping, once per optimizer step.
        """
        if self.lazy_guard and self.scaler is None and self.on_nonfinite == "stop":
            args = (loss.detach(),) if loss is not None else ()
            in_step_closure(lambda *a: self._check_now(step, a[0] if a else None, grad_norm.detach(), model),
                            *args, grad_norm.detach())
            return True
        return self._check_now(step, loss, grad_norm, model)

    def _check_now(self, step: int, loss: torch.Tensor | None, grad_norm: torch.Tensor, model: nn.Module) -> bool:
        loss_ok = loss is None or bool(torch.isfinite(loss.detach()).all())
        local_ok = loss_ok and bool(torch.isfinite(grad_norm.detach()))
        finite = all_ranks_finite(local_ok, _local(grad_norm).device)  # skip on all ranks or on none
        if self.scaler is not None:
            old = self.scaler.scale
            self.scaler.update(overflow=not finite)
        if finite:
            self.consecutive_skips = 0
            return True
        where = self._where_nonfinite(loss, loss_ok, grad_norm, model) if not local_ok else "values on another rank"
        if self.scaler is None and self.on_nonfinite == "stop":
            raise NumericalInstabilityError(f"step {step}: non-finite {where}; stopping "
                                            "(precision.on_nonfinite=stop; set it to skip to skip such steps)")
        self.skipped_steps += 1
        self.consecutive_skips += 1
        scale = f", loss scale {old:g} -> {self.scaler.scale:g}" if self.scaler is not None else ""
        if self.consecutive_skips >= self.max_consecutive_skips:
            raise NumericalInstabilityError(
                f"step {step}: {self.consecutive_skips} steps in a row skipped on non-finite values "
                f"(last: {where}{scale}); stopping (precision.fp16.max_consecutive_skips="
                f"{self.max_consecutive_skips})")
        what = "fp16 overflow" if self.scaler is not None else "non-finite values"
        log.warning("step %d: %s (%s): step skipped%s", step, what, where, scale)
        return False

    @staticmethod
    def _where_nonfinite(loss, loss_ok: bool, grad_norm: torch.Tensor, model: nn.Module) -> str:
        if not loss_ok:
            return f"loss ({float(loss.detach().float().reshape(-1)[0])})"
        for name, p in model.named_parameters():
            g = p.grad
            if g is not None and not bool(torch.isfinite(_local(g)).all()):
                return f"gradient of {name} (gradient norm {float(grad_norm)})"
        return f"gradient norm ({float(grad_norm)})"

    # ---- optimizer -----------------------------------------------------------------------------
    def skip_step(self, optimizer, model: nn.Module) -> None:
        """Drop the gradients and call optimizer.step() as a no-op (so Lightning still counts the step)."""
        for p in model.parameters():
            p.grad = None
        optimizer.step()

    def optimizer_step(self, optimizer) -> None:
        """optimizer.step(); in the low-precision mode the update is computed in fp32 and rounded back."""
        inner = getattr(optimizer, "optimizer", optimizer)  # LightningOptimizer → torch optimizer
        if self.mode != "lowp" or getattr(inner, "_FP32_STATE", None):  # AdamWFP32OptState keeps fp32 masters
            optimizer.step()
            return
        swaps = self._swap_in_fp32(inner)
        try:
            optimizer.step()
        finally:
            self._swap_back(inner, swaps)

    def _swap_in_fp32(self, opt: torch.optim.Optimizer) -> list[tuple[dict, int, nn.Parameter, nn.Parameter]]:
        """Replace each low-precision param (with a grad) by an fp32 stand-in carrying fp32 grad and state."""
        swaps = []
        with torch.no_grad():
            for group in opt.param_groups:
                for i, p in enumerate(group["params"]):
                    if p.grad is None or p.dtype == torch.float32:
                        continue
                    p32 = nn.Parameter(p.detach().to(torch.float32))
                    p32.grad = p.grad.to(torch.float32)
                    state = opt.state.pop(p, None)
                    if state:
                        opt.state[p32] = {k: (v.to(torch.float32) if torch.is_tensor(v) and v.is_floating_point()
                                              and v.shape == p.shape else v) for k, v in state.items()}
                    group["params"][i] = p32
                    swaps.append((group, i, p, p32))
        return swaps

    def _swap_back(self, opt: torch.optim.Optimizer, swaps) -> None:
        """Write the fp32 results back into the original parameters and state (stochastic rounding for SR)."""
        with torch.no_grad():
            for group, i, p, p32 in swaps:
                group["params"][i] = p
                _local(p).copy_(_local(self._round(p32.data, p.dtype)))
                state = opt.state.pop(p32, None)
                if state:
                    opt.state[p] = {k: (self._round(v, p.dtype) if torch.is_tensor(v) and v.is_floating_point()
                                        and v.shape == p.shape else v) for k, v in state.items()}

    # ---- logging and checkpoints ---------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        """Scalars to log each step: loss_scale (fp16) and skipped_steps (when steps can be skipped)."""
        out: dict[str, float] = {}
        if self.scaler is not None:
            out["loss_scale"] = float(self.scaler.scale)
        if self.scaler is not None or self.on_nonfinite == "skip":
            out["skipped_steps"] = float(self.skipped_steps)
        return out

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint must carry: the loss scaler, the skip counters, the SR generators."""
        return {
            "type": self.settings.ptype,
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "skipped_steps": self.skipped_steps,
            "consecutive_skips": self.consecutive_skips,
            "sr_generators": {k: g.get_state().tolist() for k, g in self._generators.items()},  # plain ints
            "sr_step": self._sr_step,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("scaler") is not None and self.scaler is not None:
            self.scaler.load_state_dict(state["scaler"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.consecutive_skips = int(state.get("consecutive_skips", 0))
        self._sr_step = int(state.get("sr_step", 0))
        for sr in self._sr_states:
            sr.step = self._sr_step
        for key, gstate in (state.get("sr_generators") or {}).items():
            self._generator(torch.device(key)).set_state(torch.tensor(gstate, dtype=torch.uint8))

