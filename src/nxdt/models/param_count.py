"""Total and activated parameters of a model: the one count behind `nxdt plan` and the run's
start summary.

A mixture-of-experts block is any module with a `gate` (the router) and `experts` child: nxdt's
LlamaMoE and transformers' Mixtral block alike, so both model sources are counted by one rule.
Per token the model uses every parameter outside the experts (attention, norms, embeddings,
dense MLPs, the routers) and, in each MoE block, top_k of its E experts:

    activated = dense + routers + sum over MoE blocks of expert_params x top_k / E

Each block's expert parameters are E equal experts, so the share is an exact integer. The
routers are counted in full (every token goes through them) and shown as their own figure,
with the noise weight of LLaMA-MoE's noisy gate apart: that one is used in training only.
Works on meta tensors and on sharded DTensors (numel is the global size).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class ParameterCount:
    total: int
    activated: int
    """Parameters one token goes through: total for a dense model."""
    dense: int
    """Outside the MoE blocks' experts and routers."""
    experts: int
    """All experts of all MoE blocks."""
    experts_activated: int
    """The top_k / E share of `experts` one token uses."""
    router: int
    """Router (gate) parameters, `router_noise` included."""
    router_noise: int = 0
    """Of `router`: LLaMA-MoE's learned noise weights (training only)."""
    num_experts: int = 0
    top_k: int = 0

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def as_dict(self) -> dict[str, int]:
        return {"dense": self.dense, "experts": self.experts, "experts_activated": self.experts_activated,
                "router": self.router, "router_noise": self.router_noise,
                "num_experts": self.num_experts, "top_k": self.top_k}


def _top_k(block: nn.Module) -> int:
    """Experts per token: nxdt's MoEArgs, else transformers' block (or its router) attribute."""
    args = getattr(block, "args", None)
    for holder in (args, block, block.gate):
        k = getattr(holder, "top_k", None)
        if isinstance(k, int):
            return k
    raise ValueError(f"cannot tell how many experts {type(block).__name__} selects per token (no top_k)")


def _num_experts(block: nn.Module) -> int:
    n = getattr(block.experts, "num_experts", None)
    return n if isinstance(n, int) else len(block.experts)  # older transformers: a ModuleList of experts


def moe_blocks(model: nn.Module) -> dict[str, nn.Module]:
    """Qualified name -> MoE block (a module with `gate` and `experts` children)."""
    return {name: m for name, m in model.named_modules()
            if isinstance(getattr(m, "gate", None), nn.Module) and isinstance(getattr(m, "experts", None), nn.Module)}


def expert_parameter_names(model: nn.Module) -> set[str]:
    """Names of the expert weights (what expert parallelism shards), as `named_parameters` gives them."""
    prefixes = tuple(f"{name}.experts." for name in moe_blocks(model))
    return {n for n, _ in model.named_parameters() if prefixes and n.startswith(prefixes)}


def activated_elements(model: nn.Module, names: set[str]) -> int:
    """Elements of the parameters `names` that one token multiplies: an expert weight's top_k / E
    share of its block (as `parameter_counts` counts `experts_activated`), every other one whole."""
    blocks = moe_blocks(model)
    total = 0
    for pname, p in model.named_parameters():
        if pname not in names:
            continue
        owner = next((b for name, b in blocks.items() if pname.startswith(f"{name}.experts.")), None)
        total += p.numel() if owner is None else p.numel() * _top_k(owner) // _num_experts(owner)
    return total


def parameter_counts(model: nn.Module) -> ParameterCount:
    """Total, activated per token, and the split of `model`'s parameters; a tied tensor counts once."""
    blocks = moe_blocks(model)
    total = experts = experts_activated = router = router_noise = 0
    per_block = {name: 0 for name in blocks}
    for pname, p in model.named_parameters():  # de-duplicates tied tensors, as parameters() does
        n = p.numel()
        total += n
        owner = next((b for b in blocks if pname.startswith(f"{b}.")), None)
        if owner is None:
            continue
        local = pname[len(owner) + 1:]
        if local.startswith("experts."):
            experts += n
            per_block[owner] += n
        elif local.startswith("gate."):
            router += n
            if "noise" in local:
                router_noise += n
    top_ks = {name: _top_k(b) for name, b in blocks.items()}
    sizes = {name: _num_experts(b) for name, b in blocks.items()}
    for name, n in per_block.items():
        experts_activated += n * top_ks[name] // sizes[name]
    dense = total - experts - router
    first = next(iter(blocks), None)
    return ParameterCount(total=total, activated=dense + router + experts_activated, dense=dense,
                          experts=experts, experts_activated=experts_activated, router=router,
                          router_noise=router_noise, num_experts=sizes[first] if first is not None else 0,
                          top_k=top_ks[first] if first is not None else 0)


def activated_lines(c: ParameterCount) -> list[str]:
    """The activated-per-token breakdown as summary lines (label column 13 wide, indented 2), none
    for a dense model: its activated count is its total, already shown."""
    if not c.is_moe:
        return []
    k, e = c.top_k, c.num_experts
    lines = [f"activated    {c.activated:,} per token: top-{k} of {e} experts",
             f"             = dense {c.dense:,} + experts {c.experts_activated:,} ({k}/{e} of {c.experts:,})"
             f" + routers {c.router:,}"]
    if c.router_noise:
        gates = c.router - c.router_noise
        lines.append(f"             routers = gates {gates:,} + noise weights {c.router_noise:,} (training only; "
                     f"{c.activated - c.router_noise:,} activated without them)")
    return ["  " + line for line in lines]
