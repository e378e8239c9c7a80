"""LoRA in plain PyTorch, under the module names `peft` saves, for both model sources.

A targeted `nn.Linear` becomes a `LoraLinear`: still an `nn.Linear` (the frozen base keeps its
`weight` / `bias` names, so checkpoints, plans and conversion see the same keys as without LoRA),
plus two small children. For a linear at `model.layers.0.self_attn.q_proj`:

    model.layers.0.self_attn.q_proj.weight            the frozen base W  [out, in]
    model.layers.0.self_attn.q_proj.lora_A.weight     A  [r, in]   kaiming-uniform (as peft)
    model.layers.0.self_attn.q_proj.lora_B.weight     B  [out, r]  zeros (as peft): training starts at the base
    y = x W^T + b + B(A(dropout(x))) * alpha / r

PEFT saves the same tensors as `base_model.model.<fqn>.lora_A.weight` (the adapter name
"default" is stripped on save), so an adapter folder is a rename away (`peft_adapter_state`,
`peft_adapter_config`). The scaling is peft's default alpha / r (not rsLoRA).

Targets use NxDT's names (`model_alignment_strategy.peft.target_modules`): the fused `qkv_proj`
(q, k and v) and `gate_up_proj` (gate and up), or the plain q/k/v/o/gate/up/down_proj. Only
linears inside the decoder blocks are targets; routers are not. MoE experts (stacked 3-D weights)
are targeted by `target_parameters` (peft's key and names: `experts.gate_up_proj`,
`experts.down_proj`): nxdt.models.lora_experts.

`modules_to_save` (peft's LoraConfig key; LLaMA-MoE's `cpt_lora.py --modules_to_save embed_tokens,lm_head`):
whole modules trained in full beside the adapters and saved with them. A module is named as peft
matches it: its path as peft sees it (`base_model.model.<path>`) ends with the name, a plain string
suffix (`norm` is `model.norm` and every `input_layernorm` / `post_attention_layernorm`). peft trains
a copy (`<m>.modules_to_save.default`) beside the frozen original; nxdt trains the module in place
(same values after every step; the original is gone, so `adapters_disabled` does not give it back)
and saves it as `<m>.weight`, which is also the key peft's adapter file uses (`base_model.model.<m>.weight`).
transformers' GPTNeoXForCausalLM has other names (query_key_value, dense, dense_h_to_4h,
dense_4h_to_h): NxDT's names map onto them, and its own names are accepted too.

Everything here works on a meta-device model (adapters are created on the base's device and
dtype and drawn by `reset_lora_parameters`, which `nxdt.models.init_model_weights` calls after the
model's own initialisation). Parallelism is applied from outside (nxdt.parallel.tensor_parallel
distributes the adapters like the base weight); nothing here knows of process groups.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from nxdt.models.lora_experts import (
    LoraExperts,
    expert_delta,
    expert_pairs,
    from_peft,
    inject_expert_lora,
    is_expert_lora_key,
    lora_experts,
    merge_expert_lora_,
    resolve_expert_targets,
    to_peft,
)

KEY = "model_alignment_strategy.peft"
BIAS_MODES = ("none", "all", "lora_only")
ADAPTER_CHILDREN = ("lora_A", "lora_B", "lora_dropout")
PEFT_PREFIX = "base_model.model."

# Llama-style trees (the native model, transformers' Llama and Mixtral): NxDT's fused names → the linears
LLAMA_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LLAMA_ALIASES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
# transformers' GPT-NeoX: fused QKV, no gate; NxDT's names map onto its own
NEOX_NAMES = ("query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h")
NEOX_ALIASES = {"qkv_proj": ("query_key_value",), "o_proj": ("dense",), "up_proj": ("dense_h_to_4h",),
                "gate_up_proj": ("dense_h_to_4h",), "down_proj": ("dense_4h_to_h",)}

_LORA_KEY = re.compile(r"(^|\.)lora_[AB]\.")
PEFT_EXPERT_KEY = re.compile(r"\.experts\.(base_layer\.)*lora_[AB]\.weight$")  # peft's expert adapters


class LoraLinear(nn.Linear):
    """`nn.Linear` plus a low-rank update: forward = x W^T + b + lora_B(lora_A(dropout(x))) * scaling.

    The base parameters keep their names (`weight`, `bias`) and are not copied by `from_linear`.
    `adapters_enabled = False` (see `adapters_disabled`) computes the base alone.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, rank: int, alpha: float,
                 dropout: float = 0.0, device: Any = None, dtype: torch.dtype | None = None) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._add_adapters(rank, alpha, dropout)

    @classmethod
    def from_linear(cls, linear: nn.Linear, rank: int, alpha: float, dropout: float = 0.0) -> LoraLinear:
        """A LoraLinear around `linear`'s own parameters (same Parameter objects, no copy)."""
        lora = cls.__new__(cls)
        nn.Module.__init__(lora)
        lora.in_features, lora.out_features = linear.in_features, linear.out_features
        lora.weight = linear.weight
        lora.register_parameter("bias", linear.bias)
        lora._add_adapters(rank, alpha, dropout)
        lora.train(linear.training)
        return lora

    def _add_adapters(self, rank: int, alpha: float, dropout: float) -> None:
        check_lora_values(rank, alpha, dropout)
        self.rank, self.alpha = int(rank), float(alpha)
        self.scaling = self.alpha / self.rank
        self.adapters_enabled = True
        # Built on the meta device and then allocated, so nn.Linear's own init does not run: each
        # adapter draws from the random generator once, in reset_lora_parameters.
        device, dtype = self.weight.device, self.weight.dtype
        self.lora_A = nn.Linear(self.in_features, self.rank, bias=False, device="meta", dtype=dtype)
        self.lora_B = nn.Linear(self.rank, self.out_features, bias=False, device="meta", dtype=dtype)
        if device.type != "meta":
            self.lora_A.to_empty(device=device)
            self.lora_B.to_empty(device=device)
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.reset_lora_parameters()

    @torch.no_grad()
    def reset_lora_parameters(self) -> None:
        """peft's init: A kaiming-uniform (a = sqrt(5), nn.Linear's default), B zeros, so the model
        starts as the base. A no-op on the meta device."""
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)

    def delta_weight(self) -> torch.Tensor:
        """B @ A * scaling: what merging adds to the base weight ([out, in])."""
        return (self.lora_B.weight @ self.lora_A.weight) * self.scaling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        if not self.adapters_enabled:
            return out
        # same order of operations as peft's lora.Linear: B(A(dropout(x))) * scaling, then the add
        return out + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}, alpha={self.alpha:g}"


def check_lora_values(rank: int, alpha: float, dropout: float) -> None:
    """ValueError naming the key for a rank, alpha or dropout LoRA cannot use."""
    if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
        raise ValueError(f"{KEY}.lora_rank: must be an integer > 0, got {rank!r}")
    if not alpha > 0:
        raise ValueError(f"{KEY}.lora_alpha: must be > 0, got {alpha!r}")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"{KEY}.lora_dropout: must be in [0, 1), got {dropout!r}")


# --------------------------------------------------------------------------- targets and injection
def decoder_blocks_path(model: nn.Module) -> str:
    """Where the decoder blocks are: `model.layers` (native, Llama, Mixtral, pipeline stages) or
    `gpt_neox.layers` (transformers' GPT-NeoX)."""
    for inner in ("model", "gpt_neox"):
        if isinstance(getattr(getattr(model, inner, None), "layers", None), nn.Module):
            return f"{inner}.layers"
    raise ValueError(f"{type(model).__name__}: no decoder blocks (expected model.layers or gpt_neox.layers)")


def _block_linears(model: nn.Module) -> Iterator[tuple[str, nn.Linear]]:
    """(path, module) of every plain nn.Linear inside the decoder blocks."""
    prefix = decoder_blocks_path(model) + "."
    for path, module in model.named_modules():
        if path.startswith(prefix) and isinstance(module, nn.Linear) and not isinstance(module, LoraLinear):
            yield path, module


def resolve_targets(target_modules: list[str] | tuple[str, ...], present: set[str]) -> set[str]:
    """The linear leaf names `target_modules` (NxDT's or the model's own names) mean, given the leaf
    names `present` in the decoder blocks. ValueError for a name the model does not have, listing the
    valid ones (aliases included)."""
    neox = "query_key_value" in present or "dense_h_to_4h" in present
    names, aliases = (NEOX_NAMES, NEOX_ALIASES) if neox else (LLAMA_NAMES, LLAMA_ALIASES)
    own = [n for n in names if n in present]
    fused = {alias: [n for n in expansion if n in present] for alias, expansion in aliases.items()}
    valid = sorted(set(own) | {alias for alias, found in fused.items() if found})
    if isinstance(target_modules, str):
        target_modules = [target_modules]
    resolved: set[str] = set()
    for name in target_modules:
        if name in own:
            resolved.add(name)
        elif fused.get(name):
            resolved.update(fused[name])
        else:
            raise ValueError(f"{KEY}.target_modules: '{name}' is not a linear layer of this model; valid: {valid}")
    return resolved


def inject_lora(model: nn.Module, target_modules: list[str] | tuple[str, ...], rank: int, alpha: float,
                dropout: float = 0.0, bias: str = "none", target_parameters: list[str] | tuple[str, ...] = (),
                modules_to_save: list[str] | tuple[str, ...] = ()) -> list[str]:
    """Wrap every targeted linear of the decoder blocks in a `LoraLinear` (in place) and freeze the rest;
    `target_parameters` (peft's `experts.gate_up_proj`, `experts.down_proj`) put adapters on the MoE
    experts' weights too (nxdt.models.lora_experts; lora_dropout must then be 0, as peft requires).

    Afterwards only the adapters require grad, plus the biases `bias` names (NxDT's / peft's
    lora_bias): 'none'; 'all' every bias of the model; 'lora_only' the wrapped linears' biases;
    and every parameter of the modules `modules_to_save` names (`saved_module_keys`). Returns the
    wrapped module paths (then the adapted expert weights' keys) in model order. Call it on the whole model as built (real or meta device), before parallelizing or splitting it into
    pipeline stages.
    """
    check_lora_values(rank, alpha, dropout)
    if bias not in BIAS_MODES:
        raise ValueError(f"{KEY}.lora_bias: must be one of {', '.join(BIAS_MODES)}, got {bias!r}")
    if lora_modules(model) or lora_experts(model):
        raise ValueError(f"{type(model).__name__} already has LoRA adapters")
    expert_names = resolve_expert_targets(target_parameters, model)
    if expert_names and dropout:
        raise ValueError(f"{KEY}.lora_dropout: must be 0 with target_parameters (peft's adapters on the expert "
                         f"weights take no dropout), got {dropout}")
    linears = list(_block_linears(model))
    wanted = resolve_targets(target_modules, {path.rpartition(".")[2] for path, _ in linears}) if target_modules \
        else set()
    wrapped = []
    for path, linear in linears:
        if path.rpartition(".")[2] in wanted:
            parent_path, _, leaf = path.rpartition(".")
            setattr(model.get_submodule(parent_path), leaf, LoraLinear.from_linear(linear, rank, alpha, dropout))
            wrapped.append(path)
    if expert_names:
        wrapped += inject_expert_lora(model, expert_names, rank, alpha)
    for name, p in model.named_parameters():
        p.requires_grad_(is_lora_key(name) or (bias == "all" and _is_bias(name)))
    if bias == "lora_only":
        for module in lora_modules(model).values():
            if module.bias is not None:
                module.bias.requires_grad_(True)
    for name in saved_module_keys(model, modules_to_save):
        model.get_parameter(name).requires_grad_(True)
    return wrapped


def is_saved_module_key(key: str, modules_to_save: list[str] | tuple[str, ...]) -> bool:
    """Whether parameter / state-dict key `key` (a path in the model, no prefix) lies in a module that
    peft's `modules_to_save` names: a module above it, its path written as peft sees it
    (`base_model.model.<path>`), ends with one of the names (peft's `key.endswith(target_key)`)."""
    parts = key.split(".")[:-1]
    return any((PEFT_PREFIX + ".".join(parts[:i])).rstrip(".").endswith(tuple(modules_to_save))
               for i in range(len(parts), -1, -1)) if modules_to_save else False


def saved_module_keys(model: nn.Module, modules_to_save: list[str] | tuple[str, ...]) -> list[str]:
    """The parameters of the modules `modules_to_save` names (after LoRA's injection), in model order.
    ValueError for a name that matches no module with parameters, for a module that holds adapters
    or is part of an adapted one (a module is either adapted or trained in full), and for a weight
    shared with another module (tied embeddings: peft trains a separate copy in each module, which
    unties them; nxdt would train the one shared weight)."""
    if not modules_to_save:
        return []
    key = f"{KEY}.modules_to_save"
    every = list(model.named_parameters(remove_duplicate=False))
    keys = {n for n, _ in every if is_saved_module_key(n, modules_to_save)}
    for name in modules_to_save:
        if not any(is_saved_module_key(n, [name]) for n in keys):
            raise ValueError(f"{key}: '{name}' matches no module with parameters in this model (peft's rule: a "
                             f"module path ending with it, e.g. embed_tokens, lm_head, norm)")
    adapted = tuple(f"{path}." for path in {**lora_modules(model), **lora_experts(model)})
    clash = next((n for n, _ in every if n in keys and n.startswith(adapted)), None)
    if clash is not None:
        raise ValueError(f"{key}: {clash} is in a module with LoRA adapters (target_modules / target_parameters): "
                         "not supported yet; a module is either adapted or trained in full")
    chosen = {id(p) for n, p in every if n in keys}
    shared = next((n for n, p in every if id(p) in chosen and n not in keys), None)
    if shared is not None:
        raise ValueError(f"{key}: {', '.join(modules_to_save)} names a weight shared with {shared} (tied "
                         "embeddings): not supported yet; peft trains a separate copy in each module, which unties "
                         "them")
    seen: set[int] = set()
    return [n for n, p in every if n in keys and not (id(p) in seen or seen.add(id(p)))]


def _is_bias(name: str) -> bool:
    return name == "bias" or name.endswith(".bias")


# --------------------------------------------------------------------------- queries
def lora_modules(model: nn.Module) -> dict[str, LoraLinear]:
    """{module path: LoraLinear} in model order."""
    return {path: m for path, m in model.named_modules() if isinstance(m, LoraLinear)}


def is_lora_key(name: str) -> bool:
    """A parameter / state-dict key of an adapter (`...q_proj.lora_A.weight`, `...lora_B.weight`)."""
    return _LORA_KEY.search(name) is not None


def trainable_state_keys(model: nn.Module) -> list[str]:
    """Names of the trained parameters (adapters + the biases lora_bias trains): what an adapter-only
    checkpoint holds. A shared parameter is named once."""
    return [name for name, p in model.named_parameters() if p.requires_grad]


def trained_keys(keys, bias: str, modules_to_save: list[str] | tuple[str, ...] = (), prefix: str = "") -> set[str]:
    """The keys (of a state dict, in any naming with `<module>.lora_A.weight`) that a LoRA run trains,
    by name alone: the adapters, plus every bias (`all`) or the biases of the linears that have
    adapters (`lora_only`), plus every key of the modules `modules_to_save` names (matched on the key
    without `prefix`, e.g. a checkpoint's `model.`). What an adapter-only checkpoint and a PEFT adapter
    file hold."""
    keys = set(keys)
    out = {k for k in keys if is_lora_key(k)}
    if modules_to_save:
        out |= {k for k in keys if k.startswith(prefix) and is_saved_module_key(k[len(prefix):], modules_to_save)}
    if bias == "all":
        out |= {k for k in keys if _is_bias(k)}
    elif bias == "lora_only":
        wrapped = {k.rsplit(".lora_A.", 1)[0] for k in out if ".lora_A." in k}
        out |= {k for k in keys if _is_bias(k) and k.rpartition(".")[0] in wrapped}
    return out


def lora_parameter_counts(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts; a shared parameter counts once, a DTensor by its global size."""
    params = list(model.parameters())  # parameters() already de-duplicates
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


def lora_scalings(model: nn.Module) -> dict[str, float]:
    """{module path: alpha / rank} of every LoraLinear and LoRA experts module (what `merged_state_dict` takes)."""
    modules: dict[str, LoraLinear | LoraExperts] = {**lora_modules(model), **lora_experts(model)}
    return {path: m.scaling for path, m in modules.items()}


# --------------------------------------------------------------------------- init, adapters on/off
@torch.no_grad()
def reset_lora_parameters(model: nn.Module) -> None:
    """(Re)draw every adapter as peft does (A kaiming-uniform, B zeros), in model order."""
    for module in lora_modules(model).values():
        module.reset_lora_parameters()
    for experts in lora_experts(model).values():
        experts.reset_lora_parameters()


@contextmanager
def adapters_detached(model: nn.Module) -> Iterator[dict[str, dict[str, nn.Module]]]:
    """Take the adapter children off every LoraLinear for the duration (the modules look like plain
    linears to code that walks children or parameters), and put them back after. Yields
    {module path: {child name: child}}. Uses: the model's own weight initialisation (which would
    otherwise draw adapters as linears), tensor parallel's styles (which distribute a module's
    parameters recursively). Do not run the model inside."""
    detached = {path: {name: m._modules.pop(name) for name in ADAPTER_CHILDREN}
                for path, m in lora_modules(model).items()}
    detached.update({path: {name: m._modules.pop(name) for name in ("lora_A", "lora_B")}
                     for path, m in lora_experts(model).items()})
    try:
        yield detached
    finally:
        for path, children in detached.items():
            model.get_submodule(path)._modules.update(children)


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[nn.Module]:
    """Forward as the frozen base (e.g. DPO's reference log-probs without a second model copy)."""
    modules = list(lora_modules(model).values()) + list(lora_experts(model).values())
    before = [m.adapters_enabled for m in modules]
    for m in modules:
        m.adapters_enabled = False
    try:
        yield model
    finally:
        for m, enabled in zip(modules, before):
            m.adapters_enabled = enabled


# --------------------------------------------------------------------------- merging
@torch.no_grad()
def merge_lora_(model: nn.Module) -> list[str]:
    """Fold each adapter into its base weight (W += B @ A * scaling) and replace the LoraLinear by a
    plain nn.Linear holding the same weight and bias Parameters. For a model that is not parallelized
    (a DTensor weight works where DTensor can multiply the shards, untested). Returns the merged paths."""
    merged = []
    for path, m in lora_modules(model).items():
        m.weight.add_(m.delta_weight().to(m.weight.dtype))
        plain = nn.Linear.__new__(nn.Linear)
        nn.Module.__init__(plain)
        plain.in_features, plain.out_features = m.in_features, m.out_features
        plain.weight = m.weight
        plain.register_parameter("bias", m.bias)
        plain.train(m.training)
        parent_path, _, leaf = path.rpartition(".")
        setattr(model.get_submodule(parent_path), leaf, plain)
        merged.append(path)
    return merged + merge_expert_lora_(model)


def merged_state_dict(state: Mapping[str, torch.Tensor],
                      scaling: Mapping[str, float] | tuple[int, float]) -> dict[str, torch.Tensor]:
    """A plain (unsharded) state dict with its adapters folded in: `<m>.weight` += (B @ A) * scaling
    (computed in fp32, stored in the weight's dtype), `<m>.lora_A/B.weight` dropped; no model needed.

    `scaling`: {module path: alpha / rank} (`lora_scalings`), or (rank, alpha) for every module
    (then each A must have `rank` rows). ValueError for an adapter without its base weight or partner.
    """
    pairs = lora_pairs(state)
    out = {k: v for k, v in state.items() if not is_lora_key(k)}
    _merge_experts(out, expert_pairs(state), scaling)
    for module, (a, b) in pairs.items():
        s = _scaling_of(scaling, module, a.shape[0], f"{module}.lora_A.weight has")
        key = f"{module}.weight"
        if key not in out:
            raise ValueError(f"{module}: adapters without the base weight {key} (an adapter-only state dict)")
        w = out[key]
        if tuple(w.shape) != (b.shape[0], a.shape[1]):
            raise ValueError(f"{module}: adapters A {list(a.shape)}, B {list(b.shape)} do not fit the base weight "
                             f"{list(w.shape)}")
        out[key] = (w.float() + (b.float() @ a.float()) * s).to(w.dtype)
    return out


def _merge_experts(out: dict[str, torch.Tensor], pairs: dict[str, tuple[torch.Tensor, torch.Tensor]],
                   scaling: Mapping[str, float] | tuple[int, float]) -> None:
    """merged_state_dict's fold of the expert adapters ({weight key: (A [E, r, in], B [E, out, r])})."""
    for key, (a, b) in pairs.items():
        s = _scaling_of(scaling, key.rpartition(".")[0], a.shape[1], f"{key}'s expert adapters have")
        if key not in out:
            raise ValueError(f"{key}: expert adapters without the base weight (an adapter-only state dict)")
        w = out[key]
        if tuple(w.shape) != (a.shape[0], b.shape[1], a.shape[2]):
            raise ValueError(f"{key}: expert adapters A {list(a.shape)}, B {list(b.shape)} do not fit the base "
                             f"weight {list(w.shape)}")
        out[key] = (w.float() + expert_delta(a, b, s)).to(w.dtype)


def _scaling_of(scaling: Mapping[str, float] | tuple[int, float], module: str, rank_found: int, what: str) -> float:
    """alpha / rank of one adapted module: from {module path: scaling}, or (rank, alpha) for every module
    (ValueError when the adapter's own rank differs: `what` names it)."""
    if isinstance(scaling, Mapping):
        return float(scaling[module])
    rank, alpha = scaling
    if rank_found != rank:
        raise ValueError(f"{what} rank {rank_found}, expected {KEY}.lora_rank={rank}")
    return float(alpha) / int(rank)


def lora_pairs(state: Mapping[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{module path: (A, B)} of the adapters in a state dict; ValueError for an A without B or back."""
    found: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in state.items():
        m = re.fullmatch(r"(.+)\.lora_([AB])\.weight", key)
        if m:
            found.setdefault(m.group(1), {})[m.group(2)] = t
    broken = [f"{module}.lora_{'B' if 'A' in ab else 'A'}.weight" for module, ab in found.items() if len(ab) != 2]
    if broken:
        raise ValueError(f"adapter weights missing: {', '.join(sorted(broken)[:5])}")
    return {module: (ab["A"], ab["B"]) for module, ab in found.items()}


# --------------------------------------------------------------------------- PEFT's adapter format
def peft_adapter_state(state: Mapping[str, torch.Tensor], bias: str = "none",
                       modules_to_save: list[str] | tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """The tensors of PEFT's adapter_model.safetensors, from a state dict in transformers' names
    (adapters, the biases if lora_bias trains them, the modules_to_save), keyed as peft's
    `get_peft_model_state_dict` does: `base_model.model.<m>.lora_A.weight`; a bias as
    `<m>.base_layer.bias` when <m> has adapters (peft wraps the linear and keeps it as `base_layer`),
    else `<m>.bias`; a saved module's tensors as `base_model.model.<m>.weight` (peft drops its
    `modules_to_save.default.`). 'lora_only' saves the wrapped linears' biases, 'all' every bias."""
    if bias not in BIAS_MODES:
        raise ValueError(f"{KEY}.lora_bias: must be one of {', '.join(BIAS_MODES)}, got {bias!r}")
    wrapped = set(lora_pairs(state))
    trained = trained_keys(state, bias, modules_to_save)
    out = to_peft(state, PEFT_PREFIX)
    for key, t in state.items():
        if key not in trained or is_expert_lora_key(key):
            continue
        module = key.rpartition(".")[0]
        if not is_lora_key(key) and module in wrapped:  # a wrapped linear's bias: peft's base_layer
            out[f"{PEFT_PREFIX}{module}.base_layer.bias"] = t
        else:
            out[PEFT_PREFIX + key] = t
    return out


def peft_target_parameters(state: Mapping[str, torch.Tensor]) -> list[str]:
    """peft's target_parameters names of the expert weights that have adapters (nxdt's keys)."""
    return sorted({"experts." + key.rpartition(".")[2] for key in expert_pairs(state)})


def nxdt_adapter_state(adapter: Mapping[str, torch.Tensor], config: Mapping[str, Any],
                       num_experts: int | None = None) -> dict[str, torch.Tensor]:
    """A peft adapter (adapter_model.safetensors' tensors, adapter_config.json as a dict) in nxdt's keys
    (transformers' module paths, no `base_model.model.` prefix): `<m>.lora_A.weight` as they are, the
    expert adapters (config's target_parameters; `num_experts` needed then) in nxdt's [E, ...] layout."""
    targets = config.get("target_parameters") or []
    experts = from_peft(adapter, targets, int(num_experts or 0), PEFT_PREFIX) if targets else {}
    if targets and not num_experts:
        raise ValueError("a peft adapter with target_parameters: give num_experts")
    plain = {k.removeprefix(PEFT_PREFIX): v for k, v in adapter.items()
             if not PEFT_EXPERT_KEY.search(k)}
    return {**plain, **experts}


def peft_target_modules(state: Mapping[str, torch.Tensor]) -> list[str]:
    """The leaf names of the linears that have adapters (what adapter_config.json's target_modules lists)."""
    return sorted({module.rpartition(".")[2] for module in lora_pairs(state)})


def peft_adapter_config(target_modules: list[str], rank: int, alpha: float, dropout: float = 0.0,
                        bias: str = "none", base_model_name_or_path: str | None = None,
                        target_parameters: list[str] | None = None,
                        modules_to_save: list[str] | None = None) -> dict[str, Any]:
    """PEFT's adapter_config.json (LoRA for a causal LM) as a dict; `target_modules` are the
    model's own linear names (`peft_target_modules`), not NxDT's fused aliases; `target_parameters`
    the adapted expert weights (`peft_target_parameters`), when there are any; `modules_to_save` the
    names as given (null when none, as peft writes it)."""
    extra = {"target_parameters": sorted(target_parameters)} if target_parameters else {}
    return {**extra,
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model_name_or_path,
        "r": int(rank), "lora_alpha": alpha, "lora_dropout": float(dropout), "bias": bias,
        "target_modules": sorted(target_modules), "fan_in_fan_out": False, "use_rslora": False,
        "use_dora": False, "init_lora_weights": True, "inference_mode": True,
        "modules_to_save": list(modules_to_save or []) or None,
        "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {}, "alpha_pattern": {},
    }
