"""LLaMA-MoE's calculators and the rest of its MoE layer, as options of nxdt's MoE block
(nxdt.models.moe.LlamaMoE calls in here; `model.moe` keys of the same names, docs/moe.md).

From pjlab-sys4nlp/llama-moe at b17aff43 (smoe/modules/moe/moe_calculators.py, moe_experts.py,
smoe/modules/norm.py, smoe/modules/moe_residual/moe_residual_layers.py):

- `SwitchDropTokenCalculator` (top-1): an expert takes at most capacity = int(capacity_factor x
  tokens / E) tokens. With `drop_tokens`, for each expert in order whose tokens exceed it, a
  `torch.randperm` over its tokens (in token order) picks which stay: the first `capacity` of the
  permutation; this happens in training and in evaluation alike. A dropped token's output is 0
  (`dropped_padding: zero`) or its input (`input`); then every row x score x score_scale_factor,
  then x the weight norm. nxdt draws the same permutations from torch's RNG in the same order.
- `UniversalCalculator` with `multiply_gate_scores: false` sums the k experts' outputs unweighted;
  with `add_weight_norm` (and multiply_gate_scores) the weighted sum x a learned scalar `weight_norm`
  started at score_scale_factor, in place of the factor (the switch calculator: a learned [H] vector
  after the factor).
- Unequal experts (`size_experts`, one list of E widths per layer, from LLaMA-MoE's splits): each
  expert is stored `moe.ffn_hidden_size` wide with its extra rows/columns zero. A zero row of gate
  and up gives silu(0) x 0 = 0 and a zero column of down adds nothing, and their gradients are
  exactly 0, so the padding stays 0 under any optimizer and weight decay: the same function and
  training as experts of those widths. (Parameter counts include the padding.)
- Residual MoE (`LlamaMoEResidual*`): beside the routed experts, a block every token goes through:
  Er SwiGLU experts of one width, weighted by softmax(x W_r^T) (or the raw logits) x
  score_scale_factor_residual (or not weighted), summed, added to the routed output
  (`mlp.residual_block.gate.weight` [Er, H], `.gate_up_proj` [Er, 2W, H], `.down_proj` [Er, H, W]).

Only torch; nothing here imports nxdt.models.moe (which imports this module).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

CALCULATORS = ("UniversalCalculator", "SwitchDropTokenCalculator")
DROPPED_PADDINGS = ("zero", "input")


@dataclass(frozen=True)
class LlamaMoEOptions:
    """LLaMA-MoE's layer options beyond its gates (names as in its config.json)."""

    calculator_type: str = "UniversalCalculator"
    drop_tokens: bool = True
    """SwitchDropTokenCalculator: drop the tokens over an expert's capacity (chosen at random)."""
    dropped_padding: str = "zero"
    """SwitchDropTokenCalculator: a dropped token's output before weighting: 0 or its input."""
    capacity_factor: float = 1.25
    """SwitchDropTokenCalculator: capacity = int(this x tokens / num_experts)."""
    gate_use_softmax: bool = True
    """false: the gate's weights are its raw (noisy) logits."""
    multiply_gate_scores: bool = True
    """false: expert outputs are summed unweighted (and unscaled)."""
    add_weight_norm: bool = False
    """A learned scale on the weighted output (with multiply_gate_scores only)."""
    switch_gate_weight: str = "probability"
    """switch gate: 'probability' (the Switch Transformer's) or 'logit' (LLaMA-MoE's SwitchBalancedGate:
    the chosen noisy logit, Gumbel noise in evaluation too)."""
    size_experts: tuple[tuple[int, ...], ...] | None = None
    """Per layer, each expert's width; None: all ffn_hidden_size wide."""
    layer: int | None = None
    """The layer these options were taken for (moe_for_layer): which row of size_experts."""
    num_experts_residual: int = 0
    """Experts of the residual block every token goes through; 0: no residual block."""
    residual_ffn_hidden_size: int = 0
    """Each residual expert's width."""
    gate_use_softmax_residual: bool = True
    multiply_gate_scores_residual: bool = True
    score_scale_factor_residual: float = 1.0

    def __post_init__(self) -> None:
        if self.calculator_type not in CALCULATORS:
            raise ValueError(f"calculator_type must be one of {CALCULATORS}, got {self.calculator_type!r}")
        if self.dropped_padding not in DROPPED_PADDINGS:
            raise ValueError(f"dropped_padding must be one of {DROPPED_PADDINGS}, got {self.dropped_padding!r}")
        if self.num_experts_residual and self.residual_ffn_hidden_size < 1:
            raise ValueError("a residual block needs residual_ffn_hidden_size >= 1")

    @property
    def switch(self) -> bool:
        return self.calculator_type == "SwitchDropTokenCalculator"

    @property
    def weight_norm(self) -> bool:
        return self.add_weight_norm and self.multiply_gate_scores

    @property
    def sizes(self) -> tuple[int, ...] | None:
        """This layer's expert widths (None: equal)."""
        return None if self.size_experts is None or self.layer is None else self.size_experts[self.layer]


def options_from_cfg(moe: Any) -> LlamaMoEOptions | None:
    """LlamaMoEOptions from the typed `model.moe` section; None when every key is at its default."""
    opts = LlamaMoEOptions(
        calculator_type=moe.calculator_type, drop_tokens=moe.drop_tokens, dropped_padding=moe.dropped_padding,
        capacity_factor=1.25 if moe.capacity_factor is None else float(moe.capacity_factor),
        gate_use_softmax=moe.gate_use_softmax, multiply_gate_scores=moe.multiply_gate_scores,
        add_weight_norm=moe.add_weight_norm, switch_gate_weight=moe.switch_gate_weight,
        size_experts=None if moe.size_experts is None else tuple(tuple(map(int, row)) for row in moe.size_experts),
        num_experts_residual=moe.num_experts_residual,
        residual_ffn_hidden_size=(moe.residual_ffn_hidden_size or moe.ffn_hidden_size or 0)
        if moe.num_experts_residual else 0,
        gate_use_softmax_residual=moe.gate_use_softmax_residual,
        multiply_gate_scores_residual=moe.multiply_gate_scores_residual,
        score_scale_factor_residual=float(moe.score_scale_factor_residual))
    if opts.switch and moe.capacity_factor is None:
        opts = replace(opts, capacity_factor=1.25)  # LLaMA-MoE's default
    return None if opts == replace(LlamaMoEOptions(), capacity_factor=opts.capacity_factor) else opts


def with_llama_moe(args: Any, moe: Any) -> Any:
    """MoEArgs `args` with LLaMA-MoE's options of the `model.moe` section: the switch calculator's
    capacity is its own (not nxdt's deterministic capacity_factor), and gate_use_balance false
    leaves the noisy gate's balance loss out (LLaMA-MoE's switch gate ignores it, as here)."""
    if args is None:
        return None
    opts = options_from_cfg(moe)
    if not moe.gate_use_balance and args.gate_type == "top_k_balanced_noisy":
        args = replace(args, aux_loss_coef=0.0)
    if opts is None:
        return args
    return replace(args, llama_moe=opts, capacity_factor=None if opts.switch else args.capacity_factor)


def moe_for_layer(args: Any, layer_idx: int) -> Any:
    """MoEArgs for one layer: its row of size_experts."""
    opts = getattr(args, "llama_moe", None)
    if opts is None or opts.size_experts is None:
        return args
    return replace(args, llama_moe=replace(opts, layer=layer_idx))


# --------------------------------------------------------------------------- the block's parts


class WeightNorm(nn.Module):
    """LLaMA-MoE's WeightNorm: hidden x weight, weight started at `scale` ([1] or [H])."""

    def __init__(self, size: int, scale: float) -> None:
        super().__init__()
        self.scale = scale
        self.weight = nn.Parameter(torch.full((size,), float(scale)))

    @torch.no_grad()
    def reset_parameters(self) -> None:
        self.weight.fill_(self.scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight.to(x.dtype)


class ResidualBlock(nn.Module):
    """LLaMA-MoE's residual block (LinearGLUMoELayer with UniformLearnableGate, gate_network linear, and
    UniformCalculator): every token through all Er SwiGLU experts, weighted by the gate's softmax."""

    def __init__(self, hidden_size: int, opts: LlamaMoEOptions) -> None:
        super().__init__()
        n, width = opts.num_experts_residual, opts.residual_ffn_hidden_size
        self.use_softmax, self.multiply = opts.gate_use_softmax_residual, opts.multiply_gate_scores_residual
        self.scale = opts.score_scale_factor_residual
        self.gate = nn.Linear(hidden_size, n, bias=False)
        self.gate_up_proj = nn.Parameter(torch.empty(n, 2 * width, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(n, hidden_size, width))

    @torch.no_grad()
    def reset_parameters(self, std: float, out_std: float) -> None:
        """N(0, std) and down N(0, out_std): the init of nxdt's MLP projections."""
        for w, s in ((self.gate.weight, std), (self.gate_up_proj, std), (self.down_proj, out_std)):
            nn.init.normal_(w, mean=0.0, std=s)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)
        scores = torch.softmax(logits, dim=-1) if self.use_softmax else logits
        out = None
        for e in range(self.gate_up_proj.shape[0]):
            gate, up = F.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[e])
            if self.multiply:
                y = y * (scores[:, e:e + 1] * self.scale)
            out = y if out is None else out + y
        return out


def build_parts(block: nn.Module, hidden_size: int, ffn_hidden_size: int, args: Any) -> None:
    """The LLaMA-MoE parts of MoE block `block`: its weight norm, its residual block, its expert widths."""
    opts = args.llama_moe
    if opts.weight_norm:
        block.weight_norm = WeightNorm(hidden_size if opts.switch else 1, args.score_scale)
    if opts.num_experts_residual:
        block.residual_block = ResidualBlock(hidden_size, opts)
    sizes = opts.sizes
    if sizes is not None:
        if len(sizes) != args.num_experts or not all(1 <= s <= ffn_hidden_size for s in sizes):
            raise ValueError(f"size_experts of layer {opts.layer} = {list(sizes)}: needs {args.num_experts} widths "
                             f"in [1, {ffn_hidden_size}]")
        if args.expert_activation != "swiglu":
            raise ValueError("size_experts is built for swiglu experts")
    block.expert_sizes = sizes


@torch.no_grad()
def reset_llama_moe_parts(model: nn.Module, std: float, out_std: float) -> None:
    """After the model's init: the residual blocks drawn, weight norms at their scale, unequal experts'
    padding zeroed."""
    for m in model.modules():
        if isinstance(m, (ResidualBlock,)):
            m.reset_parameters(std, out_std)
        elif isinstance(m, WeightNorm):
            m.reset_parameters()
        sizes = getattr(m, "expert_sizes", None)
        if sizes is not None:
            zero_padding(m.experts, sizes)


@torch.no_grad()
def zero_padding(experts: nn.Module, sizes: tuple[int, ...]) -> None:
    """Expert e keeps its first sizes[e] gate, up rows and down columns; the rest are set to 0."""
    width = experts.down_proj.shape[-1]
    for e, s in enumerate(sizes):
        experts.gate_up_proj[e, s:width].zero_()
        experts.gate_up_proj[e, width + s:].zero_()
        experts.down_proj[e, :, s:].zero_()


# --------------------------------------------------------------------------- the forward's steps


def switch_keep(experts: torch.Tensor, capacity_factor: float, num_experts: int) -> torch.Tensor:
    """SwitchDropTokenCalculator's drops → bool [T, 1], which tokens their (only) expert computes:
    per expert in order, those over capacity int(capacity_factor x T / E) lose a torch.randperm draw."""
    flat = experts.reshape(-1)
    capacity = int(capacity_factor * flat.shape[0] / num_experts)
    keep = torch.ones_like(flat, dtype=torch.bool)
    for i in range(num_experts):
        tokens = (flat == i).nonzero(as_tuple=True)[0]
        if tokens.numel() > capacity:
            shuffled = tokens[torch.randperm(tokens.numel(), device=flat.device)]
            keep[shuffled[capacity:]] = False
    return keep[:, None]


def keep_of(experts: torch.Tensor, args: Any) -> torch.Tensor | None:
    """The switch calculator's kept assignments, None when it drops nothing."""
    opts = args.llama_moe
    if not (opts.switch and opts.drop_tokens):
        return None
    if experts.shape[1] != 1:
        raise ValueError(f"SwitchDropTokenCalculator computes one expert per token; top_k is {experts.shape[1]}")
    return switch_keep(experts, opts.capacity_factor, args.num_experts)


def slot_weights(slot_weight: torch.Tensor, args: Any) -> torch.Tensor | None:
    """Each kept assignment's factor on its expert's output: score x score_scale_factor, the score
    alone under the universal calculator's weight norm, none without multiply_gate_scores."""
    opts = args.llama_moe
    if not opts.multiply_gate_scores:
        return None
    return slot_weight[:, None] * (1.0 if opts.weight_norm and not opts.switch else args.score_scale)


def finish(block: nn.Module, out: torch.Tensor, x: torch.Tensor, weights: torch.Tensor, keep: torch.Tensor
           ) -> torch.Tensor:
    """The routed output [T, H] → the layer's: dropped tokens' input padding, the weight norm, the
    residual block."""
    opts = block.args.llama_moe
    if opts.switch and opts.drop_tokens and opts.dropped_padding == "input":
        pad = x * (~keep[:, :1]).to(x.dtype)
        if opts.multiply_gate_scores:
            pad = pad * (weights[:, :1] * block.args.score_scale).to(x.dtype)
        out = out + pad
    if opts.weight_norm:
        out = block.weight_norm(out)
    if opts.num_experts_residual:
        out = out + block.residual_block(x)
    return out
