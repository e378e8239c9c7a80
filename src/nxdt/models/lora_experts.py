"""LoRA on MoE experts: a low-rank update per expert on the 3-D expert weights, as peft's
`target_parameters` (its lora.ParamWrapper) adapts transformers' MixtralExperts / Qwen3MoeExperts.

nxdt's experts (nxdt.models.moe.MoEExperts: native Mixtral-style and Qwen3-MoE models, and the
Mixtral blocks of model_source hf) keep two weights, W [E, out, in] each:

    mlp.experts.gate_up_proj   [E, 2F, H]        mlp.experts.down_proj   [E, H, F]

An adapted weight gets, per expert e, A_e [r, in] (kaiming-uniform, as peft) and B_e [out, r]
(zeros), stored in the expert layout beside it, so expert parallelism shards them with their
weight (Shard(0)) and FSDP like any block parameter:

    mlp.experts.lora_A.gate_up_proj   [E, r, H]     mlp.experts.lora_B.gate_up_proj   [E, 2F, r]
    mlp.experts.lora_A.down_proj      [E, r, F]     mlp.experts.lora_B.down_proj      [E, H, r]

and the experts compute with W_e + B_e A_e * alpha / r (peft's `torch.baddbmm(W, B, A, alpha=s)`).

peft keeps one pair of 2-D linears per adapted weight: lora_A.weight [E r, in] (expert e: rows
e r .. e r + r - 1) and lora_B.weight [out, r E] (expert e: columns j E + e, j < r); a second
adapted weight of the same module is a ParamWrapper around the first, so its keys get a
`base_layer.` per wrapper outside it. With both weights adapted (gate_up_proj wrapped first):

    base_model.model.<path>.experts.base_layer.lora_A.weight   gate_up_proj's A
    base_model.model.<path>.experts.lora_A.weight              down_proj's A

`to_peft` / `from_peft` convert between the two. peft's ParamWrapper takes no dropout, so
`lora_dropout` must be 0 with expert targets.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

import torch
from torch import nn

from nxdt.models.moe import MoEExperts

KEY = "model_alignment_strategy.peft"
EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")  # their order in the module: peft wraps the first innermost
TARGET_PARAMETERS = tuple(f"experts.{w}" for w in EXPERT_WEIGHTS)  # peft's target_parameters names
_PAIR_KEY = re.compile(r"(.+)\.lora_([AB])\.(gate_up_proj|down_proj)")


class ExpertAdapter(nn.Module):
    """The A (or B) factors of an experts module's adapted weights: one [E, ...] parameter per weight,
    named after it."""


class LoraExperts(MoEExperts):
    """MoEExperts with LoRA on some of its weights (`lora_A`, `lora_B`: ExpertAdapter children)."""

    rank: int
    alpha: float
    scaling: float
    adapters_enabled: bool

    def expert_weights(self, local=None) -> tuple[torch.Tensor, torch.Tensor]:
        local = local or (lambda w: w)
        out = []
        for name in EXPERT_WEIGHTS:
            w = local(getattr(self, name))
            a = self.lora_A._parameters.get(name) if "lora_A" in self._modules else None
            if a is not None and self.adapters_enabled:
                # peft's fold: W + scaling * B @ A per expert, in W's dtype
                w = torch.baddbmm(w, local(self.lora_B.get_parameter(name)).to(w.dtype), local(a).to(w.dtype),
                                  alpha=self.scaling)
            out.append(w)
        return out[0], out[1]

    def adapted(self) -> list[str]:
        """The weights that have adapters, in module order."""
        return [n for n in EXPERT_WEIGHTS if n in self.lora_A._parameters]

    @torch.no_grad()
    def reset_lora_parameters(self) -> None:
        """peft's init: each A uniform in +-1/sqrt(in) (kaiming-uniform, a = sqrt(5), of peft's
        [E r, in] matrix: the same draws in the same order), B zeros. A no-op on the meta device."""
        for name in self.adapted():
            a = self.lora_A.get_parameter(name)
            bound = 1.0 / math.sqrt(a.shape[-1])
            nn.init.uniform_(a, -bound, bound)
            nn.init.zeros_(self.lora_B.get_parameter(name))

    def delta(self, name: str) -> torch.Tensor:
        """B @ A * scaling for weight `name` ([E, out, in])."""
        return torch.bmm(self.lora_B.get_parameter(name), self.lora_A.get_parameter(name)) * self.scaling


def expert_modules_of(model: nn.Module) -> dict[str, MoEExperts]:
    return {path: m for path, m in model.named_modules() if isinstance(m, MoEExperts)}


def lora_experts(model: nn.Module) -> dict[str, LoraExperts]:
    """{module path: LoraExperts} in model order."""
    return {path: m for path, m in model.named_modules() if isinstance(m, LoraExperts)}


def resolve_expert_targets(target_parameters, model: nn.Module) -> list[str]:
    """The expert weight names `target_parameters` (peft's names, `experts.gate_up_proj` /
    `experts.down_proj`) mean, in module order; ValueError naming the key for a name that is not one,
    or for a model without nxdt's MoE experts."""
    if isinstance(target_parameters, str):
        target_parameters = [target_parameters]
    if not target_parameters:
        return []
    bad = [t for t in target_parameters if t not in TARGET_PARAMETERS]
    if bad:
        raise ValueError(f"{KEY}.target_parameters: '{bad[0]}' is not an expert weight; valid: "
                         f"{list(TARGET_PARAMETERS)}")
    if not expert_modules_of(model):
        raise ValueError(f"{KEY}.target_parameters {list(target_parameters)}: {type(model).__name__} has no "
                         "MoE experts of nxdt's (a dense model, or a transformers MoE block nxdt does not replace: "
                         "only Mixtral's is)")
    wanted = {t.split(".", 1)[1] for t in target_parameters}
    return [n for n in EXPERT_WEIGHTS if n in wanted]


def inject_expert_lora(model: nn.Module, names: list[str], rank: int, alpha: float) -> list[str]:
    """Adapters on the weights `names` (from `resolve_expert_targets`) of every MoEExperts of `model`
    (in place: each becomes a LoraExperts); they are created on the weights' device and dtype.
    Freezing is the caller's (nxdt.models.lora.inject_lora). Returns the adapted weights' keys."""
    done = []
    for path, experts in expert_modules_of(model).items():
        experts.__class__ = _lora_class(type(experts))
        experts.rank, experts.alpha = int(rank), float(alpha)
        experts.scaling, experts.adapters_enabled = experts.alpha / experts.rank, True
        experts.lora_A, experts.lora_B = ExpertAdapter(), ExpertAdapter()
        for name in names:
            w = getattr(experts, name)
            num, out_f, in_f = w.shape
            for holder, shape in ((experts.lora_A, (num, rank, in_f)), (experts.lora_B, (num, out_f, rank))):
                holder.register_parameter(name, nn.Parameter(torch.empty(shape, device=w.device, dtype=w.dtype)))
            done.append(f"{path}.{name}")
        experts.reset_lora_parameters()
    return done


_CLASSES: dict[type, type] = {MoEExperts: LoraExperts}


def _lora_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Lora{cls.__name__}", (LoraExperts, cls), {})
    return _CLASSES[cls]


def merge_expert_lora_(model: nn.Module) -> list[str]:
    """Fold every expert adapter into its weight and make the module a plain MoEExperts again."""
    merged = []
    for path, m in lora_experts(model).items():
        with torch.no_grad():
            for name in m.adapted():
                getattr(m, name).add_(m.delta(name).to(getattr(m, name).dtype))
                merged.append(f"{path}.{name}")
        del m._modules["lora_A"], m._modules["lora_B"]
        m.__class__ = next(c for c in type(m).__mro__ if c is not LoraExperts and not issubclass(c, LoraExperts))
    return merged


# --------------------------------------------------------------------------- state dicts
def expert_pairs(state: Mapping[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{adapted weight's key (`<path>.experts.gate_up_proj`): (A [E, r, in], B [E, out, r])} of a state
    dict; ValueError for an A without B or back."""
    found: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in state.items():
        m = _PAIR_KEY.fullmatch(key)
        if m:
            found.setdefault(f"{m.group(1)}.{m.group(3)}", {})[m.group(2)] = t
    broken = sorted(k for k, ab in found.items() if len(ab) != 2)
    if broken:
        raise ValueError(f"expert adapter weights missing for: {', '.join(broken[:5])}")
    return {k: (ab["A"], ab["B"]) for k, ab in found.items()}


def is_expert_lora_key(key: str) -> bool:
    return _PAIR_KEY.fullmatch(key) is not None


def expert_delta(a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """B @ A * scaling per expert, in fp32 ([E, out, in])."""
    return torch.bmm(b.float(), a.float()) * scaling


def to_peft(state: Mapping[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The expert adapters of a state dict (transformers' names) as peft saves them (module docstring)."""
    pairs = expert_pairs(state)
    by_module: dict[str, list[str]] = {}
    for key in pairs:
        module, _, name = key.rpartition(".")
        by_module.setdefault(module, []).append(name)
    out = {}
    for module, names in by_module.items():
        names = [n for n in EXPERT_WEIGHTS if n in names]
        for i, name in enumerate(names):
            a, b = pairs[f"{module}.{name}"]
            num, rank = a.shape[0], a.shape[1]
            where = f"{prefix}{module}." + "base_layer." * (len(names) - 1 - i)
            out[f"{where}lora_A.weight"] = a.reshape(num * rank, a.shape[2])
            out[f"{where}lora_B.weight"] = b.permute(1, 2, 0).reshape(b.shape[1], rank * num)
    return out


def from_peft(adapter: Mapping[str, torch.Tensor], target_parameters, num_experts: int,
              prefix: str) -> dict[str, torch.Tensor]:
    """peft's saved expert adapters (`adapter`: adapter_model.safetensors' tensors; `target_parameters`:
    its adapter_config.json's) → nxdt's keys and [E, ...] layout (transformers' module paths)."""
    targets = list(target_parameters or ())  # peft matches a name or its suffix (`mlp.experts.down_proj`)
    names = [n for n in EXPERT_WEIGHTS if any(t == f"experts.{n}" or t.endswith(f".experts.{n}") for t in targets)]
    out = {}
    for key, t in adapter.items():
        m = re.fullmatch(re.escape(prefix) + r"(.+\.experts)\.((?:base_layer\.)*)lora_([AB])\.weight", key)
        if not m:
            continue
        depth = m.group(2).count("base_layer.")
        name = names[len(names) - 1 - depth]
        if m.group(3) == "A":
            out[f"{m.group(1)}.lora_A.{name}"] = t.reshape(num_experts, -1, t.shape[-1])
        else:
            out[f"{m.group(1)}.lora_B.{name}"] = t.reshape(t.shape[0], -1, num_experts).permute(2, 0, 1).contiguous()
    return out
