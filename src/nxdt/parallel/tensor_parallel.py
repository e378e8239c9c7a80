"""Tensor and sequence parallelism for a Llama (native or transformers), as a plan applied from outside.

Megatron's layout, written as DTensor parallel styles over the ``tp`` mesh axis:

    model.embed_tokens          RowwiseParallel      vocab-parallel embedding (rows = vocabulary)
    self_attn.{q,k,v}_proj      ColwiseParallel      each rank holds whole heads
    self_attn.o_proj            RowwiseParallel      partial sums → all-reduce (or reduce-scatter with SP)
    mlp.{gate,up}_proj          ColwiseParallel
    mlp.down_proj               RowwiseParallel
    mlp.gate (MoE router)       whole on every tp rank (sequence gathered in, sliced out with SP)
    mlp.experts                 ExpertsTensorParallel each expert's intermediate dim over tp (NxD's)
    lm_head                     ColwiseParallel      logits stay a Shard(-1) DTensor for `loss_parallel`

With ``sequence_parallel`` the residual stream between the tp regions is sharded along the
sequence (dim 1) from the first block's input to the final norm (or the last block's output
when a pipeline stage has no final norm): the norms run on a sequence shard (SequenceParallel), attention and MLP
gather the sequence on entry (PrepareModuleInput) and reduce-scatter on exit (o_proj /
down_proj output Shard(1)). The arithmetic is the same as one process; only where the
activations live changes.

Block types (`transformer_block_type`, see nxdt.models.llama.LlamaDecoderLayer): a block's norms
are its children named ``*layernorm`` (pre_ln: input_ + post_attention_; post_ln:
post_attention_ + post_mlp_; normformer: + attention_output_; gpt_j: one or two input norms),
each a SequenceParallel module with sequence parallel, its output handed on as the local shard
(post_ln and normformer add a norm's output to the residual stream, which is a local shard).
Attention and MLP take a sequence shard whoever produced it. normformer's ``mlp.ffn_layernorm``
normalizes the intermediate activations, which colwise up_proj leaves sharded over tp (last
dim): it gathers the whole row in (Shard(-1) → Replicate), runs as a plain module with whole
weights on every tp rank (like a norm without sequence parallel), and hands on this rank's
slice (Replicate → Shard(-1)), with or without sequence parallel. post_ln's final norm is an
Identity (left alone: lm_head takes the sequence shard).

Heads: both models reshape q/k/v with ``-1`` heads and a fixed head_dim, so a shard holding
H/tp heads runs the model code unchanged. When tp > num_kv_heads each rank needs one whole
K/V head that several ranks share: `KVHeadSelect` keeps k_proj/v_proj replicated over tp and
each rank computes all K/V heads (few, cheap) and keeps the one its query heads use; the
gradient of the shared weight is summed over the ranks (Partial), exactly the single-process
gradient. This is NxDT's ``kv_replicator`` without copying weights: checkpoints keep the
original [num_kv_heads × head_dim, hidden] shape and load into any tp.

LoRA (nxdt.models.lora.LoraLinear, an nn.Linear with ``lora_A`` / ``lora_B`` children): the styles
distribute a module's parameters recursively under dotted names, which ``register_parameter``
refuses, so the adapters are taken off while the plan is applied and then distributed like the
base weight (`lora_adapter_placements`): the module's forward runs on the DTensors the style's
input hook hands it, and the low-rank path ends in the same layout as the base path, reduced by
the same output collective (no extra communication).

Functions take a module whose blocks are ``model.model.layers`` (possibly a pipeline stage's
subset; missing embed_tokens / norm / lm_head are skipped).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Placement,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

from nxdt.models.adapter import adapter_of
from nxdt.models.lora import adapters_detached, lora_modules
from nxdt.models.moe import MoEExperts
from nxdt.parallel.expert_parallel import ADAPTER_TP_PLACEMENTS, ExpertsTensorParallel, distribute_expert_adapters

__all__ = ["KVHeadSelect", "apply_tensor_parallel", "block_norms", "distribute_lora_adapters", "loss_parallel",
           "llama_tp_plan", "tp_local_numel"]


class KVHeadSelect(ParallelStyle):
    """k_proj / v_proj when tp > num_kv_heads: replicated weight, each rank keeps its K/V head(s).

    Rank t of the tp group serves query heads [t·H/tp, (t+1)·H/tp), which all read K/V head
    t // (tp / kv). The full projection (kv heads, small) is computed on every rank; its
    gradient is marked Partial so the weight's gradient is the sum over the ranks sharing it.
    """

    def __init__(self, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        tp = device_mesh.size()
        per_head = tp // self.num_kv_heads
        head = device_mesh.get_local_rank() // per_head
        lo, hi = head * self.head_dim, (head + 1) * self.head_dim

        def partition_fn(name, mod, mesh):
            for pname, param in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(pname, nn.Parameter(distribute_tensor(param, mesh, [Replicate()])))

        def input_fn(mod, inputs, mesh):
            x = inputs[0]
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
            return (x.redistribute(mesh, [Replicate()]), *inputs[1:])

        def output_fn(mod, out, mesh):
            return out.to_local(grad_placements=[Partial()])[..., lo:hi]

        return distribute_module(module, device_mesh, partition_fn, input_fn, output_fn)


class SumGradOverTP(ParallelStyle):
    """A module whose (replicated) first input each tp rank uses for its own heads only: forward
    unchanged, the input's gradient summed over the tp ranks (MLA's shared rotary key)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def input_fn(mod, inputs, mesh):
            x = DTensor.from_local(inputs[0], mesh, [Replicate()], run_check=False)
            return (x.to_local(grad_placements=[Partial()]), *inputs[1:])

        return distribute_module(module, device_mesh, input_fn=input_fn)


def _mla_plan(plan: dict, p: str, attn: nn.Module, sp: bool) -> None:
    """Multi-head latent attention (nxdt.models.mla) as the reference implementations split it: the
    per-head projections (q_proj or q_b_proj, kv_b_proj) column-wise, o_proj row-wise, the latent
    projections and norms replicated (their input gradients come back summed through the column-wise
    layers), the shared rotary key's gradient summed over the ranks' heads."""
    for name in ("q_proj", "q_b_proj", "kv_b_proj"):
        if isinstance(getattr(attn, name, None), nn.Module):
            plan[f"{p}.self_attn.{name}"] = ColwiseParallel()
    plan[f"{p}.self_attn.rope_key"] = SumGradOverTP()
    if sp:  # the gathered input as a local tensor: the replicated latent projections take plain tensors
        plan[f"{p}.self_attn"] = PrepareModuleInput(input_layouts=(SEQUENCE, None, None),
                                                    desired_input_layouts=(Replicate(), None, None), use_local_output=True)
    plan[f"{p}.self_attn.o_proj"] = RowwiseParallel(output_layouts=SEQUENCE if sp else Replicate())


def _is_moe(mlp: nn.Module) -> bool:
    """An MoE layer in the MLP's place. Its router is not split over tp: every tp rank routes the
    same (whole, with sequence parallel gathered) tokens, so routing is one process's and the
    router's gradient agrees across tp without a reduction. nxdt's experts (MoEExperts) split each
    expert's intermediate dimension over tp (ExpertsTensorParallel, NxD's ExpertMLPs); another
    block's experts (a transformers MoE block other than Mixtral's) stay whole on every tp rank."""
    return hasattr(mlp, "experts") and hasattr(mlp, "gate")


def _moe_output(mlp: nn.Module) -> Placement:
    """What an MoE layer's output is on a tp rank: this rank's partial sums (nxdt's experts split over
    tp, reduced by the layer's output style), or whole (a dropout on it needs the whole output; a
    block with other experts keeps them whole)."""
    args = getattr(mlp, "args", None)
    split = isinstance(mlp.experts, MoEExperts) and args is not None and not args.dropout
    return Partial() if split else Replicate()


def block_norms(block: nn.Module) -> list[str]:
    """Names of a decoder block's own norms (its children named ``*layernorm``); which it has
    depends on the block type. Norms inside the MLP (normformer's ffn_layernorm) are not listed."""
    return [name for name, _ in block.named_children() if name.endswith("layernorm")]


SEQUENCE = Shard(1)  # the sequence dimension of [B, S, H]: what sequence parallel shards


def _sequence_parallel_block(plan: dict, adapter, p: str, block: nn.Module, first_block: bool, whole_out: bool) -> None:
    """Sequence parallel's entries of block `p`: its norms on the sequence shard, attention and MLP
    gathering it in. Between blocks the residual stream is a sequence shard; at the edges of the block
    list (and so of a pipeline stage) it is whole: HF builds its causal mask and rotary table from the
    embedding's output length, and stages pass full [B, S, H] tensors."""
    seq = SEQUENCE
    # positional arguments after the hidden states (native: rope, mask); transformers passes keywords
    rest = (None,) * adapter.block_extra_args
    edge = {}
    if first_block:
        edge.update(input_layouts=(Replicate(), *rest), desired_input_layouts=(seq, *rest))
    if whole_out:
        edge.update(output_layouts=seq, desired_output_layouts=Replicate())
    if "input_layouts" in edge and "output_layouts" in edge:
        plan[p] = PrepareModuleInputOutput(**edge, use_local_input=True)
    elif "input_layouts" in edge:
        plan[p] = PrepareModuleInput(**edge, use_local_output=True)
    elif edge:
        plan[p] = PrepareModuleOutput(**edge)
    for norm in block_norms(block):
        plan[f"{p}.{norm}"] = SequenceParallel(use_local_output=True)
    if adapter.attention_kwarg:
        plan[f"{p}.self_attn"] = PrepareModuleInput(
            input_kwarg_layouts={adapter.attention_kwarg: seq},
            desired_input_kwarg_layouts={adapter.attention_kwarg: Replicate()})
    else:  # forward(x, rope, mask)
        plan[f"{p}.self_attn"] = PrepareModuleInput(
            input_layouts=(seq, None, None), desired_input_layouts=(Replicate(), None, None))
    if _is_moe(block.mlp):  # gathered in; partial sums reduce-scattered (or a whole output sliced)
        plan[f"{p}.mlp"] = PrepareModuleInputOutput(
            input_layouts=(seq,), desired_input_layouts=(Replicate(),), use_local_input=True,
            output_layouts=(_moe_output(block.mlp),), desired_output_layouts=(seq,), use_local_output=True)
    else:
        plan[f"{p}.mlp"] = PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),))


def _mlp_plan(plan: dict, p: str, mlp: nn.Module, sp: bool) -> None:
    """The MLP's entries of block `p`: up (and gate) column-parallel, down row-parallel; an MoE layer's
    experts each split over tp (their intermediate dimension), its router whole."""
    if _is_moe(mlp):
        if isinstance(mlp.experts, MoEExperts):  # each expert's F over tp; the router whole
            plan[f"{p}.mlp.experts"] = ExpertsTensorParallel(reduce_output=_moe_output(mlp) != Partial())
            if not sp and _moe_output(mlp) == Partial():  # the partial sums all-reduced
                plan[f"{p}.mlp"] = PrepareModuleOutput(output_layouts=(Partial(),),
                                                       desired_output_layouts=(Replicate(),), use_local_output=True)
            shared = f"{p}.mlp.shared_experts"  # DeepSeek-V3: split too, its partial sums joining the experts'
            if isinstance(getattr(mlp, "shared_experts", None), nn.Module) and _moe_output(mlp) == Partial():
                plan[f"{shared}.gate_proj"], plan[f"{shared}.up_proj"] = ColwiseParallel(), ColwiseParallel()
                plan[f"{shared}.down_proj"] = RowwiseParallel(output_layouts=Partial())
        return
    if hasattr(mlp, "gate_proj"):
        plan[f"{p}.mlp.gate_proj"] = ColwiseParallel()
    plan[f"{p}.mlp.up_proj"] = ColwiseParallel()
    if getattr(mlp, "ffn_layernorm", None) is not None:  # normformer: a norm over the whole row
        plan[f"{p}.mlp.ffn_layernorm"] = PrepareModuleInputOutput(
            input_layouts=(Shard(-1),), desired_input_layouts=(Replicate(),), use_local_input=True,
            output_layouts=(Replicate(),), desired_output_layouts=(Shard(-1),), use_local_output=True)
    plan[f"{p}.mlp.down_proj"] = RowwiseParallel(output_layouts=SEQUENCE if sp else Replicate())


def llama_tp_plan(model: nn.Module, tp: int, sequence_parallel: bool, blocks: list[tuple[str, nn.Module]] | None = None,
                  first: bool = True, last: bool = True) -> dict[str, ParallelStyle]:
    """The plan {module path: ParallelStyle} for `model` (paths relative to the causal-LM root).

    `blocks`: the (path, block) pairs of one pipeline stage (default: every block `model` holds,
    under its own name: a stage part's layers keep the whole model's indices); `first` / `last`:
    whether that stage holds the embedding / the final norm and output layer (and `model` has them).
    Works on a model built on the meta device (nxdt.parallel.plan makes the planner's plan so)."""
    adapter = adapter_of(model)
    heads, kv = adapter.heads(model)
    if heads % tp:
        raise ValueError(f"num_attention_heads ({heads}) is not divisible by tensor_model_parallel_size ({tp})")
    replicate_kv = tp > kv
    if replicate_kv and tp % kv:
        raise ValueError(f"tensor_model_parallel_size ({tp}) must be a multiple of num_kv_heads ({kv})")
    sp = sequence_parallel
    seq = SEQUENCE
    names = dict(model.named_modules())
    if blocks is None:
        layers = adapter.layers_path(model)
        blocks = [(f"{layers}.{name}", block) for name, block in adapter.decoder(model).layers.named_children()]
    has_embed, has_norm = first and adapter.embed in names, last and adapter.norm in names
    plan: dict[str, ParallelStyle] = {}

    if has_embed:
        plan[adapter.embed] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    for i, (p, block) in enumerate(blocks):
        head_dim = block.self_attn.head_dim
        if sp:
            _sequence_parallel_block(plan, adapter, p, block, first_block=i == 0,
                                     whole_out=i == len(blocks) - 1 and not has_norm)
        if hasattr(block.self_attn, "kv_b_proj"):
            _mla_plan(plan, p, block.self_attn, sp)
            _mlp_plan(plan, p, block.mlp, sp)
            continue
        plan[f"{p}.self_attn.q_proj"] = ColwiseParallel()
        plan[f"{p}.self_attn.k_proj"] = KVHeadSelect(kv, head_dim) if replicate_kv else ColwiseParallel()
        plan[f"{p}.self_attn.v_proj"] = KVHeadSelect(kv, head_dim) if replicate_kv else ColwiseParallel()
        plan[f"{p}.self_attn.o_proj"] = RowwiseParallel(output_layouts=seq if sp else Replicate())
        for qk in ("q_norm", "k_norm"):  # Qwen3's per-head norms: weights whole, this rank's heads a shard of
            if isinstance(getattr(block.self_attn, qk, None), nn.Module):  # the heads axis (gradients summed)
                plan[f"{p}.self_attn.{qk}"] = SequenceParallel(sequence_dim=adapter.head_axis, use_local_output=True)
        _mlp_plan(plan, p, block.mlp, sp)
    if has_norm and sp and not isinstance(names[adapter.norm], nn.Identity):
        plan[adapter.norm] = SequenceParallel(use_local_output=True)
    if last and adapter.lm_head in names:
        plan[adapter.lm_head] = ColwiseParallel(
            input_layouts=seq if sp else Replicate(), output_layouts=Shard(-1), use_local_output=False)
    return plan


def tp_local_numel(style: ParallelStyle | None, param: str, numel: int, tp: int) -> int:
    """Elements of one parameter (`param`: weight / bias of the module `style` is applied to) that
    one tensor-parallel rank holds. Colwise: weight and bias split; rowwise: the weight split (a
    linear's columns, an embedding's rows), the bias whole; KVHeadSelect: one K/V head per rank
    (the planner's count: numel / num_kv_heads); ExpertsTensorParallel: both expert weights split;
    other styles leave parameters whole."""
    if isinstance(style, (ColwiseParallel, ExpertsTensorParallel)):  # before RowwiseParallel: neither subclasses the other
        return math.ceil(numel / tp)
    if isinstance(style, RowwiseParallel):
        return math.ceil(numel / tp) if param == "weight" else numel
    if isinstance(style, KVHeadSelect):
        return numel // style.num_kv_heads
    return numel


def lora_local_numel(base_style: ParallelStyle | None, adapter: str, numel: int, tp: int, weight: str = "weight") -> int:
    """Elements of a LoRA adapter's weight (`adapter`: lora_A or lora_B) one tensor-parallel rank
    holds, its linear placed by `base_style`: split where `lora_adapter_placements` shards it (an
    expert weight's, `weight` gate_up_proj / down_proj: where ADAPTER_TP_PLACEMENTS does)."""
    base = (Shard(0) if isinstance(base_style, ColwiseParallel) else Shard(1) if isinstance(base_style, RowwiseParallel)
            else Replicate())
    placement = lora_adapter_placements(base)[adapter == "lora_B"]
    if isinstance(base_style, ExpertsTensorParallel):
        placement = ADAPTER_TP_PLACEMENTS[(adapter, weight)]
    return math.ceil(numel / tp) if isinstance(placement, Shard) else numel


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool = False,
                          plan: dict[str, ParallelStyle] | None = None) -> nn.Module:
    """Shard `model` over `tp_mesh` in place (no-op when tp == 1) by `plan` (a ParallelPlan's styles
    for this model or stage; None: `llama_tp_plan` of the model). Returns the model.

    Afterwards the model's logits are a DTensor sharded on the vocabulary (Shard(-1)): compute
    the cross entropy under `loss_parallel()` (see nxdt.training.loss.masked_token_loss).
    """
    tp = tp_mesh.size()
    if tp == 1:
        return model
    adapter = adapter_of(model)
    heads, kv = adapter.heads(model)
    tied = _tied(model)
    if plan is None:
        plan = llama_tp_plan(model, tp, sequence_parallel)
    # the styles make new Parameters (requires_grad True): a frozen one (LoRA's base) must stay frozen
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    with adapters_detached(model):  # the styles distribute a module's parameters recursively
        parallelize_module(model, tp_mesh, plan)
    distribute_lora_adapters(model, tp_mesh)
    distribute_expert_adapters(model, tp_mesh)
    if tied:  # embedding (rows) and lm_head (colwise = rows of its weight) share Shard(0)
        model.lm_head.weight = model.model.embed_tokens.weight
    for name, p in model.named_parameters():
        if name in frozen:
            p.requires_grad_(False)
    if tp > kv:  # a rank now holds H/tp query heads and one K/V head
        adapter.local_heads(model, heads // tp)
    return model


def lora_adapter_placements(base: Placement) -> tuple[Placement, Placement]:
    """(lora_A, lora_B) placements for a LoRA linear whose base weight is placed as `base`.

    colwise base (Shard(0), rows = outputs): A whole, B split by its rows like W, so x (Replicate)
    → A x (Replicate) → B A x (Shard(-1)) lands where x W^T does. rowwise base (Shard(1), columns =
    inputs): A split by its columns like W, B whole: x (Shard(-1)) → A x (Partial) → B A x (Partial),
    summed with x W^T (Partial) and reduced once by the style's output hook (all-reduce, or
    reduce-scatter to Shard(1) with sequence parallel). Replicated base (KVHeadSelect): both whole."""
    if base == Shard(0):
        return Replicate(), Shard(0)
    if base == Shard(1):
        return Shard(1), Replicate()
    return Replicate(), Replicate()


def distribute_lora_adapters(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Make every LoraLinear's adapter weights DTensors on `tp_mesh`, placed as `lora_adapter_placements`
    says for its (already distributed) base weight. Its forward then sees DTensor inputs (the base
    style's input hook) and DTensor arithmetic gives the sharded result with no extra collective.
    A LoraLinear whose base the plan left alone keeps plain adapters."""
    for module in lora_modules(model).values():
        if not isinstance(module.weight, DTensor):
            continue
        placements = lora_adapter_placements(module.weight.placements[0])
        for adapter, placement in zip((module.lora_A, module.lora_B), placements):
            w = adapter.weight
            adapter.weight = nn.Parameter(distribute_tensor(w.detach(), tp_mesh, [placement]),
                                          requires_grad=w.requires_grad)


def _tied(model: nn.Module) -> bool:
    emb = getattr(getattr(model, "model", None), "embed_tokens", None)
    head = getattr(model, "lm_head", None)
    return emb is not None and head is not None and head.weight is emb.weight


def is_vocab_parallel(logits: torch.Tensor) -> bool:
    """True for logits sharded on the vocabulary (compute their loss under loss_parallel)."""
    return isinstance(logits, DTensor) and any(p.is_shard() for p in logits.placements)


def total_norm(tensors: list[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
    """The p-norm of all `tensors` as a plain tensor, when some are DTensors (sharded or replicated
    over tp / dp) and some plain (e.g. norm weights under tp without sequence parallel, which
    every tp rank holds whole and identical: counted once).

    Accumulated in float64 (where the device has it): each tensor's (local shard's) norm, their
    combination and DTensor's reduction of the powers across ranks (`full_tensor()` of the
    partial norm). In fp32 the result depended on how the elements were split over ranks (~1e-5
    relative, 2.4e-4 on small late-step norms), so the logged and clipping norm of a sharded
    layout differed from one process's; in fp64 the summation order no longer shows."""
    by_mesh: dict[object, list[DTensor]] = {}
    for t in tensors:
        if isinstance(t, DTensor):
            by_mesh.setdefault(t.device_mesh, []).append(t)
    plain = [t for t in tensors if not isinstance(t, DTensor)]
    # e.g. replicate over dp on top of tp: tp-sharded params live on the (dp, tp) mesh, the others on dp
    parts = [_norm(group, norm_type).full_tensor() for group in by_mesh.values()]
    if plain:
        parts.append(_norm(plain, norm_type))
    if not parts:
        return torch.zeros((), dtype=torch.float64)
    if len(parts) == 1:
        return parts[0]
    return torch.linalg.vector_norm(torch.stack(parts), norm_type)


def _norm(tensors: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """torch.nn.utils.get_total_norm (foreach=None) with the accumulation in float64: per-tensor
    norms, then the norm of the stacked norms (DTensors: a partial norm, reduced by full_tensor)."""
    # XLA (Neuron, TPU) and MPS have no fast or no float64 at all: fp32 there, as before
    dtype = torch.float32 if tensors[0].device.type in ("xla", "mps") else torch.float64
    norms = [torch.linalg.vector_norm(t, norm_type, dtype=dtype) for t in tensors]
    return torch.linalg.vector_norm(torch.stack(norms), norm_type)


@torch.no_grad()
def clip_grads_with_norm_(parameters: list[torch.Tensor], max_norm: float | None, norm: torch.Tensor) -> None:
    """Scale the gradients by max_norm / norm when that is below 1 (torch's rule), for a mix of
    DTensor and plain gradients (torch's foreach version refuses the mix)."""
    if not max_norm or max_norm <= 0 or not math.isfinite(max_norm):
        return
    # The host read costs one graph execution per step on XLA. A device-side coefficient would
    # avoid it, but torch-xla 2.9 on XLA:CPU computes it wrongly: after a mark_step, scaling
    # [3,0,0] and [0,4,0] by a coefficient built from both of their norms gave [.6,0,0] twice.
    coef = max_norm / (float(norm) + 1e-6)
    if coef >= 1.0:
        return
    groups: dict[object, list[torch.Tensor]] = {}
    for p in parameters:
        if p.grad is not None:
            groups.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p.grad)
    for group in groups.values():
        torch._foreach_mul_(group, coef)
