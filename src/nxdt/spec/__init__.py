"""The run spec: what a validated config means, resolved once, torch-free.

nxdt.config checks a config's keys, types and ranges; this package holds what the values mean
together: the layout and batch arithmetic (layout.py), sharding, pipeline split and context
parallel (parallel.py), precision (precision.py), the alignment method (alignment.py), the model's
architecture and fusions (model.py), MoE (moe.py), data (data.py), optimizer keys' layouts,
exp_manager's samples and signals (exp.py), and the paths a config names (paths.py). Each piece's
cross-checks live beside it; `validate` runs them all after the schema's checks.

    load_config(argv, world_size=None, ...) -> NxdtConfig   compose + schema + cross-checks + paths
    validate(cfg, world_size=None, ...) -> NxdtConfig       the same for a composed config
    config_from_dict(values, check=False, ...)              a (partial) mapping; cross-checked with check
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

from omegaconf import DictConfig

from nxdt.config import schema
from nxdt.config import validate as schema_checks
from nxdt.config.errors import ConfigError
from nxdt.config.inert import backend_of, inert_notice
from nxdt.config.load import compose, report
from nxdt.config.load import config_from_dict as schema_config_from_dict
from nxdt.config.optim_keys import check_optim_parallel
from nxdt.config.validate import did_you_mean
from nxdt.spec.alignment import alignment_notices, alignment_of, check_alignment
from nxdt.spec.data import check_dynamic_selection, parse_data_prefix, parse_datasets
from nxdt.spec.exp import check_samples, parse_signals
from nxdt.spec.layout import compute_layout
from nxdt.spec.model import check_architecture, check_compile, check_hf_layouts, check_loss_chunking
from nxdt.spec.moe import check_expert_parallel, check_moe, check_moe_layouts_supported
from nxdt.spec.parallel import check_context_parallel, check_pipeline, sharding_mode_of
from nxdt.spec.paths import check_files
from nxdt.spec.precision import precision_settings


def validate(cfg: DictConfig | schema.NxdtConfig, world_size: int | None = None, check_paths: bool = True,
             check_supported: bool = True, notices: list[str] | None = None) -> schema.NxdtConfig:
    """Validate a composed config; raise ConfigError on the first problem; return it typed.

    Stages, in order: the schema's (nxdt.config.validate: unknown keys, types, ranges, values not
    supported yet), the cross-checks of each spec piece (`check_cross`), the paths the config names
    (`check_paths`). `notices`: one-line notices for the caller to print once (sequence_parallel
    turned off, the alignment's, the settings that have no effect in this run)."""
    typed = schema_checks.validate(cfg, check_supported=False, notices=notices)
    if check_supported:
        check_not_supported(typed)
    check_cross(typed, world_size)
    if notices is not None:
        notices.extend(alignment_notices(typed))
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


# --------------------------------------------------------------------------- cross-checks
# --------------------------------------------------------------------------- cross-checks
def _hf_json(cfg: Any) -> dict:
    path = cfg.model.model_config
    if cfg.model_source != "hf" or not path or not os.path.isfile(str(path)):
        return {}
    try:
        with open(str(path), encoding="utf-8") as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _effective_model(cfg: Any) -> dict:
    """Architecture numbers as the model builder will see them (hf: config.json under cfg overrides)."""
    hf = _hf_json(cfg)
    m = cfg.model

    def pick(key: str, json_key: str):
        v = getattr(m, key)
        return v if v is not None else hf.get(json_key)

    heads = pick("num_attention_heads", "num_attention_heads")
    kv = pick("num_kv_heads", "num_key_value_heads") or heads
    return {
        "num_layers": pick("num_layers", "num_hidden_layers"),
        "hidden_size": pick("hidden_size", "hidden_size"),
        "ffn_hidden_size": pick("ffn_hidden_size", "intermediate_size"),
        "num_attention_heads": heads,
        "num_kv_heads": kv,
        "max_position_embeddings": pick("max_position_embeddings", "max_position_embeddings"),
        "kv_channels": pick("kv_channels", "head_dim"),
    }


def check_cross(cfg: Any, world_size: int | None = None) -> None:
    tr, ds, data, model = cfg.trainer, cfg.distributed_strategy, cfg.data, cfg.model
    if tr.accumulate_grad_batches != 1:
        raise ConfigError(
            f"trainer.accumulate_grad_batches: {tr.accumulate_grad_batches} is not allowed: gradient accumulation "
            f"is derived from data.global_batch_size / (data.micro_batch_size x data-parallel size); set those instead")
    exp = cfg.exp_manager
    if tr.max_epochs == 0 and not exp.resume_from_checkpoint and not exp.resume_if_exists:
        # evaluating freshly initialised weights is never what was meant
        raise ConfigError("trainer.max_epochs=0 (evaluate only): no weights to evaluate: set "
                          "exp_manager.resume_from_checkpoint=CHECKPOINT or exp_manager.resume_if_exists=true "
                          "(this run's newest checkpoint)")
    if world_size is not None and tr.devices * tr.num_nodes != world_size:
        raise ConfigError(
            f"trainer.devices ({tr.devices}) x trainer.num_nodes ({tr.num_nodes}) = {tr.devices * tr.num_nodes} "
            f"does not match the world size {world_size}")
    layout = compute_layout(cfg, world_size)

    if cfg.model_source == "megatron":
        for key in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads"):
            if getattr(model, key) is None:
                raise ConfigError(f"model.{key} is required for model_source megatron")
    elif model.model_config is None:
        raise ConfigError("model.model_config (a transformers config.json) is required for model_source hf")

    shards = sharding_mode_of(ds).shard
    check_data_parallel_options(cfg, shards)
    check_optim_parallel(model.optim, tp=layout.tp, ep=layout.ep, fsdp_ways=layout.dp * layout.cp if shards else 1)
    eff = _effective_model(cfg)
    check_pipeline(cfg, layout, eff["num_layers"])
    check_loss_chunking(cfg, layout)
    check_compile(cfg, layout)
    check_context_parallel(cfg, layout)
    heads, kv, hidden, tp = eff["num_attention_heads"], eff["num_kv_heads"], eff["hidden_size"], layout.tp
    for key in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_kv_heads",
                "max_position_embeddings"):
        if eff[key] is not None and eff[key] < 1:
            raise ConfigError(f"model.{key}: must be >= 1, got {eff[key]}")
    if heads is not None:
        if heads % tp:
            raise ConfigError(f"model.num_attention_heads ({heads}) is not divisible by "
                              f"distributed_strategy.tensor_model_parallel_size ({tp})")
        if hidden is not None and eff["kv_channels"] is None and hidden % heads:
            raise ConfigError(f"model.hidden_size ({hidden}) is not divisible by model.num_attention_heads ({heads})")
        if kv is not None:
            if heads % kv:
                raise ConfigError(f"model.num_attention_heads ({heads}) is not divisible by model.num_kv_heads ({kv})")
            if (kv >= tp and kv % tp) or (kv < tp and tp % kv):
                raise ConfigError(f"model.num_kv_heads ({kv}) and distributed_strategy.tensor_model_parallel_size "
                                  f"({tp}) must divide one another (K/V heads are split or replicated across tp)")
    seq, maxpos = data.seq_length, eff["max_position_embeddings"]
    if seq is not None and maxpos is not None and seq > maxpos:
        raise ConfigError(f"data.seq_length ({seq}) exceeds model.max_position_embeddings ({maxpos})")
    check_recompute_classes(cfg)
    rep = ds.hsdp_replicate_size
    if rep is not None and (rep < 1 or layout.dp % rep):
        raise ConfigError(f"distributed_strategy.hsdp_replicate_size ({rep}) does not divide the data-parallel "
                          f"size {layout.dp}")
    if tr.devices * tr.num_nodes > 1 and backend_of(cfg) == "xla":  # the rule of nxdt.device.use_xla
        # Not built because XLA:CPU, where it could be tested, cannot run it: each torchrun process
        # gets its own one-device PJRT client (the xla all_reduce is a no-op), and CPU_NUM_DEVICES=2
        # runs the devices as threads of one process; Lightning and the DeviceMesh want a process each
        on = tr.accelerator if tr.accelerator in ("xla", "neuron", "tpu") else "auto (torch-xla, PJRT_DEVICE)"
        raise ConfigError(f"trainer.accelerator {on}: only one device is supported yet "
                          f"(got trainer.devices x trainer.num_nodes = {tr.devices * tr.num_nodes}); "
                          "data parallel over XLA devices is not built")
    precision_settings(cfg.precision)  # the fp16 / preset combination rules
    p, n = model.selective_checkpointing, model.checkpoint_num_layers  # ranges: the schema's
    if n > 1 and (model.activations_checkpoint_granularity != "full" or p is not None):  # chunks of whole blocks
        raise ConfigError(f"model.checkpoint_num_layers ({n}) needs model.activations_checkpoint_granularity=full "
                          "and no model.selective_checkpointing")
    check_moe(cfg, _hf_json(cfg))
    check_expert_parallel(cfg)
    head_dim = eff["kv_channels"] or (hidden // heads if hidden and heads else None)
    check_architecture(cfg, head_dim)
    check_alignment(cfg)
    check_samples(cfg)
    parse_signals(cfg.exp_manager.preemption_signals)
    if not re.fullmatch(r"\s*\d+(\.\d+)?\s*(,\s*\d+(\.\d+)?\s*){2}", data.splits_string):
        raise ConfigError(f"data.splits_string: expected three comma-separated numbers like '980,10,10', "
                          f"got '{data.splits_string}'")
    if data.datasets is not None or data.weights is not None:
        parse_datasets(data.datasets, data.weights)
    if data.packing and alignment_of(cfg).sft is None:
        raise ConfigError("data.packing: packing applies to SFT data only (set model_alignment_strategy.sft)")
    if data.data_module is not None and not re.fullmatch(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)+", data.data_module):
        raise ConfigError(f"data.data_module: expected 'package.module.ClassName', got '{data.data_module}'")
    if data.data_module is None and data.data_prefix is not None:
        parse_data_prefix(data.data_prefix)
    check_dynamic_selection(cfg)


def check_data_parallel_options(cfg: Any, shards: bool) -> None:
    """Options that only a sharding data-parallel mode (FSDP2) builds."""
    ds = cfg.distributed_strategy
    if ds.cpu_offload and not shards:
        raise ConfigError("distributed_strategy.cpu_offload=true needs a sharding data-parallel mode (FSDP2 "
                          "offloads its shards): set distributed_strategy.fsdp=true or sharding_strategy FSDP, "
                          "HSDP or grad-shard")
    p = cfg.precision
    if p.fp32_grads_cc and p.type == "manual" and not shards and precision_settings(p).mode == "lowp":
        # bf16 parameters without master weights: DDP (FSDP2's replicate) reduces the bf16 gradients;
        # FSDP reduces in fp32 (its reduce_dtype), and master weights give fp32 gradients
        raise ConfigError("precision.fp32_grads_cc=true with bf16 parameters (precision.type manual, no "
                          "master_weights) and DDP is not supported yet: use distributed_strategy.fsdp=true "
                          "(gradients reduced in fp32) or precision.master_weights=true")


# --------------------------------------------------------------------------- activation checkpointing
# Module classes of a Llama block that `model.activations_checkpoint_recompute` may name (native
# model; transformers' Llama has the same names, CoreAttention meaning its LlamaAttention).
RECOMPUTE_CLASSES = ("CoreAttention", "LlamaAttention", "LlamaDecoderLayer", "LlamaLayerNorm", "LlamaMLP",
                     "LlamaRMSNorm", "Linear", "SiLU", "GELU", "Dropout")


def check_recompute_classes(cfg: Any) -> None:
    """Unknown class names in activations_checkpoint_recompute (Llama models; other transformers
    architectures are checked against their modules when the model is built)."""
    names = cfg.model.activations_checkpoint_recompute
    if not names:
        return
    if cfg.model_source == "hf" and _hf_json(cfg).get("model_type", "llama") != "llama":
        return
    for name in names:
        if name not in RECOMPUTE_CLASSES:
            raise ConfigError(f"model.activations_checkpoint_recompute: unknown module class '{name}'"
                              f"{did_you_mean(str(name), RECOMPUTE_CLASSES)}; valid: {', '.join(RECOMPUTE_CLASSES)}")

