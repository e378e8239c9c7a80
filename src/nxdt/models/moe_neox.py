"""GPT-NeoX's MoE pieces that nxdt's MoE block (nxdt.models.moe.LlamaMoE) builds as options: experts
of two matrices with a plain activation (`model.moe.expert_activation` gelu / gelu_tanh / silu), and
NeoX's sinkhorn router (`model.moe.routing_algorithm: neox_sinkhorn`).

From EleutherAI/gpt-neox at ea7aefd8 (megatron/model/moe.py, moe_mlp.py, router.py):
- `ParallelDroplessMoE` always builds `ParallelGroupedMLP`: per expert w1 [F, H] and w2 [F, H] (no
  bias: "Bias is currently not supported"), out = act(x w1^T) w2, act = the model's activation
  function (get_activation: gelu -> F.gelu; swiglu -> swish = x sigmoid(x), not gated there). F =
  intermediate_size, else 4 x hidden_size rounded up to a multiple of 256. Here the weights are
  `up_proj` [E, F, H] (NeoX's w1 viewed per expert) and `down_proj` [E, H, F] (w2 per expert,
  transposed: the layout of nxdt's SwiGLU experts' down_proj).
- `SinkhornRouter`: in training the experts are the top-k of sinkhorn(exp(logits)) (NeoX's
  variant: the column factors start at 1 / (E x column sums), at most 3 iterations, stop once they
  move less than 1e-4 on average), outside training the top-k of the scores; the weights are the
  scores of the chosen experts, scores = sigmoid(logits) for k = 1, softmax(logits) for k > 1.
  Nothing is renormalised and no load-balancing loss is added (NeoX's dropless MoE returns none).

Only torch; nothing here imports nxdt.models.moe (which imports this module).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

EXPERT_ACTIVATIONS = ("swiglu", "gelu", "gelu_tanh", "silu")
"""swiglu: nxdt's gated experts (gate, up, down; Mixtral's); the others: two matrices (up, down)."""

_ACTIVATION = {"gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "silu": F.silu}


class MLPExperts(nn.Module):
    """E two-matrix experts, act(x up^T) down^T, as two 3-D weights: up_proj [E, F, H], down_proj
    [E, H, F]. Same call as nxdt.models.moe.MoEExperts (tokens sorted by expert, counts per expert,
    routing weights per row)."""

    def __init__(self, num_experts: int, hidden_size: int, ffn_hidden_size: int, activation: str) -> None:
        super().__init__()
        if activation not in _ACTIVATION:
            raise ValueError(f"two-matrix experts take one of {sorted(_ACTIVATION)}, got {activation!r}")
        self.num_experts, self.activation = num_experts, activation
        self.up_proj = nn.Parameter(torch.empty(num_experts, ffn_hidden_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, ffn_hidden_size))

    @torch.no_grad()
    def reset_parameters(self, std: float, out_std: float) -> None:
        """up ~ N(0, std), down ~ N(0, out_std): the init of nxdt's MLP projections."""
        nn.init.normal_(self.up_proj, mean=0.0, std=std)
        nn.init.normal_(self.down_proj, mean=0.0, std=out_std)

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor, weights: torch.Tensor | None = None
                ) -> torch.Tensor:
        out = mlp_experts(x, tokens_per_expert, self.up_proj, self.down_proj, _ACTIVATION[self.activation])
        return out if weights is None else out * weights.to(out.dtype)


@torch.compiler.disable  # data-dependent row counts
def mlp_experts(x: torch.Tensor, tokens_per_expert: torch.Tensor, up_proj: torch.Tensor, down_proj: torch.Tensor,
                act) -> torch.Tensor:
    """x [N, H] sorted by expert (`tokens_per_expert[e]` rows each) -> [N, H]: per expert one matmul
    per projection (NeoX's grouped GEMMs); under autocast in the autocast dtype."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        x, up_proj, down_proj = x.to(dtype), up_proj.to(dtype), down_proj.to(dtype)
    counts = tokens_per_expert.tolist()
    if sum(counts) != x.shape[0]:
        raise ValueError(f"tokens_per_expert sums to {sum(counts)} rows, x has {x.shape[0]}")
    return torch.cat([F.linear(act(F.linear(rows, w1)), w2)
                      for rows, w1, w2 in zip(x.split(counts), up_proj.unbind(0), down_proj.unbind(0))])


def neox_sinkhorn(cost: torch.Tensor, iterations: int = 3, tol: float | None = 1e-4) -> torch.Tensor:
    """GPT-NeoX's SinkhornRouter.sinkhorn on logits [T, E] (fp32): exp, column factors first."""
    cost = torch.exp(cost)
    d0 = torch.ones(cost.size(0), device=cost.device, dtype=cost.dtype)
    d1 = 1 / (cost.size(1) * torch.sum(cost, 0))
    eps = 1e-8
    d1_old = d1
    for _ in range(iterations):
        d0 = (1 / d0.size(0)) * 1 / (torch.sum(d1 * cost, 1) + eps)
        d1 = (1 / d1.size(0)) * 1 / (torch.sum(d0.unsqueeze(1) * cost, 0) + eps)
        error = torch.mean(torch.abs(d1_old - d1))
        d1_old = d1
        if tol is not None and error < tol:
            break
    return d1 * cost * d0.unsqueeze(1)


def neox_sinkhorn_route(logits: torch.Tensor, top_k: int, training: bool, iterations: int = 3,
                        tol: float | None = 1e-4) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, k] fp32, experts [T, k]) as NeoX's SinkhornRouter."""
    scores = torch.sigmoid(logits) if top_k == 1 else torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits)
    if training:
        with torch.no_grad():
            experts = torch.topk(neox_sinkhorn(logits.float(), iterations, tol), k=top_k, dim=1).indices
        weights = torch.gather(scores, 1, experts)
    else:
        weights, experts = torch.topk(scores, k=top_k, dim=1)
    return weights.float(), experts
