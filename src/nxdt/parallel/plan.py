"""The parallel plan as data: what each rank holds and what is done to each module, for a built model.

`make_plan(model, layout, cfg)` is the one place that decides, for the whole model (a real one, or
one built on the meta device: the planner's), per pipeline stage:

    tensor_parallel  {module path: ParallelStyle}     nxdt.parallel.tensor_parallel.llama_tp_plan
    checkpoint       module paths recomputed in the backward, one group per checkpoint (a module,
                     or a chunk of consecutive blocks)   nxdt.parallel.activation_checkpointing
    compile          module paths torch.compile'd       (blocks; their attention and MLP under tp)
    data_parallel    the FSDP2 / replicate units besides the root (the decoder blocks)

and for the pipeline: the stage split (`stage_starts`), the schedule and the stages of every pp rank
(`rank_stages`: loop order r, r + pp, ...; V schedules r, 2pp - 1 - r). `parallelize_llama` and
`build_pipeline` apply it; the planner (nxdt.planner.estimate: `nxdt plan`, the run's start summary)
reads the same object for the stage split and each parameter's tensor-parallel shard.

Module paths are the whole model's: a pipeline stage keeps its layers under their original names
(nxdt.parallel.pipeline.StageLayers), so one plan serves every stage. What the model is (native or
transformers) is asked of its adapter (nxdt.models.adapter), never here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn
from torch.distributed.tensor.parallel.style import ParallelStyle

from nxdt.models.adapter import adapter_of
from nxdt.parallel.activation_checkpointing import checkpoint_plan
from nxdt.parallel.data_parallel import DataParallelConfig, data_parallel_config
from nxdt.parallel.tensor_parallel import llama_tp_plan, lora_local_numel, tp_local_numel
from nxdt.spec.layout import Layout
from nxdt.spec.parallel import V_SCHEDULES, ShardingMode, default_pipeline_schedule, pipeline_stage_starts

# Under tensor parallelism a block's attention and MLP are compiled, each whole, and its norms and
# residual adds stay eager: with torch 2.13 a whole compiled block loses the gradient of a tp-
# replicated norm weight under sequence parallel, and without it the backward fails in DTensor's
# redistribution of the block's input. Attention and MLP compiled alone give eager's gradients
# (every parameter within 1e-5, with and without sequence parallel).
TP_COMPILED_PARTS = ("self_attn", "mlp")


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage (the whole model without pipeline parallelism)."""

    index: int
    layers: tuple[int, ...]
    """the decoder layers it holds (the whole model's indices)"""
    first: bool
    last: bool
    tensor_parallel: dict[str, ParallelStyle] = field(default_factory=dict)
    checkpoint: tuple[tuple[str, ...], ...] = ()
    compile: tuple[str, ...] = ()
    data_parallel: tuple[str, ...] = ()


@dataclass(frozen=True)
class ParallelPlan:
    layout: Layout
    sharding: ShardingMode
    sequence_parallel: bool
    schedule: str | None
    """the pipeline schedule's name (None without pipeline parallelism)"""
    stage_starts: tuple[int, ...]
    """first decoder layer of each stage, + the number of layers"""
    rank_stages: tuple[tuple[int, ...], ...]
    """the stages each pp rank holds"""
    stages: tuple[StagePlan, ...]
    layers_path: str
    last_stage_paths: tuple[str, ...]
    """modules outside the decoder layers that live on the last stage (final norm, output layer)"""
    data_parallel: DataParallelConfig
    """how the data-parallel units are wrapped: replicate / FSDP2 (reshard, mixed precision, offload, SR)"""

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def v_style(self) -> bool:
        return self.schedule in V_SCHEDULES

    def stage_of(self, name: str) -> int:
        """The stage holding a parameter or module of the whole model (by its path)."""
        prefix = self.layers_path + "."
        if name.startswith(prefix):
            layer = int(name[len(prefix):].split(".", 1)[0])
            return next(s for s in range(self.num_stages) if self.stage_starts[s] <= layer < self.stage_starts[s + 1])
        last = any(name == p or name.startswith(p + ".") for p in self.last_stage_paths)
        return self.num_stages - 1 if last else 0

    def stage_for(self, part: nn.Module) -> StagePlan:
        """The stage whose layers `part` (a pruned stage, or the whole model) holds."""
        if self.num_stages == 1:
            return self.stages[0]
        held = {int(name) for name, _ in adapter_of(part).decoder(part).layers.named_children()}
        return next(stage for stage in self.stages if set(stage.layers) == held)

    def tp_local_numel(self, name: str, numel: int) -> int:
        """Elements of the parameter `name` one tensor-parallel rank holds (its module's style)."""
        if self.layout.tp == 1:
            return numel
        module, _, param = name.rpartition(".")
        styles = self.stages[self.stage_of(name)].tensor_parallel
        linear, _, leaf = module.rpartition(".")
        if leaf in ("lora_A", "lora_B"):  # a LoRA adapter: placed after its linear's style
            return lora_local_numel(styles.get(linear), leaf, numel, self.layout.tp, param)
        return tp_local_numel(styles.get(module), param, numel, self.layout.tp)


def stage_ids_of_rank(pp_rank: int, pp: int, vpp: int, v_style: bool = False) -> tuple[int, ...]:
    """Stages held by one pp rank: loop style r, r + pp, ...; V style (ZBV, DualPipeV) r, 2pp - 1 - r."""
    if v_style:
        return (pp_rank, 2 * pp - 1 - pp_rank)
    return tuple(pp_rank + k * pp for k in range(vpp))


def make_plan(model: nn.Module, spec: Any, pipeline: bool = True) -> ParallelPlan:
    """The plan for `model` (the whole model; a meta-device one will do) under the run spec `spec`
    (nxdt.spec.RunSpec: its layout, sharding, precision and compile settings, and the plain keys).

    `pipeline=False`: `model` as one stage whatever layout.pp says (a stage part parallelized on its
    own: it holds the embedding / final norm when it has them)."""
    adapter = adapter_of(model)
    cfg, layout = spec.cfg, spec.layout
    ds = cfg.distributed_strategy
    layers_path = adapter.layers_path(model)
    named = list(adapter.decoder(model).layers.named_children())
    index = {int(name): block for name, block in named}
    num_stages = layout.pp * layout.vpp if pipeline else 1
    schedule = (ds.schedule or default_pipeline_schedule(layout.vpp)) if pipeline and layout.pp > 1 else None
    if num_stages > 1:
        cuts = cfg.model.pipeline_cuts
        starts = pipeline_stage_starts(len(named), num_stages, list(cuts) if cuts else None)
        ranges = [range(starts[s], starts[s + 1]) for s in range(num_stages)]
    else:
        ranges = [sorted(index)]
        starts = [0, len(named)]
    tp, sp = layout.tp, bool(ds.sequence_parallel) and layout.tp > 1
    stages = []
    for s, layers in enumerate(ranges):
        blocks = [(f"{layers_path}.{i}", index[i]) for i in layers]
        first, last = s == 0, s == num_stages - 1
        styles = llama_tp_plan(model, tp, sp, blocks, first, last) if tp > 1 else {}
        compiled: list[str] = []
        if spec.compile:
            for path, block in blocks:
                compiled += ([f"{path}.{n}" for n in TP_COMPILED_PARTS if getattr(block, n, None) is not None]
                             if tp > 1 else [path])
        stages.append(StagePlan(
            index=s, layers=tuple(layers), first=first, last=last, tensor_parallel=styles,
            checkpoint=checkpoint_plan(blocks, cfg.model, adapter.recompute_aliases),
            compile=tuple(compiled), data_parallel=tuple(path for path, _ in blocks)))
    return ParallelPlan(
        layout=layout, sharding=spec.sharding, sequence_parallel=sp, schedule=schedule,
        data_parallel=data_parallel_config(spec.sharding, spec.precision, ds.cpu_offload),
        stage_starts=tuple(starts),
        rank_stages=tuple(stage_ids_of_rank(r, layout.pp, layout.vpp, schedule in V_SCHEDULES)
                          for r in range(layout.pp)) if num_stages > 1 else ((0,),),
        stages=tuple(stages), layers_path=layers_path, last_stage_paths=(adapter.norm, adapter.lm_head))
