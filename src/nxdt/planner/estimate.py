"""What a config will cost per rank, without training and without a process group: the one
estimator behind `nxdt plan` (nxdt.tools.plan, its command line) and the run's start summary.

The model is built on the meta device (no memory, seconds even for 70B), so the parameter
count is exact; for a mixture of experts also the parameters activated per token (the top_k of
E experts' share, nxdt.models.param_count). What each rank holds is read from the run's parallel
plan (nxdt.parallel.plan.make_plan of that model: the one the run applies): the pipeline stage split
and each rank's stages (the rank holding the most parameters), each parameter's tensor-parallel
shard (its module's style), /dp_shard under FSDP, expert weights /tp /ep
(and over their dp/ep replicas under FSDP). Memory per rank is split into
parameters, gradients, optimizer state (fp32 master weights included) and activations for the
precision preset, ZeRO-1 / FSDP sharding and activation checkpointing; see docs/plan.md for
every formula. Model FLOPs per token: nxdt.models.flops. World size = trainer.devices x
trainer.num_nodes.

Vocabulary of a megatron-source model: the caller's (a run passes its tokenizer's); else
`model.vocab_size` when set; else the tokenizer's size when it is on this machine; else a known
size by tokenizer kind (GPT2BPETokenizer 50,257; otherwise the Llama-2 SentencePiece tokenizer,
32,000), reported as assumed. Either way the builder pads it as training would
(make_vocab_size_divisible_by x tp).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from nxdt.config.errors import ConfigError
from nxdt.models import build_model
from nxdt.models.flops import ModelShape, flops_per_token, lookup_parameters, model_shape
from nxdt.models.lora import inject_lora, lora_parameter_counts
from nxdt.models.param_count import activated_elements, expert_parameter_names, parameter_counts
from nxdt.parallel.plan import ParallelPlan, make_plan

GPT2_VOCAB = 50257
LLAMA2_VOCAB = 32000

# Optimizer states per parameter (full-size tensors), by model.optim.name. sgd and sm3 add one
# (momentum) when model.optim.momentum > 0; sm3 also keeps small per-dimension accumulators
# (sm3_accumulator_elems).
OPTIMIZER_STATES = {
    "adamw": 2, "adam": 2, "adamw_fp32OptState": 2, "adamax": 2, "adadelta": 2, "rprop": 2,
    "rmsprop": 1, "adagrad": 1, "novograd": 1, "sgd": 0, "adafactor": 0, "lion": 1, "sm3": 0,
}


def sm3_accumulator_elems(shape) -> int:
    """Elements of SM3's accumulators for one parameter: one per index of each dimension, so
    the sum of the dimensions (a (4096, 11008) matrix: 15,104, not 45 million); 1 for a scalar."""
    return max(1, sum(shape))


def _trained_base_parameters(model: nn.Module) -> int:
    """Elements of the base model that a LoRA run trains in full (`modules_to_save`, `lora_bias`) and
    that a token multiplies: their weight gradients cost FLOPs like any trained weight's. Adapters are
    not the base; untied lookup tables do no matmul; an expert weight counts its activated share
    (top_k / E), as the frozen count it comes out of does."""
    multiplied = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    tables = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)} - multiplied
    trained = {n for n, p in model.named_parameters()
               if p.requires_grad and id(p) not in tables and not any(part.startswith("lora_") for part in n.split("."))}
    return activated_elements(model, trained)


@dataclass
class Bytes:
    """Bytes per element of each memory kind for a precision preset."""
    param: int
    grad: int
    master: int  # fp32 master copy kept by the optimizer (0 = none)
    state: int   # optimizer state element
    activation: int


def precision_bytes(cfg, optimizer: str) -> Bytes:
    p = cfg.precision
    kind = p.type
    if kind in ("fp32",):
        b = Bytes(4, 4, 0, 4, 4)
    elif kind == "autocast":
        b = Bytes(4, 4, 0, 4, 2)  # fp32 weights, bf16 compute
    elif kind in ("mixed_precision", "mixed_precisionSR", "mixed_precision_SR"):
        b = Bytes(2, 4, 4, 4, 2)  # bf16 params, fp32 grads, fp32 master + fp32 states
    elif kind == "bf16SR":
        b = Bytes(2, 2, 0, 2, 2)
    else:  # manual
        bf16 = "1" in (str(p.xla_use_bf16), str(p.xla_downcast_bf16))
        pb = 2 if bf16 else 4
        b = Bytes(pb, 4 if (p.fp32_grad_acc or pb == 4) else 2, 4 if (p.master_weights and pb == 2) else 0,
                  4 if (p.master_weights or pb == 4) else 2, pb)
    if optimizer in ("adamw_fp32OptState", "sm3"):  # both keep fp32 state whatever the params
        b.state = 4
    return b


def model_vocabulary(cfg, tokenizer_size: int | None) -> int | None:
    """The vocabulary a run builds its model with (before padding): `model.vocab_size` when set (a
    larger output layer than the tokenizer needs, e.g. to match a published model's), else the run's
    tokenizer size; the plan (`planned_vocab`) reads the same key first. Smaller than the tokenizer
    is refused: its ids past the table would index out of range."""
    if cfg.model_source == "hf" or not cfg.model.vocab_size:
        return tokenizer_size
    if tokenizer_size is not None and cfg.model.vocab_size < tokenizer_size:
        raise ConfigError(f"model.vocab_size ({cfg.model.vocab_size}) is smaller than the tokenizer's vocabulary "
                          f"({tokenizer_size}): set it >= {tokenizer_size} or null (the tokenizer's size)")
    return int(cfg.model.vocab_size)


def planned_vocab(cfg) -> tuple[int | None, str]:
    """(the vocabulary the plan builds the model with, where it comes from); see the module docstring."""
    if cfg.model_source == "hf":
        return None, "from model_config"
    if cfg.model.vocab_size:
        return int(cfg.model.vocab_size), "model.vocab_size"
    tok = cfg.data.tokenizer
    if tok.library == "huggingface" and tok.type and Path(str(tok.type)).is_dir():
        from nxdt.data.tokenizers import build_tokenizer  # noqa: PLC0415 - only when a local tokenizer exists

        try:
            return len(build_tokenizer(tok)), f"tokenizer {tok.type}"
        except Exception:  # noqa: BLE001 - fall back to the known sizes below
            pass
    if str(tok.type) == "GPT2BPETokenizer":
        return GPT2_VOCAB, "assumed: GPT-2 BPE (set model.vocab_size)"
    return LLAMA2_VOCAB, "assumed: Llama-2 tokenizer (set model.vocab_size)"


def _expert_shard_numel(numel: int, ep: int, fsdp_ways: int) -> int:
    """Elements of one expert weight held by one rank, `numel` already its tensor-parallel shard
    (each expert's intermediate dimension / tp, nxdt.parallel.expert_parallel): E/ep experts, and
    under FSDP that shard split again over the experts' replicas, edp = dp/ep ranks
    (nxdt.parallel.data_parallel shards each experts module over the edp axis)."""
    return -(-numel // (ep * fsdp_ways))  # integer ceil: exact for any size


def rank_memory(dense: int, experts: int, b: Bytes, states: int, *, zero1: bool, dp: int, ep: int,
                factored: int = 0) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state on one rank holding `dense` non-expert
    and `experts` expert elements (already split by tp, pp, ep and FSDP). `factored`: optimizer
    state elements not proportional to the parameters' sizes (SM3's accumulators), / dp under ZeRO-1.

    ZeRO-1 divides the optimizer state (master included) of the dense parameters by dp. Expert
    weights: with ep = 1 they are ordinary parameters, / dp too; with ep > 1 each rank steps its
    own E/ep experts whole (`zero1_optimizer(rank_local=...)` in nxdt.parallel.data_parallel),
    so their state is not split further over their dp/ep replicas.
    """
    n = dense + experts
    per_elem = b.master + states * b.state
    optim_dense, optim_experts = dense * per_elem + factored * b.state, experts * per_elem
    if zero1:
        optim_dense = math.ceil(optim_dense / dp)
        optim_experts = math.ceil(optim_experts / dp) if ep == 1 else optim_experts
    return {"params": n * b.param, "grads": n * b.grad, "optimizer": optim_dense + optim_experts}


def _layer_activation_elems(cfg, shape, tp: int, sp: bool) -> tuple[float, float]:
    """(elements saved per token by one decoder layer, by its block input alone).

    Counted from what autograd keeps in nxdt's Llama (fp32 CPU run): two RMSNorms (input,
    rsqrt, normalised, weighted: 3h + 1 each), attention (rotated q, repeated k and v, output:
    4·heads·d, + the log-sum-exp), MLP (gate, up, silu, product: 4f). Tensor parallel divides
    the head and MLP parts, sequence parallel also the norm parts.
    """
    h, f, a, d = shape.hidden, shape.ffn, shape.heads, shape.head_dim
    kv = shape.kv_heads
    recompute = set(cfg.model.activations_checkpoint_recompute or [])
    gran = cfg.model.activations_checkpoint_granularity
    h_part = (6 * h + 2) / (tp if sp else 1)
    attn = (4 * a * d + a) / tp
    mlp = 4 * f / tp
    if gran == "selective":
        if not recompute or "CoreAttention" in recompute:
            # only the core's inputs (q, k, v before the repeat) and its output stay
            attn = (2 * a * d + 2 * max(kv, 1) * d) / tp
        if "LlamaMLP" in recompute or cfg.model.activations_checkpoint_recompute_mlp:
            mlp = 0.0
    block_input = h / (tp if sp else 1)
    return h_part + attn + mlp, block_input


def in_flight_microbatches(schedule: str, pp: int, vpp: int, nmb: int) -> float:
    """Micro-batches whose activations one stage-0 rank holds at once (its peak), in units of
    one micro-batch through all of that rank's layers."""
    if pp == 1:
        return 1
    if schedule == "GPipe":
        return nmb
    if vpp == 1:
        return min(nmb, pp)  # 1F1B warm-up on the first stage
    # interleaved: (vpp - 1)·pp + 2·(pp - 1) + 1 chunk forwards before the first backward
    chunks = min(nmb * vpp, (vpp - 1) * pp + 2 * (pp - 1) + 1)
    return chunks / vpp


def plan(spec, vocab_size: int | None = None, parallel: ParallelPlan | None = None) -> dict[str, Any]:
    """Everything `nxdt plan` prints for the run spec `spec` (nxdt.spec.RunSpec), as one JSON-ready
    dict. `vocab_size`: the run's tokenizer size (unpadded) when the caller knows it; None picks it
    as the module docstring says. `parallel`: the run's parallel plan (nxdt.parallel.plan); None:
    made here for the model built on the meta device, as a run makes it for its own model (the same
    plan for the same config)."""
    cfg = spec.cfg
    if vocab_size is not None and cfg.model_source != "hf" and not cfg.model.vocab_size:
        vocab, vocab_source = int(vocab_size), "the run's tokenizer"
    else:
        vocab, vocab_source = planned_vocab(cfg)
    model = build_model(cfg, vocab, device="meta")
    arch = model_shape(model)
    counts = parameter_counts(model)  # the model's own (a LoRA run's base)
    lookup = lookup_parameters(model)
    peft = spec.alignment.peft
    if peft is not None:  # the run's adapters (nxdt.training.finetuning.add_lora), the rest frozen
        inject_lora(model, peft.target_modules, peft.lora_rank, peft.lora_alpha, peft.lora_dropout, peft.lora_bias,
                    peft.target_parameters, peft.modules_to_save)
    if parallel is None:
        parallel = make_plan(model, spec)
    rank = RankShare.of(model, parallel, cfg)
    mem = _rank_memory(cfg, model, parallel, rank)
    act_b = _activation_bytes(cfg, arch, parallel, rank.stages)

    # model FLOPs of one token of the whole model (a LoRA run's base weights are frozen)
    seq = cfg.data.seq_length or cfg.model.encoder_seq_length
    frozen = counts.activated - lookup - _trained_base_parameters(model) if spec.alignment.lora else 0
    flops = flops_per_token(arch, counts, lookup, seq, frozen=frozen)
    ds, fsdp = cfg.distributed_strategy, parallel.sharding.shard
    lay = parallel.layout
    return {
        "config": cfg.name,
        "model_source": cfg.model_source,
        "precision": cfg.precision.type,
        "world_size": spec.layout.world_size,
        "layout": {"dp": lay.dp, "tp": lay.tp, "pp": lay.pp, "cp": lay.cp, "vpp": lay.vpp, "ep": lay.ep,
                   "dp_replicate": lay.dp_replicate, "dp_shard": lay.dp_shard if fsdp else 1},
        "parameters": counts.total,
        "parameters_activated": counts.activated,  # per token; = parameters for a dense model
        "parameter_breakdown": counts.as_dict(),
        "parameters_trainable": lora_parameter_counts(model)[0],  # = parameters unless LoRA freezes the base
        "parameters_per_rank": rank.dense + rank.experts,
        "parameters_per_stage": rank.per_stage,
        "vocab_size": arch.vocab,
        "vocab_source": vocab_source,
        "sharding": "fsdp" if fsdp else ("zero1" if ds.zero1 else "none"),
        "activations_checkpoint": cfg.model.activations_checkpoint_granularity,
        "pipeline_schedule": parallel.schedule,
        "memory_per_rank_bytes": {**mem, "activations": act_b, "total": sum(mem.values()) + act_b},
        "micro_batch_size": lay.micro_batch_size,
        "global_batch_size": lay.global_batch_size,
        "num_microbatches": lay.num_microbatches,
        "seq_length": lay.seq_length,
        "tokens_per_step": lay.tokens_per_step,
        "max_steps": cfg.trainer.max_steps,  # set from trainer.max_tokens by validation when that is given
        "max_tokens": cfg.trainer.max_tokens,
        "total_tokens": total_tokens(cfg.trainer.max_steps, lay.tokens_per_step),
        "flops_per_token": flops.total,
        "flops_per_token_split": {"matmul": flops.matmul, "attention": flops.attention},
        "model_tflop_per_step": flops.total * lay.tokens_per_step / 1e12 if lay.tokens_per_step else None,
    }


@dataclass
class RankShare:
    """What the fullest rank holds: its stages and their elements after tp, ep and FSDP sharding,
    dense and expert apart (ZeRO-1 splits their optimizer state differently, see rank_memory)."""

    stages: tuple[int, ...]
    dense: int
    experts: int
    per_stage: list[int]
    """every stage's parameters (whole, unsharded)"""
    frozen_dense: int = 0
    """of `dense`, the elements that do not train (a LoRA run's base): no gradient, no optimizer state"""
    frozen_experts: int = 0
    """of `experts`, the elements that do not train"""

    @classmethod
    def of(cls, model: nn.Module, parallel: ParallelPlan, cfg) -> RankShare:
        lay = parallel.layout
        fsdp = parallel.sharding.shard
        shard_ways = lay.dp_shard * lay.cp if fsdp else lay.dp_shard  # FSDP shards over dp_shard × cp
        expert_fsdp_ways = lay.dp // lay.ep if fsdp else 1  # edp: the experts' replicas (dp = edp x ep)
        expert_names = expert_parameter_names(model)
        n = parallel.num_stages
        per_stage = [0] * n
        # elements per stage: [dense, experts] and of those the frozen ones (a LoRA run's base)
        held, frozen = [[0, 0] for _ in range(n)], [[0, 0] for _ in range(n)]
        for name, p in model.named_parameters():
            s, expert = parallel.stage_of(name), name in expert_names
            per_stage[s] += p.numel()
            tp_local = parallel.tp_local_numel(name, p.numel())
            here = (_expert_shard_numel(tp_local, lay.ep, expert_fsdp_ways) if expert
                    else math.ceil(tp_local / shard_ways))
            held[s][expert] += here
            if not p.requires_grad:
                frozen[s][expert] += here
        worst = max(parallel.rank_stages, key=lambda stages: sum(sum(held[s]) for s in stages))
        return cls(stages=worst, dense=sum(held[s][0] for s in worst), experts=sum(held[s][1] for s in worst),
                   per_stage=per_stage, frozen_dense=sum(frozen[s][0] for s in worst),
                   frozen_experts=sum(frozen[s][1] for s in worst))


def _rank_memory(cfg, model: nn.Module, parallel: ParallelPlan, rank: RankShare) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state on the fullest rank (`rank_memory`)."""
    optim = cfg.model.optim  # an open section (plain dict); optim_keys requires its name
    optim_name = optim["name"]
    states = OPTIMIZER_STATES.get(optim_name, 2)
    if optim_name in ("sgd", "sm3") and optim.get("momentum"):  # optional key, null/absent = no momentum
        states = 1
    factored = 0
    if optim_name == "sm3":  # refused with tp / ep / FSDP sharding: every parameter is whole here
        factored = sum(sm3_accumulator_elems(p.shape) for name, p in model.named_parameters()
                       if parallel.stage_of(name) in rank.stages and p.requires_grad)
    b = precision_bytes(cfg, optim_name)
    lay = parallel.layout
    # gradients and optimizer state: the trainable elements only
    mem = rank_memory(rank.dense - rank.frozen_dense, rank.experts - rank.frozen_experts, b, states,
                      zero1=bool(cfg.distributed_strategy.zero1) and not parallel.sharding.shard, dp=lay.dp,
                      ep=lay.ep, factored=factored)
    # frozen weights: the weight itself (under fp32 masters the fp32 copy is the weight, kept for it
    # too: nxdt.precision casts every parameter each step), no gradient, not in the optimizer
    mem["params"] += (rank.frozen_dense + rank.frozen_experts) * (b.param + b.master)
    return mem


def _activation_bytes(cfg, arch: ModelShape, parallel: ParallelPlan, stages: tuple[int, ...]) -> int:
    """Activations of one micro-batch on the fullest rank, times the micro-batches in flight."""
    lay, starts = parallel.layout, parallel.stage_starts
    b = precision_bytes(cfg, cfg.model.optim["name"])
    seq = cfg.data.seq_length or cfg.model.encoder_seq_length
    tokens = lay.micro_batch_size * seq / lay.cp
    per_layer, block_input = _layer_activation_elems(cfg, arch, lay.tp, parallel.sequence_parallel)
    layers_here = sum(starts[s + 1] - starts[s] for s in stages)
    if cfg.model.activations_checkpoint_granularity == "full":
        # only block inputs kept, plus one layer's activations during its recompute;
        # checkpoint_num_layers N: one input per chunk of N, but N layers' activations in the recompute
        chunk = min(cfg.model.checkpoint_num_layers, max(layers_here, 1))  # validation: >= 1
        layer_elems = math.ceil(layers_here / chunk) * block_input + chunk * per_layer
    else:
        layer_elems = layers_here * per_layer
    act_elems = tokens * layer_elems + tokens * 2 * arch.head_dim  # + rotary cos/sin
    act_b = act_elems * b.activation
    if parallel.num_stages - 1 in stages:  # final norm (3h + 1) and fp32 log-softmax over the vocabulary shard
        act_b += tokens * ((3 * arch.hidden + 1) * b.activation + math.ceil(arch.vocab / lay.tp) * 4)
    return int(act_b * in_flight_microbatches(parallel.schedule or "1F1B", lay.pp, lay.vpp, lay.num_microbatches))


def total_tokens(max_steps: int, tokens_per_step: int | None) -> int | None:
    """The tokens a run trains: max_steps x tokens per step (at least trainer.max_tokens, which
    validation rounds up to whole steps)."""
    return max_steps * tokens_per_step if tokens_per_step else None


def token_count(n: int) -> str:
    """4,194,304 -> '4.19M', 10**11 -> '100B': a token count as budgets are written."""
    for suffix, scale in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("k", 10**3)):
        if n >= scale * 0.9995:  # 999,999 -> '1M', not '1e+03k'
            return f"{n / scale:.3g}{suffix}"
    return str(n)


def batch_lines(global_batch: int, micro: int, microbatches: int, seq: int | None, max_steps: int,
                max_tokens: int | None) -> list[str]:
    """The batch, tokens per step and steps lines of `nxdt plan` and the start summary, with the
    figures LLaMA-MoE's logs open with (global batch size, #tokens/batch, max_steps) and the tokens
    the run will train. `max_tokens`: the budget max_steps was set from (None: max_steps as given)."""
    per_step = global_batch * seq if seq else None
    lines = [f"  batch        global batch size: {global_batch}  micro={micro}  microbatches/step={microbatches}"
             f"  seq={seq}"]
    if per_step:
        lines.append(f"  tokens/step  {per_step:,}  (#tokens/batch: {global_batch} x {seq})")
    steps = f"  steps        max_steps: {max_steps}"
    if max_tokens is not None:
        steps += f" (from trainer.max_tokens={max_tokens})"
    if per_step:
        total = total_tokens(max_steps, per_step)
        short = f" ({token_count(total)})" if total >= 1000 else ""
        steps += f"  x {per_step:,} tokens/step = {total:,} tokens{short}"
    return [*lines, steps]


def si(value: float, unit: str) -> str:
    """1.23e12 -> '1.23 T' + unit: three significant figures with an SI prefix."""
    for prefix, scale in (("E", 1e18), ("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


def stage_lines(p: dict[str, Any]) -> list[str]:
    """With pipeline parallelism: the schedule and each stage's parameters (the plan's stage split)."""
    if p["layout"]["pp"] == 1:
        return []
    return [f"  stages       {p['pipeline_schedule']}: " + ", ".join(f"{n:,}" for n in p["parameters_per_stage"])]


def memory_line(mem: dict[str, int], suffix: str = "") -> str:
    """Memory per rank by kind, in GiB (the plan's and the start summary's line)."""
    return "  memory/rank  " + "  ".join(f"{k}={v / 1024**3:.2f}GiB" for k, v in mem.items()) + suffix


def flops_line(p: dict[str, Any]) -> str:
    """The model FLOPs per token and per step (the numerator of the run's tflops / mfu)."""
    split = p["flops_per_token_split"]
    line = (f"  flops        {si(p['flops_per_token'], 'FLOP')}/token (matmul {si(split['matmul'], 'FLOP')}"
            f" + attention {si(split['attention'], 'FLOP')})")
    if p["model_tflop_per_step"] is not None:
        line += f"  {si(p['model_tflop_per_step'] * 1e12, 'FLOP')}/step"
    return line


def peak_lines(p: dict[str, Any], peak, world_size: int) -> list[str]:
    """The device's peak and the step time it allows: the model FLOPs of a step on one device (the
    step's FLOPs / world size) at that peak, the bound at 100% MFU (a run takes longer)."""
    if peak is None:
        return []
    rate = f"{peak.tflops:,.4g} TFLOP/s" if peak.tflops >= 1 else f"{peak.tflops * 1e3:,.4g} GFLOP/s"
    lines = [f"  peak         {rate} per device ({peak.source})"]
    if p.get("model_tflop_per_step"):
        seconds = p["model_tflop_per_step"] / max(world_size, 1) / peak.tflops
        lines.append(f"  step time    >= {_duration(seconds)} at that peak (model FLOPs / peak: the bound at 100% MFU)")
    return lines


def _duration(seconds: float) -> str:
    if seconds < 1:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds:.3g} s" if seconds < 120 else f"{seconds / 60:.3g} min"
