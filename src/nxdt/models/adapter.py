"""One adapter per model source: what the code outside models/ asks of a built model.

`build_model` attaches the adapter of the model it builds (`model.nxdt_adapter`); `adapter_of(model)`
finds it (for a model built another way: by its class, the one place that asks "is this nxdt's own
model?"). Parallelism (nxdt.parallel), generation (nxdt.inference) and the planner ask the adapter,
never the model's source:

    paths            embed / layers / norm / lm_head module paths (relative to the causal-LM root)
    decoder(model)   the module holding the decoder layers as `.layers`
    heads(model)     (query heads, K/V heads)
    block_extra_args positional arguments of a decoder block after the hidden states
    attention_kwarg  the attention's hidden-states keyword (None: the first positional argument)
    local_heads      after tensor parallel: query heads per K/V head a rank now computes
    stage_drops / as_stage   what a pipeline stage drops, and the stage module it runs as
    set_attention    route every attention's core through another kernel (context parallel's ring)
    recompute_aliases  NxDT module names -> this source's classes (activation checkpointing)
    generation_decoder / init_weights

native: nxdt's own Llama (nxdt.models.llama; Qwen3 too); hf: a transformers causal LM (Llama, Mixtral,
GPT-NeoX, Qwen3, Qwen3-MoE).
"""

from __future__ import annotations

import torch
from torch import nn

from nxdt.models.kv_cache import KVCache
from nxdt.models.llama import NxdtLlamaForCausalLM

# transformers' Qwen3 attentions: Llama's with q/k norms, the same attention-function seam
QWEN3_ATTENTIONS = ("Qwen3Attention", "Qwen3MoeAttention")


class ModelAdapter:
    """The module tree both sources share (transformers' LlamaForCausalLM's names)."""

    name = "base"
    embed = "model.embed_tokens"
    layers = "model.layers"
    norm = "model.norm"
    lm_head = "lm_head"
    block_extra_args = 0
    attention_kwarg: str | None = None
    head_axis = 1
    """The heads axis of q and k where per-head norms (Qwen3's q_norm / k_norm) see them."""
    recompute_aliases: dict[str, tuple[str, ...]] = {}

    def __deepcopy__(self, memo) -> ModelAdapter:  # one stateless adapter per source: copies of a model share it
        return self

    def decoder(self, model: nn.Module) -> nn.Module:
        """The module holding the decoder layers as `.layers`: `model.model` (both Llamas, Mixtral, a
        pipeline stage); a transformers model's `base_model` otherwise (GPT-NeoX: `model.gpt_neox`)."""
        for inner in (getattr(model, "model", None), getattr(model, "base_model", None)):
            if isinstance(inner, nn.Module) and isinstance(getattr(inner, "layers", None), nn.Module):
                return inner
        raise ValueError(f"{type(model).__name__}: no decoder layers found "
                         "(expected model.layers or base_model.layers)")

    def layers_path(self, model: nn.Module) -> str:
        """The decoder layers' module path (`model.layers`; `gpt_neox.layers` for transformers' GPT-NeoX)."""
        inner = self.decoder(model)
        prefix = next(name for name, m in model.named_children() if m is inner)
        return f"{prefix}.layers"

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        return list(self.decoder(model).layers)

    def heads(self, model: nn.Module) -> tuple[int, int]:
        raise NotImplementedError

    def local_heads(self, model: nn.Module, queries_per_kv: int) -> None:
        """After tensor parallel gave each rank one (shared) K/V head: the query heads it serves per K/V head."""

    def stage_drops(self, model: nn.Module, is_first: bool, is_last: bool) -> list[nn.Module]:
        """The modules (besides other stages' layers) a pipeline stage does not keep."""
        inner = self.decoder(model)
        drop: list[nn.Module] = []
        if not is_first:
            drop += [m for m in (getattr(inner, "embed_tokens", None), getattr(inner, "embed_positions", None))
                     if m is not None]
        if not is_last:
            drop += [inner.norm, model.get_submodule(self.lm_head)]
        return drop

    def as_stage(self, part: nn.Module, is_first: bool, is_last: bool) -> nn.Module:
        return part

    def set_attention(self, model: nn.Module, sdpa) -> bool:
        """Route every attention's core through `sdpa` (F.scaled_dot_product_attention's signature,
        causal); False when the model has no attention this adapter knows."""
        raise NotImplementedError

    def generation_decoder(self, model: nn.Module):
        raise NotImplementedError

    def init_weights(self, model: nn.Module) -> None:
        raise NotImplementedError


class NativeAdapter(ModelAdapter):
    """nxdt's own Llama: blocks take (x, rope, mask), its forward tolerates missing stage parts."""

    name = "native"
    block_extra_args = 2
    # NxDT's HF Mixtral class names: nxdt's native MoE model is its Llama with MoE MLPs
    recompute_aliases = {"MixtralRMSNorm": ("LlamaRMSNorm",), "MixtralDecoderLayer": ("LlamaDecoderLayer",)}

    def heads(self, model: nn.Module) -> tuple[int, int]:
        args = self.decoder(model).args
        return args.num_attention_heads, args.num_kv_heads

    def set_attention(self, model: nn.Module, sdpa) -> bool:
        cores = [m for m in model.modules() if hasattr(m, "sdpa") and type(m).__name__ == "CoreAttention"]
        for core in cores:
            core.sdpa = sdpa  # CoreAttention's documented seam for the attention kernel
        for m in model.modules():
            # A head-tail slice's positions jump (e.g. 0-7 then 24-31) without starting a document.
            if hasattr(m, "positions_mark_documents"):
                m.positions_mark_documents = False
        return bool(cores)

    def generation_decoder(self, model: nn.Module):
        return NativeDecoder(model)

    def init_weights(self, model: nn.Module) -> None:
        model.init_weights()


class HFAdapter(ModelAdapter):
    """A transformers causal LM: attention and blocks take keyword arguments."""

    name = "hf"
    attention_kwarg = "hidden_states"
    head_axis = 2  # transformers' Qwen3 norms q and k as [B, S, heads, head_dim]
    recompute_aliases = {"CoreAttention": ("LlamaAttention", "MixtralAttention", "GPTNeoXAttention", *QWEN3_ATTENTIONS),
                         "LlamaMLP": ("GPTNeoXMLP", "Qwen3MLP", "Qwen3MoeMLP")}

    def heads(self, model: nn.Module) -> tuple[int, int]:
        c = model.config
        return c.num_attention_heads, getattr(c, "num_key_value_heads", None) or c.num_attention_heads

    def local_heads(self, model: nn.Module, queries_per_kv: int) -> None:
        # transformers repeats K/V by num_key_value_groups (query heads per K/V head)
        for block in self.blocks(model):
            block.self_attn.num_key_value_groups = queries_per_kv

    def as_stage(self, part: nn.Module, is_first: bool, is_last: bool) -> nn.Module:
        if not is_last:
            part.model.norm = nn.Identity()  # transformers' forward always calls norm
        return HFStage(part, is_first, is_last)

    def set_attention(self, model: nn.Module, sdpa) -> bool:
        config = getattr(model, "config", None)
        attns = [m for m in model.modules()
                 if type(m).__name__ in ("LlamaAttention", *QWEN3_ATTENTIONS) and hasattr(m, "num_key_value_groups")]
        if config is None or not attns:
            return False
        from transformers import AttentionInterface  # noqa: PLC0415 - transformers loads only for an hf model

        AttentionInterface.register(HF_RING, _hf_routed_attention)
        config._attn_implementation = HF_RING
        for attn in attns:
            attn.nxdt_sdpa = sdpa
        return True

    def generation_decoder(self, model: nn.Module):
        return HFDecoder(model)

    def init_weights(self, model: nn.Module) -> None:
        for module in model.modules():
            # transformers skips modules it has already initialised; after to_empty none are.
            if hasattr(module, "_is_hf_initialized"):
                module._is_hf_initialized = False
        model.init_weights()


NATIVE = NativeAdapter()
HF = HFAdapter()


def adapter_of(model: nn.Module) -> ModelAdapter:
    """The adapter `build_model` attached, else the one of the model's class."""
    adapter = getattr(model, "nxdt_adapter", None)
    if adapter is not None:
        return adapter
    return NATIVE if isinstance(model, NxdtLlamaForCausalLM) else HF


def attach_adapter(model: nn.Module, adapter: ModelAdapter) -> nn.Module:
    model.nxdt_adapter = adapter  # a plain attribute: copied with the model, not a submodule
    return model


# --------------------------------------------------------------------------- transformers' pieces
HF_RING = "nxdt_ring"  # our name in transformers' attention registry


def _hf_routed_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers' attention-function signature (see `AttentionInterface`) over the kernel
    `set_attention` put on the module (context parallel's ring attention).

    transformers builds no mask for an attention name it has no mask function for, so
    `attention_mask` is None here; the kernel computes plain causal attention."""
    n_rep = query.shape[1] // key.shape[1]  # GQA: whole K/V heads, read from the (tp-local) tensors
    if n_rep > 1:
        key, value = (t.repeat_interleave(n_rep, dim=1) for t in (key, value))
    out = module.nxdt_sdpa(query, key, value, is_causal=True, dropout_p=dropout, scale=scaling)
    return out.transpose(1, 2).contiguous(), None  # [B, S, H, D] as transformers expects


class HFStage(nn.Module):
    """A pruned transformers `LlamaForCausalLM` as a pipeline stage: token ids or hidden states in,
    hidden states or logits out. Holds `model` and `lm_head` as children, so parameter names
    are those of the whole model."""

    def __init__(self, part: nn.Module, is_first: bool, is_last: bool) -> None:
        super().__init__()
        self.model = part.model
        self.lm_head = part.lm_head if is_last else None
        self.config = part.config
        self.is_first = is_first
        self.nxdt_adapter = HF

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        if self.is_first:
            out = self.model(input_ids=x, position_ids=position_ids)
        else:
            out = self.model(inputs_embeds=x, position_ids=position_ids)
        hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        return self.lm_head(hidden) if self.lm_head is not None else hidden


class NativeDecoder:
    """Generation with nxdt's own model and nxdt's KVCache."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def start(self, valid: torch.Tensor, max_length: int) -> KVCache:
        return KVCache(max_length, valid)

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
        return self.model(ids, positions, kv_cache=cache)


class HFDecoder:
    """Generation with a transformers causal LM: its own DynamicCache and a 2-D padding mask."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def start(self, valid: torch.Tensor, max_length: int):
        from transformers import DynamicCache  # noqa: PLC0415 - transformers loads only for an hf model

        mask = torch.ones(valid.shape[0], max_length, dtype=torch.long, device=valid.device)
        mask[:, : valid.shape[1]] = valid.long()
        return {"cache": DynamicCache(config=self.model.config), "mask": mask, "length": 0}

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, state) -> torch.Tensor:
        end = state["length"] + ids.shape[1]
        # no router logits: they only feed the training's load-balancing loss (and transformers' Mixtral
        # cannot compute that loss over a cached, padded batch)
        extra = {"output_router_logits": False} if hasattr(self.model.config, "output_router_logits") else {}
        out = self.model(input_ids=ids, attention_mask=state["mask"][:, :end], position_ids=positions,
                         past_key_values=state["cache"], use_cache=True, **extra)
        state["length"] = end
        return out.logits
