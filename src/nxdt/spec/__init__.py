"""The run spec: what a validated config means, resolved once, torch-free.

nxdt.config checks a config's keys, types and ranges; this package holds what the values mean
together: the layout and batch arithmetic (layout.py), sharding, pipeline split and context
parallel (parallel.py), precision (precision.py), the alignment method (alignment.py), the model's
architecture and fusions (model.py), MoE (moe.py), data (data.py), exp_manager's samples and
signals (exp.py), and the paths a config names (paths.py). Each piece's cross-checks live beside
it; `validate` runs them all after the schema's checks.

The entry (a training run, `nxdt evaluate`, the tools, the benchmarks) builds the `RunSpec` once,
`build_spec(cfg)`, and passes it down: nothing below re-derives a piece from the raw config.

    load_config(argv, world_size=None, ...) -> NxdtConfig   compose + schema + cross-checks + paths
    validate(cfg, world_size=None, ...) -> NxdtConfig       the same for a composed config
    config_from_dict(values, check=False, ...)              a (partial) mapping; cross-checked with check
    build_spec(cfg, world_size=None) -> RunSpec             the pieces of a (validated) typed config
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig

from nxdt.config import schema
from nxdt.config import validate as schema_checks
from nxdt.config.inert import inert_notice
from nxdt.config.load import compose, report
from nxdt.config.load import config_from_dict as schema_config_from_dict
from nxdt.spec import alignment, data, exp, model, moe, parallel
from nxdt.spec.alignment import Alignment, alignment_notices, alignment_of
from nxdt.spec.layout import Layout, compute_layout
from nxdt.spec.model import ModelArch, check_hf_layouts, model_arch, wants_compile
from nxdt.spec.moe import MoESpec, check_moe_layouts_supported, moe_of
from nxdt.spec.parallel import ShardingMode, sharding_mode_of
from nxdt.spec.paths import check_files
from nxdt.spec.precision import PrecisionSettings, precision_settings


@dataclass(frozen=True)
class RunSpec:
    """What a validated config means for a run, every alias resolved, built once by `build_spec`."""

    cfg: schema.NxdtConfig = field(repr=False)
    """The typed config, for the plain keys (those read as they are)."""
    layout: Layout
    """Parallel sizes and the batch arithmetic (nxdt.spec.layout)."""
    sharding: ShardingMode
    """What the data-parallel sharding strategy builds (nxdt.spec.parallel)."""
    precision: PrecisionSettings
    """The precision preset reduced to mode, compute dtype, rounding (nxdt.spec.precision)."""
    alignment: Alignment
    """SFT / LoRA / DPO / ORPO, from both places NxDT spells them (nxdt.spec.alignment)."""
    compile: bool
    """The blocks (and the loss) compile: model.fusions.torch_compile or model.use_torch_compile."""
    loss_chunk_size: int | None
    """model.fusions.cross_entropy_chunk_size: the output layer + loss in chunks of this many tokens."""
    data_kind: str | None
    """Which data module the run gets (nxdt.spec.data.datamodule_kind); None: no data source."""
    moe: MoESpec
    """Experts, top-k and the canonical gate type (nxdt.spec.moe)."""
    model: ModelArch
    """The effective architecture numbers and the transformers config.json (nxdt.spec.model)."""


def build_spec(cfg: schema.NxdtConfig, world_size: int | None = None, layout: Layout | None = None) -> RunSpec:
    """The run spec of a typed config (`validate`d: the cross-checks are validation's); `world_size`
    defaults to trainer.devices x trainer.num_nodes. `layout`: a caller that brings its own mesh
    (a test driving parallelize_llama on a tp-only mesh) gives its layout instead. ConfigError only
    where a piece cannot be derived (a layout that does not divide, a precision combination that
    means nothing)."""
    al = alignment_of(cfg)
    return RunSpec(
        cfg=cfg,
        layout=layout if layout is not None else compute_layout(cfg, world_size),
        sharding=sharding_mode_of(cfg.distributed_strategy),
        precision=precision_settings(cfg.precision),
        alignment=al,
        compile=wants_compile(cfg),
        loss_chunk_size=cfg.model.fusions.cross_entropy_chunk_size,
        data_kind=data.data_kind_of(cfg, al),
        moe=moe_of(cfg),
        model=model_arch(cfg),
    )


def validate(cfg: DictConfig | schema.NxdtConfig, world_size: int | None = None, check_paths: bool = True,
             check_supported: bool = True, notices: list[str] | None = None) -> schema.NxdtConfig:
    """Validate a composed config; raise ConfigError on the first problem; return it typed.

    Stages, in order: the schema's (nxdt.config.validate: unknown keys, types, ranges, values not
    supported yet), the cross-checks of each spec piece (`check_spec`), the paths the config names
    (`check_paths`). `notices`: one-line notices for the caller to print once (sequence_parallel
    turned off, the alignment's, the settings that have no effect in this run)."""
    typed = schema_checks.validate(cfg, check_supported=False, notices=notices)
    if check_supported:
        check_not_supported(typed)
    spec = check_spec(typed, world_size)
    if notices is not None:
        notices.extend(alignment_notices(spec.alignment))
        inert = inert_notice(typed)
        if inert:
            notices.append(inert)
    if check_paths:
        check_files(typed)
    return typed


def check_not_supported(cfg: Any) -> None:
    """Values nxdt accepts but does not build yet: the schema's table (nxdt.config.inert), then the
    MoE and transformers layouts (nxdt.spec.moe, nxdt.spec.model). `'<key>' is not supported yet`."""
    schema_checks.check_not_supported(cfg)
    check_moe_layouts_supported(cfg)
    check_hf_layouts(cfg)


def load_config(argv: list[str], world_size: int | None = None, check_paths: bool = True,
                check_supported: bool = True, default_config_dir: str | os.PathLike | None = None,
                default_config_name: str | None = None, quiet: bool = False,
                record: dict | None = None) -> schema.NxdtConfig:
    """compose + full validate -> the typed config; prints the notices once (rank 0) unless quiet.
    `record`: see nxdt.config.load.compose."""
    notices: list[str] = []
    cfg = compose(argv, default_config_dir, default_config_name, notices=notices, record=record)
    typed = validate(cfg, world_size=world_size, check_paths=check_paths, check_supported=check_supported,
                     notices=notices)
    if not quiet:
        for n in dict.fromkeys(notices):
            report(n)
    return typed


def config_from_dict(values: dict, world_size: int | None = None, check: bool = False,
                     check_paths: bool = False) -> schema.NxdtConfig:
    """A typed config from a (partial) mapping, as from a YAML without Hydra: merged over the
    schema defaults, resolved and schema-checked; with `check` also cross-checked (`validate`).
    For tools reading a saved config.yaml and for tests building small configs."""
    typed = schema_config_from_dict(values)
    if check:
        return validate(typed, world_size=world_size, check_paths=check_paths)
    return typed


def check_spec(cfg: schema.NxdtConfig, world_size: int | None = None) -> RunSpec:
    """Build the run spec of a schema-checked config and run each piece's cross-checks (they live
    beside the piece they constrain), in this order; the first problem is a ConfigError."""
    parallel.check_accelerator_installed(cfg)
    parallel.check_accumulation(cfg)
    exp.check_evaluate_only(cfg)
    parallel.check_world_size(cfg, world_size)
    spec = build_spec(cfg, world_size)
    layout, arch = spec.layout, spec.model
    parallel.check_xla_devices(cfg, layout)  # before the pp / cp checks: they are not built on XLA at all
    model.check_source(cfg)
    parallel.check_data_parallel(cfg, layout, spec.sharding, spec.precision)
    parallel.check_pipeline(cfg, layout, arch.num_layers)
    model.check_loss_chunking(cfg, layout, spec.alignment)
    model.check_compile(cfg, layout)
    parallel.check_context_parallel(cfg, layout, spec.compile)
    model.check_dimensions(cfg, arch, layout)
    model.check_recompute_classes(cfg, arch)
    parallel.check_hsdp(cfg, layout)
    model.check_checkpoint_layers(cfg)
    moe.check_moe(cfg, spec.moe, arch.hf_json)
    moe.check_expert_parallel(cfg)
    model.check_architecture(cfg, arch.head_dim)
    alignment.check_alignment(cfg, spec.alignment)
    exp.check_exp(cfg)
    data.check_data(cfg, spec.alignment, spec.data_kind)
    return spec
