"""The parallel layout's rules beyond the batch arithmetic (nxdt.spec.layout): the world size and
gradient accumulation the layout derives, sharding strategies (every accepted spelling -> what
nxdt builds) and the options only sharding builds, HSDP's replicas, devices under XLA, the
pipeline's stage split and schedule, and context parallel. Torch-free."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

from nxdt.config.env import neuron_missing
from nxdt.config.errors import ConfigError
from nxdt.config.inert import backend_of
from nxdt.config.optim_keys import check_optim_parallel
from nxdt.config.schema import SHARDING_SPELLINGS, sharding_way
from nxdt.spec.layout import Layout
from nxdt.spec.precision import PrecisionSettings


# --------------------------------------------------------------------------- world and batches
def check_accumulation(cfg: Any) -> None:
    """trainer.accumulate_grad_batches stays 1: the layout derives the micro-batches of a step."""
    tr = cfg.trainer
    if tr.accumulate_grad_batches != 1:
        raise ConfigError(
            f"trainer.accumulate_grad_batches: {tr.accumulate_grad_batches} is not allowed: gradient accumulation "
            f"is derived from data.global_batch_size / (data.micro_batch_size x data-parallel size); set those instead")


def check_world_size(cfg: Any, world_size: int | None) -> None:
    """trainer.devices x trainer.num_nodes is the world the job was launched with (when known)."""
    tr = cfg.trainer
    if world_size is not None and tr.devices * tr.num_nodes != world_size:
        raise ConfigError(
            f"trainer.devices ({tr.devices}) x trainer.num_nodes ({tr.num_nodes}) = {tr.devices * tr.num_nodes} "
            f"does not match the world size {world_size}")


# --------------------------------------------------------------------------- sharding
@dataclass(frozen=True)
class ShardingMode:
    """What a sharding strategy builds."""

    shard: bool
    """True: FSDP2 fully_shard over dp_shard; False: replicate (DDP semantics) over dp."""
    reshard_after_forward: bool = True
    """False for grad-shard: parameters stay gathered between forward and backward."""
    hybrid: bool = False
    """HSDP: dp = dp_replicate (across nodes) x dp_shard (within a node)."""

    @property
    def name(self) -> str:
        """Short name for messages: replicate | shard | grad-shard | hybrid | hybrid-grad-shard."""
        if not self.shard:
            return "replicate"
        base = "hybrid" if self.hybrid else "shard"
        return base if self.reshard_after_forward else ("hybrid-grad-shard" if self.hybrid else "grad-shard")


REPLICATE = ShardingMode(shard=False)
FULL_SHARD = ShardingMode(shard=True)
GRAD_SHARD = ShardingMode(shard=True, reshard_after_forward=False)
HYBRID = ShardingMode(shard=True, hybrid=True)
HYBRID_GRAD_SHARD = ShardingMode(shard=True, reshard_after_forward=False, hybrid=True)

# what each way of `nxdt.config.schema.SHARDING_SPELLINGS` (every accepted spelling) builds
WAYS = {"replicate": REPLICATE, "shard": FULL_SHARD, "grad-shard": GRAD_SHARD, "hybrid": HYBRID,
        "hybrid-grad-shard": HYBRID_GRAD_SHARD}
SHARDING_MODES: dict[str, ShardingMode] = {name: WAYS[way] for name, way in SHARDING_SPELLINGS.items()}


def sharding_mode(name: str | None) -> ShardingMode:
    """The mode of a `sharding_strategy` spelling (case-insensitive; None = no-shard)."""
    return WAYS[sharding_way(name)]


def sharding_mode_of(ds: Any) -> ShardingMode:
    """The mode of a `distributed_strategy` section: `sharding_strategy`, else FSDP when fms-fsdp's
    `fsdp: true` is set, else replicate."""
    return WAYS[sharding_way(ds.sharding_strategy, ds.fsdp)]


def check_data_parallel(cfg: Any, layout: Layout, sharding: ShardingMode, precision: PrecisionSettings) -> None:
    """Options that only a sharding data-parallel mode (FSDP2) builds; the optimizer's state
    layout over tp / ep / the sharded ranks (nxdt.config.optim_keys)."""
    ds = cfg.distributed_strategy
    if ds.cpu_offload and not sharding.shard:
        raise ConfigError("distributed_strategy.cpu_offload=true needs a sharding data-parallel mode (FSDP2 "
                          "offloads its shards): set distributed_strategy.fsdp=true or sharding_strategy FSDP, "
                          "HSDP or grad-shard")
    if precision.reduce_dtype == "bf16" and not sharding.shard:
        raise ConfigError("precision.grad_reduce_dtype=bf16 needs a sharding data-parallel mode (FSDP2 reduces "
                          "in its reduce_dtype): set distributed_strategy.fsdp=true or sharding_strategy FSDP / "
                          "HSDP, or keep fp32")
    p = cfg.precision
    if p.fp32_grads_cc and p.type == "manual" and not sharding.shard and precision.mode == "lowp":
        # bf16 parameters without master weights: DDP (FSDP2's replicate) reduces the bf16 gradients;
        # FSDP reduces in fp32 (its reduce_dtype), and master weights give fp32 gradients
        raise ConfigError("precision.fp32_grads_cc=true with bf16 parameters (precision.type manual, no "
                          "master_weights) and DDP is not supported yet: use distributed_strategy.fsdp=true "
                          "(gradients reduced in fp32) or precision.master_weights=true")
    check_optim_parallel(cfg.model.optim, tp=layout.tp, ep=layout.ep,
                         fsdp_ways=layout.dp * layout.cp if sharding.shard else 1)


def check_hsdp(cfg: Any, layout: Layout) -> None:
    """distributed_strategy.hsdp_replicate_size divides the data-parallel size."""
    rep = cfg.distributed_strategy.hsdp_replicate_size
    if rep is not None and (rep < 1 or layout.dp % rep):
        raise ConfigError(f"distributed_strategy.hsdp_replicate_size ({rep}) does not divide the data-parallel "
                          f"size {layout.dp}")


def check_accelerator_installed(cfg: Any) -> None:
    """trainer.accelerator neuron with neither TorchNeuron nor torch-xla installed: one line, first."""
    missing = neuron_missing(cfg.trainer.accelerator)
    if missing:
        raise ConfigError(missing)


def check_xla_devices(cfg: Any, layout: Layout) -> None:
    """Several XLA devices run as one SPMD process per host (nxdt.parallel.xla_spmd): dp, FSDP, ZeRO-1,
    tp (+ sp) and ep have a sharding form; pipeline and context parallel, several hosts (torch-xla's
    multi-host SPMD: one process per host under torchrun) do not yet."""
    tr = cfg.trainer
    if tr.devices * tr.num_nodes == 1 or backend_of(cfg) != "xla":
        return
    on = tr.accelerator if tr.accelerator in ("xla", "neuron", "tpu") else "auto (torch-xla, PJRT_DEVICE)"
    unbuilt = [f"{key} = {size}" for key, size in (
        ("distributed_strategy.pipeline_model_parallel_size", layout.pp),
        ("distributed_strategy.context_parallel_size", layout.cp), ("trainer.num_nodes", tr.num_nodes)) if size > 1]
    launched = int(os.environ.get("WORLD_SIZE", "1") or 1)  # torchrun: one process per host is multi-host SPMD
    if launched > 1:
        unbuilt.append(f"torchrun's WORLD_SIZE = {launched} (one process drives all the host's devices: start it "
                       "without torchrun)")
    if unbuilt:
        raise ConfigError(f"trainer.accelerator {on} with {tr.devices * tr.num_nodes} devices: {unbuilt[0]} is "
                          "not supported yet on XLA (SPMD builds data, fully sharded, ZeRO-1, tensor, sequence "
                          "and expert parallel on the devices of one host)")


# --------------------------------------------------------------------------- pipeline checks
SINGLE_STAGE_SCHEDULES = ("GPipe", "1F1B")
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")
_CUT = re.compile(r"model\.layers\.(\d+)")


def default_pipeline_schedule(vpp: int) -> str:
    return "1F1B" if vpp == 1 else "Interleaved1F1B"


def pipeline_stage_starts(num_layers: int, num_stages: int, cuts: list[str] | None = None) -> list[int]:
    """First decoder layer of each stage, plus `num_layers` at the end (num_stages + 1 numbers).

    Without cuts the layers split as NxD's `create_partitions` splits them: evenly, and when they do
    not divide, one more on each of the last (num_layers % num_stages) stages (126 layers over 8:
    15 x 2, then 16 x 6). A cut names the last layer of a stage, as in NxD (`model.layers.15` with
    32 layers and 2 stages: layers 0-15 | 16-31); cuts override the split.
    """
    key = "model.pipeline_cuts"
    if cuts:
        if len(cuts) != num_stages - 1:
            raise ConfigError(
                f"{key} has {len(cuts)} entries; {num_stages} pipeline stages (pipeline_model_parallel_size x "
                f"virtual_pipeline_model_parallel_size) need {num_stages - 1}")
        starts = [0]
        for cut in cuts:
            m = _CUT.fullmatch(str(cut).strip())
            last = int(m.group(1)) if m else -1
            if not 0 <= last < num_layers - 1:
                raise ConfigError(f"{key}: no module '{cut}' to cut after; valid cuts are model.layers.0 ... "
                                  f"model.layers.{num_layers - 2} (the model has {num_layers} layers)")
            if last + 1 <= starts[-1]:
                raise ConfigError(f"{key}: cuts must name increasing layers, got {list(cuts)}")
            starts.append(last + 1)
        return starts + [num_layers]
    if num_layers < num_stages:
        raise ConfigError(
            f"model.num_layers ({num_layers}) is fewer than the {num_stages} pipeline stages "
            f"(pipeline_model_parallel_size x virtual_pipeline_model_parallel_size): each needs a layer")
    # NxD's create_partitions: num_layers // num_stages each, the remainder one more on the last stages
    per, extra = divmod(num_layers, num_stages)
    sizes = [per + (s >= num_stages - extra) for s in range(num_stages)]
    return [sum(sizes[:s]) for s in range(num_stages + 1)]


def check_pipeline(cfg: Any, layout: Any, num_layers: int | None) -> None:
    """Stage split, schedule and microbatch requirements of torch.distributed.pipelining."""
    ds = "distributed_strategy"
    pp, vpp, nmb = layout.pp, layout.vpp, layout.num_microbatches
    if vpp > 1 and pp == 1:
        raise ConfigError(f"{ds}.virtual_pipeline_model_parallel_size > 1 needs pipeline_model_parallel_size > 1")
    cuts = cfg.model.pipeline_cuts
    if pp == 1 and not cuts:
        return
    if pp > 1 and cfg.model.share_embeddings_and_output_weights:
        raise ConfigError("model.share_embeddings_and_output_weights with pipeline_model_parallel_size > 1 is not "
                          "supported (the embedding and the output layer live on different stages)")
    if num_layers is not None:
        pipeline_stage_starts(int(num_layers), pp * vpp, list(cuts) if cuts else None)
    if pp == 1:
        return
    name = cfg.distributed_strategy.schedule or default_pipeline_schedule(vpp)
    where = f"{ds}.schedule {name}"
    if name in SINGLE_STAGE_SCHEDULES and vpp != 1:
        raise ConfigError(f"{where} runs one stage per rank: it needs virtual_pipeline_model_parallel_size 1, "
                          f"got {vpp} (use Interleaved1F1B, LoopedBFS or InterleavedZeroBubble)")
    if name in V_SCHEDULES and vpp != 2:
        raise ConfigError(f"{where} needs virtual_pipeline_model_parallel_size 2, got {vpp}")
    need = {"1F1B": pp, "DualPipeV": pp * vpp}.get(name)
    if need is not None and nmb < need:
        raise ConfigError(f"{where} needs at least {need} microbatches per step, got {nmb} (= global_batch_size / "
                          f"(micro_batch_size x data-parallel size)); raise data.global_batch_size")
    if name in ("Interleaved1F1B", "InterleavedZeroBubble"):
        rounds = max(1, nmb // pp)
        if nmb % rounds:
            raise ConfigError(f"{where} needs the number of microbatches ({nmb}) to be a multiple of "
                              f"max(1, microbatches // pipeline_model_parallel_size) = {rounds}")


# --------------------------------------------------------------------------- cp checks
def check_context_parallel(cfg: Any, layout: Layout, compile: bool) -> None:
    """Context parallel (ring attention over cp ranks): the sequence split and what it cannot take yet.
    `compile`: the blocks compile (nxdt.spec.model.wants_compile)."""
    cp = layout.cp
    key = "distributed_strategy.context_parallel_size"
    data, model, ds = cfg.data, cfg.model, cfg.distributed_strategy
    if model.fusions.ring_attention and cp == 1:
        raise ConfigError("model.fusions.ring_attention: true needs distributed_strategy.context_parallel_size > 1 "
                          "(ring attention is how nxdt runs context parallelism)")
    if cp == 1:
        return
    seq = data.seq_length
    if seq is not None and seq % (2 * cp):
        raise ConfigError(f"data.seq_length ({seq}) must be divisible by 2 x {key} ({2 * cp}): each cp rank "
                          "holds two chunks of every sequence (head-tail load balancing)")
    refused = {
        # both restart positions at each document, which the model turns into document masks
        "data.reset_position_ids / reset_attention_mask (document masks)":
            data.reset_position_ids or data.reset_attention_mask,
        "SFT packing (document masks)": data.packing
        or bool(cfg.model_alignment_strategy is not None and cfg.model_alignment_strategy.sft is not None
                and cfg.model_alignment_strategy.sft.packing),
        "model.attention_dropout > 0": model.attention_dropout > 0,
        "model.sliding_window_size": model.sliding_window_size is not None,
        "model.fusions.torch_compile": compile,
        "HSDP (sharding_strategy hybrid)": sharding_mode(ds.sharding_strategy).hybrid
        or (ds.hsdp_replicate_size or 1) > 1,
        f"trainer.accelerator {cfg.trainer.accelerator}": cfg.trainer.accelerator
        in ("xla", "neuron", "tpu", "gpu", "cuda", "mps"),  # ring kernels are wired for CPU only
    }
    for what, bad in refused.items():
        if bad:
            raise ConfigError(f"{key} > 1 with {what} is not supported yet (got {key}={cp})")
