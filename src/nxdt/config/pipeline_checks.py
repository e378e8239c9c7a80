"""Torch-free checks of the pipeline layout: stage split (even or at model.pipeline_cuts) and schedule.

Shared by the validator, `nxdt.parallel.pipeline` (which splits the model the same way) and `nxdt plan`.
"""

from __future__ import annotations

import re
from typing import Any

from nxdt.config.errors import ConfigError

SINGLE_STAGE_SCHEDULES = ("GPipe", "1F1B")
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")
_CUT = re.compile(r"model\.layers\.(\d+)")


def default_pipeline_schedule(vpp: int) -> str:
    return "1F1B" if vpp == 1 else "Interleaved1F1B"


def pipeline_stage_starts(num_layers: int, num_stages: int, cuts: list[str] | None = None) -> list[int]:
    """First decoder layer of each stage, plus `num_layers` at the end (num_stages + 1 numbers).

    Without cuts the layers split evenly. A cut names the last layer of a stage, as in NxD
    (`model.layers.15` with 32 layers and 2 stages: layers 0-15 | 16-31).
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
    if num_layers % num_stages:
        raise ConfigError(
            f"model.num_layers ({num_layers}) is not divisible by {num_stages} pipeline stages "
            f"(pipeline_model_parallel_size x virtual_pipeline_model_parallel_size); "
            f"change the sizes or set model.pipeline_cuts")
    per = num_layers // num_stages
    return [i * per for i in range(num_stages + 1)]


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


# --------------------------------------------------------------------------- paths
