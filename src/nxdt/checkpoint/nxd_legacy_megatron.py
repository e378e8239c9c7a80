"""NxDT's megatron-style models (model_source megatron) and NxD's MoE layer in checkpoints NxDT wrote.

nxdt.checkpoint.nxd_legacy merges the tp ranks of NxDT's HF-style Llama. The megatron-style GPT
model (neuronx_distributed_training/models/megatron: gpt_model.py, language_model.py, transformer.py)
shards the same way under other names; each tp rank's tensors are renamed here to the HF-style names
(same sharding), the fused attention rows put apart as the model's forward reads them:

    language_model.embedding.word_embeddings.weight         model.embed_tokens.weight (vocab rows over tp)
    language_model.output_layer.weight                      lm_head.weight
    language_model.encoder.final_layernorm.weight           model.norm.weight
    language_model.encoder.layers.N.                        model.layers.N.
      input_layernorm / post_attention_layernorm            the same (weight, and bias with layernorm)
      self_attention.query_key_value.weight  (MHA)          per rank [np, 3, hn]: head by head its q, k, v rows
                                                            (ParallelAttention.forward: view [np, 3 * hn], split)
      self_attention.query.weight            (GQA)          q_proj, the rank's query heads
      self_attention.key_value.weight        (GQA)          per rank [nk, 2, hn]: per KV head its k, then v rows
      self_attention.dense.weight                           o_proj (RowParallel: dim 1)
      mlp.dense_h_to_4h.weight                              gate_up_proj: per rank [gate | up] (swiglu's tensor_split);
                                                            gelu: up_proj (no gate)
      mlp.dense_4h_to_h.weight                              down_proj (RowParallel: dim 1)
      *.bias (has_bias)                                     the same names' bias: q/k/v and up_proj split like
                                                            their rows, o_proj's and down_proj's (RowParallel,
                                                            added after the reduction) and the norms' replicated
    language_model.embedding.position_embeddings.weight     model.embed_positions.weight (learned_absolute:
                                                            torch.nn.Embedding, replicated)
      mlp.moe.*                                             NxD's MoE (below)

A rank's query heads use its KV heads in contiguous groups (CoreAttention: "(nk q_head)"), which is
transformers' grouping, and megatron-style GQA has no K/V replication (num_kv_heads % tp == 0).
NxD's converter (scripts/checkpoint_converter.py, modify_qkv_for_megatron) cuts query_key_value into
[q | k | v] blocks and key_value into [k | v] halves: the same as the forward's view where a rank
holds one head (one KV head); the forward's view is followed, the one the trained weights mean.

NxD's MoE layer (modules/moe: MoE(router, expert_mlps), NxDT's NeuronSwitchMLP and HF Mixtral's
`mlp`), per tp rank and, with expert parallelism, per ep rank (`dp_rank_00_ep_rank_WW_...pt`: the
rank's experts, dim 0; the other tensors are ep rank 0's):

    mlp.moe.router.linear_router.weight            [E, H], replicated       → mlp.gate.weight
    mlp.moe.expert_mlps.mlp_op.gate_up_proj.weight [E/ep, H, 2I/tp]: per tp rank [gate | up] on dim 2
                                                   (ExpertFusedColumnParallelLinear, stride 2; Experts'
                                                   chunk(2, -1))                → mlp.experts.gate_up_proj [E, 2I, H]
    mlp.moe.expert_mlps.mlp_op.down_proj.weight    [E/ep, I/tp, H] (ExpertFusedRowParallelLinear, dim 1)
                                                                                → mlp.experts.down_proj [E, H, I]

nxdt's names for them are transformers' Mixtral's (nxdt.models.moe), for both model sources.

Followed (read, not imported):
  aws-neuron/neuronx-distributed-training @ 9169aa03 (2025-09-22): models/megatron/transformer.py
    (ParallelMLP, NeuronSwitchMLP, CoreAttention, ParallelAttention), models/megatron/language_model.py
    (Embedding: position_embeddings; output_layer), gpt_model.py (a tied output_layer.weight is the
    embedding's parameter), lightning_modules/model/megatron/megatron_gpt_model.py (ModelModule:
    bias_activation_fusion off, so gelu is F.gelu),
    models/hf_models/modeling_mixtral.py, examples/checkpoint_converter_scripts/hf_nxdt_mixtral_ckpt_converter.py
  aws-neuron/neuronx-distributed @ fbac349b (2026-04-09): modules/moe/model.py, routing.py (linear_router),
    experts.py, moe_parallel_layers.py (3-D weights, partition dims), trainer/checkpoint.py (_get_path with
    ep; xser: tensors that are not expert-parallel saved by ep rank 0 only), scripts/checkpoint_converter.py
"""

from __future__ import annotations

import re

import torch

from nxdt.config.errors import ConfigError

MEGATRON_LAYER = re.compile(r"language_model\.encoder\.layers\.(\d+)\.(.+)")
MEGATRON_NAMES = {
    "language_model.embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "language_model.embedding.position_embeddings.weight": "model.embed_positions.weight",  # replicated
    "language_model.encoder.final_layernorm.weight": "model.norm.weight",
    "language_model.encoder.final_layernorm.bias": "model.norm.bias",
    "language_model.output_layer.weight": "lm_head.weight",
}
MEGATRON_LAYER_NAMES = {
    "input_layernorm.weight": "input_layernorm.weight",
    "input_layernorm.bias": "input_layernorm.bias",
    "post_attention_layernorm.weight": "post_attention_layernorm.weight",
    "post_attention_layernorm.bias": "post_attention_layernorm.bias",
    "self_attention.query.weight": "self_attn.q_proj.weight",
    "self_attention.query.bias": "self_attn.q_proj.bias",
    "self_attention.dense.weight": "self_attn.o_proj.weight",
    "self_attention.dense.bias": "self_attn.o_proj.bias",  # RowParallel's bias: replicated
    "mlp.dense_4h_to_h.weight": "mlp.down_proj.weight",
    "mlp.dense_4h_to_h.bias": "mlp.down_proj.bias",
}
GPT_MLP = {"mlp.dense_h_to_4h.weight": "mlp.up_proj.weight", "mlp.dense_h_to_4h.bias": "mlp.up_proj.bias"}  # gelu
GLU_MLP = {"mlp.dense_h_to_4h.weight": "mlp.gate_up_proj.weight"}  # swiglu: per rank [gate | up]
ROUTER = "mlp.moe.router.linear_router.weight"
GATE_UP = "mlp.moe.expert_mlps.mlp_op.gate_up_proj.weight"
DOWN = "mlp.moe.expert_mlps.mlp_op.down_proj.weight"
EXPERT_KEY = "expert_mlps."  # what NxD marks expert-parallel (split over ep ranks, dim 0)


def is_expert(key: str) -> bool:
    return EXPERT_KEY in key


def megatron_to_hf_names(rank: dict[str, torch.Tensor], heads_per_rank: int, kv_heads_per_rank: int,
                         head_dim: int, where: str, gated: bool = True) -> dict[str, torch.Tensor]:
    """One tp rank's megatron-style tensors under the HF-style names (the same sharding); the fused
    q/k/v rows (and biases) put apart per head as ParallelAttention.forward reads them; `gated`:
    swiglu's [gate | up] dense_h_to_4h, else gelu's one up projection."""
    out: dict[str, torch.Tensor] = {}
    layer_names = {**MEGATRON_LAYER_NAMES, **(GLU_MLP if gated else GPT_MLP)}
    for key, value in rank.items():
        if key in MEGATRON_NAMES:
            out[MEGATRON_NAMES[key]] = value
            continue
        m = MEGATRON_LAYER.fullmatch(key)
        if not m:
            raise ConfigError(f"{where}: {key} is not a tensor of NxDT's megatron GPT / Llama (untied or tied "
                              "output layer)")
        p, name = f"model.layers.{m.group(1)}.", m.group(2)
        kind = name.rsplit(".", 1)[-1]  # weight or bias
        if name.startswith("mlp.moe."):
            out[p + name] = value
        elif name in layer_names:
            out[p + layer_names[name]] = value
        elif name.startswith("self_attention.query_key_value."):
            q, k, v = _per_head(value, heads_per_rank, 3, head_dim, f"{where}: {key}")
            out.update({p + f"self_attn.q_proj.{kind}": q, p + f"self_attn.k_proj.{kind}": k,
                        p + f"self_attn.v_proj.{kind}": v})
        elif name.startswith("self_attention.key_value."):
            k, v = _per_head(value, kv_heads_per_rank, 2, head_dim, f"{where}: {key}")
            out.update({p + f"self_attn.k_proj.{kind}": k, p + f"self_attn.v_proj.{kind}": v})
        else:
            raise ConfigError(f"{where}: {key} is not a tensor of NxDT's megatron "
                              + ("Llama (rmsnorm, swiglu, rope)" if gated else "GPT (gelu)"))
    return out


def _per_head(w: torch.Tensor, heads: int, parts: int, head_dim: int, where: str) -> list[torch.Tensor]:
    """[heads x parts x head_dim, H] rows (or a bias of as many), head by head its parts → each part's
    rows, heads in order."""
    if w.dim() not in (1, 2) or w.shape[0] != heads * parts * head_dim:
        raise ConfigError(f"{where}: {tuple(w.shape)} on a tp rank, ({heads * parts * head_dim}, H) expected "
                          f"({heads} heads a rank x {parts} x head_dim {head_dim})")
    rows = w.view(heads, parts, head_dim, *w.shape[1:])
    return [rows[:, i].reshape(heads * head_dim, *w.shape[1:]) for i in range(parts)]


def merge_experts(ranks: list[dict[str, torch.Tensor]], layers: list[int], tag) -> dict[str, torch.Tensor]:
    """The MoE layers' router and experts (each tp rank's, ep ranks already joined on dim 0) under
    nxdt's (transformers' Mixtral) names; popped from `ranks`."""
    out: dict[str, torch.Tensor] = {}
    for i in layers:
        p = f"model.layers.{i}."
        present = [n for n in (ROUTER, GATE_UP, DOWN) if p + n in ranks[0]]
        if not present:
            continue
        if len(present) < 3:
            missing = sorted({ROUTER, GATE_UP, DOWN} - set(present))[0]
            raise ConfigError(f"{tag}: {p}{missing} is missing (the layer has {present[0]})")
        routers = [r.pop(p + ROUTER) for r in ranks]
        if any(not torch.equal(routers[0], r) for r in routers[1:]):
            raise ConfigError(f"{tag}: {p}{ROUTER} differs between tp ranks (it is replicated)")
        gate_up = [r.pop(p + GATE_UP) for r in ranks]
        down = [r.pop(p + DOWN) for r in ranks]
        if any(t.dim() != 3 for t in gate_up + down) or any(t.shape[2] % 2 for t in gate_up):
            raise ConfigError(f"{tag}: {p}{GATE_UP}: {tuple(gate_up[0].shape)}, [experts, hidden, 2 x intermediate "
                              "per tp rank] expected")
        halves = [t.chunk(2, dim=2) for t in gate_up]
        gate = torch.cat([h[0] for h in halves], dim=2)
        up = torch.cat([h[1] for h in halves], dim=2)
        out[p + "mlp.gate.weight"] = routers[0]
        out[p + "mlp.experts.gate_up_proj"] = torch.cat([gate, up], dim=2).transpose(1, 2).contiguous()
        out[p + "mlp.experts.down_proj"] = torch.cat(down, dim=1).transpose(1, 2).contiguous()
    return out


def join_expert_ranks(per_ep: list[dict[str, torch.Tensor]], where) -> dict[str, torch.Tensor]:
    """One tp/pp rank's state dict from its ep ranks' (ep rank 0's tensors, each expert tensor
    joined over the ep ranks on dim 0, NxD's expert dimension)."""
    out = dict(per_ep[0])
    for key in [k for k in out if is_expert(k)]:
        parts = []
        for e, sd in enumerate(per_ep):
            if key not in sd:
                raise ConfigError(f"{where}: {key} is not in ep rank {e}'s file")
            parts.append(sd[key])
        out[key] = torch.cat(parts, dim=0)
    return out
