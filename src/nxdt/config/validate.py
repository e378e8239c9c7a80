"""Checks a composed config; every problem is a one-line ConfigError naming the dotted key.

Stages (in this order):
1. `check_schema`: unknown keys (with did-you-mean), types, enumerations, then the range of
   every number (the schema's `ge=`/`gt=`/... , `nxdt.config.ranges`; keys given directly before
   keys filled by an interpolation, so the key the user set is the one named); coerces values
   in place (ints and numeric strings such as "3e-4" to floats for float keys) and normalises
   (vpp null -> 1, sequence_parallel off when tp == 1, megatron defaults, sched.max_steps);
   `model.optim` by `nxdt.config.optim_keys` (names, keys, ranges, the schedule's steps).
2. `NOT_SUPPORTED_YET` (`nxdt.config.inert`): values the schema accepts but nxdt does not build yet.
3. Cross-checks: world size, parallel layout and batch sizes, attention heads, sequence length.
4. Paths named by the config (`check_paths`): files exist, log dirs can be made.

`validate` returns the config as an `NxdtConfig` (stages 2-4 read typed attributes) and appends
the notices (one line each) the caller should print once to its `notices` list, among them the
settings that have no effect in this run (`nxdt.config.inert.inert_notice`).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import re
from typing import Any, Literal, Union, get_args, get_origin

from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from nxdt.config import ranges, schema
from nxdt.config.blend import parse_data_prefix, parse_datasets
from nxdt.config.errors import ConfigError
from nxdt.config.layout import compute_layout
from nxdt.config.alignment import alignment_notices, alignment_of, check_alignment
from nxdt.config.arch_checks import check_architecture, check_hf_layouts
from nxdt.config.moe_checks import canonical_gate_type, check_expert_parallel, check_moe, check_moe_layouts_supported
from nxdt.config.inert import NOT_SUPPORTED_YET, backend_of, inert_notice
from nxdt.config.loss_checks import check_loss_chunking
from nxdt.config.signals import parse_signals
from nxdt.config.sample_checks import check_samples
from nxdt.config.optim_keys import check_optim_parallel, sched_rules
from nxdt.config.sharding import sharding_mode_of
from nxdt.config.compile_settings import check_compile
from nxdt.config.cp_checks import check_context_parallel
from nxdt.config.data_selection import check_dynamic_selection
from nxdt.config.path_checks import check_files
from nxdt.config.pipeline_checks import check_pipeline
from nxdt.config.precision_settings import precision_settings
from nxdt.config.typed import select, to_typed



def _one_line(text: Any) -> str:
    return " ".join(str(text).split())


def _did_you_mean(word: str, choices, prefix: str = "") -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean '{prefix}{close[0]}'?)" if close else ""


def _type_of(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, (list, ListConfig)):
        return "list"
    if isinstance(value, (dict, DictConfig)):
        return "mapping"
    return type(value).__name__


# --------------------------------------------------------------------------- type checking
_FAIL = object()


def _coerce(value: Any, hint: Any) -> Any:
    """`value` converted to `hint`, or _FAIL."""
    origin = get_origin(hint)
    if hint is Any:
        return value
    if hint is type(None):
        return None if value is None else _FAIL
    if origin is Union:
        for arg in get_args(hint):
            out = _coerce(value, arg)
            if out is not _FAIL:
                return out
        return _FAIL
    if origin is Literal:
        choices = get_args(hint)
        if isinstance(value, str) and value in choices:
            return value
        if isinstance(value, bool) and all(isinstance(c, str) for c in choices):
            alt = "1" if value else "0"
            return alt if alt in choices else _FAIL
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if value in choices and not isinstance(value, str):
                return value
            alt = str(int(value)) if float(value).is_integer() else str(value)
            return alt if alt in choices else _FAIL
        return _FAIL
    if hint is bool:
        return value if isinstance(value, bool) else _FAIL
    if hint is int:
        return value if isinstance(value, int) and not isinstance(value, bool) else _FAIL
    if hint is float:
        if isinstance(value, bool):
            return _FAIL
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value.strip())
            except ValueError:
                return _FAIL
        return _FAIL
    if hint is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        return _FAIL
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            return _FAIL
        (elem,) = get_args(hint) or (Any,)
        out = []
        for item in value:
            c = _coerce(item, elem)
            if c is _FAIL:
                return _FAIL
            out.append(c)
        return out
    if origin is dict:
        return value if isinstance(value, dict) else _FAIL
    return value  # unknown hint kinds are not checked


def _check_value(value: Any, hint: Any, path: str) -> Any:
    plain = OmegaConf.to_container(value, resolve=True) if isinstance(value, (DictConfig, ListConfig)) else value
    out = _coerce(plain, hint)
    if out is _FAIL:
        # element-level message for lists of a simple type
        if get_origin(hint) is Union and type(None) in get_args(hint):
            inner = [a for a in get_args(hint) if a is not type(None)]
            hint_for_msg = inner[0] if len(inner) == 1 else hint
        else:
            hint_for_msg = hint
        if get_origin(hint_for_msg) is list and isinstance(plain, list):
            (elem,) = get_args(hint_for_msg) or (Any,)
            for i, item in enumerate(plain):
                if _coerce(item, elem) is _FAIL:
                    raise ConfigError(f"{path}[{i}]: expected {schema.type_name(elem)}, got {item!r} ({_type_of(item)})")
        raise ConfigError(f"{path}: expected {schema.type_name(hint_for_msg)}, got {plain!r} ({_type_of(plain)})")
    return out


def _walk(node: DictConfig, cls: type, path: str, free_extra: bool = False, numbers: list | None = None) -> None:
    """Check `node` against the schema class `cls`; collect (dotted key, value, field metadata) of
    every value with a range into `numbers` (checked by `_check_ranges` once all types are known)."""
    fields = {f.name: f for f in dataclasses.fields(cls) if not schema.is_internal(f)}
    hints = schema.hints(cls)
    prefix = f"{path}." if path else ""
    for key in list(node.keys()):
        key = str(key)
        dotted = prefix + key
        if key not in fields:
            if free_extra:
                continue
            raise ConfigError(f"unknown key '{dotted}'{_did_you_mean(key, fields, prefix)}")
        hint = hints[key]
        value = node[key]
        sub = schema.section_class(hint)
        if sub is not None:
            if value is None and _optional(hint):
                continue
            if not isinstance(value, DictConfig):
                raise ConfigError(f"{dotted}: expected a mapping of {sub.__name__} keys, got {value!r} ({_type_of(value)})")
            _walk(value, sub, dotted, numbers=numbers)
            continue
        new = _check_value(value, hint, dotted)
        old = OmegaConf.to_container(value, resolve=True) if isinstance(value, (DictConfig, ListConfig)) else value
        if new is not None and (type(new) is not type(old) or new != old):
            node[key] = new
        if numbers is not None and ranges.has_range(fields[key].metadata):
            numbers.append((dotted, new, fields[key].metadata))


def _check_ranges(numbers: list, interpolated: set[str]) -> None:
    """The first number out of its range, as one ConfigError; a key the user set is named before
    a key that merely follows it by interpolation (data.seq_length follows model.encoder_seq_length)."""
    for dotted, value, meta in sorted(numbers, key=lambda n: n[0] in interpolated):
        message = ranges.check(dotted, value, meta)
        if message:
            raise ConfigError(message)


def check_typed_ranges(cfg: schema.NxdtConfig) -> None:
    """The range of every number of a typed config (one built or changed in code, not composed)."""
    _check_ranges([(key, select(cfg, key), meta) for key, _t, _d, _h, meta in schema.iter_fields()
                   if ranges.has_range(meta)], set())


def _interpolated(node: Any, prefix: str = "") -> set[str]:
    """Dotted keys whose value is an interpolation (before resolving)."""
    out: set[str] = set()
    if not isinstance(node, DictConfig):
        return out
    for key in node.keys():
        dotted = f"{prefix}{key}"
        if OmegaConf.is_interpolation(node, key):
            out.add(dotted)
        else:
            try:
                child = node[key]
            except OmegaConfBaseException:  # a missing value (???): the type check reports it
                continue
            if isinstance(child, DictConfig):
                out |= _interpolated(child, dotted + ".")
    return out


def _resolve(cfg: DictConfig) -> None:
    from nxdt.config import resolvers

    resolvers.register()
    try:
        OmegaConf.resolve(cfg)
    except (OmegaConfBaseException, ValueError, TypeError, ArithmeticError) as err:
        key = getattr(err, "full_key", None) or _bad_interpolation_key(cfg)
        where = f" at '{key}'" if key else ""
        raise ConfigError(f"cannot resolve interpolation{where}: {_one_line(str(err).splitlines()[0])}") from None


def _bad_interpolation_key(node: Any, prefix: str = "") -> str | None:
    """Dotted key of the first value whose interpolation fails to resolve."""
    keys = node.keys() if isinstance(node, DictConfig) else range(len(node))
    for key in keys:
        dotted = f"{prefix}.{key}" if prefix else str(key)
        try:
            value = node[key]
        except Exception:  # noqa: BLE001 - any failure locates the key
            return dotted
        if isinstance(value, (DictConfig, ListConfig)):
            found = _bad_interpolation_key(value, dotted)
            if found:
                return found
    return None


_NUMBER = re.compile(r"\s*[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?\s*")


def _numbers_from_strings(node: DictConfig) -> None:
    """In model.optim / sched, a number written as a string ("3e-4") becomes a float."""
    for key in list(node.keys()):
        value = node[key]
        if isinstance(value, DictConfig):
            _numbers_from_strings(value)
        elif isinstance(value, ListConfig):
            for i, item in enumerate(value):
                if isinstance(item, str) and _NUMBER.fullmatch(item):
                    value[i] = float(item)
        elif isinstance(value, str) and key != "name" and _NUMBER.fullmatch(value):
            node[key] = float(value)


def _set(node: DictConfig, key: str, value: Any) -> None:
    with open_dict(node):
        node[key] = value


def check_schema(cfg: DictConfig) -> list[str]:
    """Unknown keys, types and enumerations; coerces and normalises `cfg` in place. Returns notices."""
    if not isinstance(cfg, DictConfig):
        raise ConfigError(f"config must be a mapping, got {_type_of(cfg)}")
    interpolated = _interpolated(cfg)
    _resolve(cfg)
    data = cfg.get("data")
    free_data = isinstance(data, DictConfig) and data.get("data_module") is not None
    # with a custom data module, extra keys under data are free (known keys are still checked)
    numbers: list = []
    _walk_top(cfg, free_data, numbers)
    _check_ranges(numbers, interpolated)
    notices: list[str] = []

    ds = cfg.distributed_strategy
    if ds.virtual_pipeline_model_parallel_size is None:
        ds.virtual_pipeline_model_parallel_size = 1
    if ds.sequence_parallel and ds.tensor_model_parallel_size == 1:
        ds.sequence_parallel = False
        notices.append("distributed_strategy.sequence_parallel needs tensor_model_parallel_size > 1: turned off")

    model = cfg.model
    if cfg.model_source == "megatron":
        if model.max_position_embeddings is None:
            model.max_position_embeddings = model.encoder_seq_length
        if model.num_kv_heads is None and model.num_attention_heads is not None:
            model.num_kv_heads = model.num_attention_heads
    if model.moe.num_selects is not None:
        model.moe.top_k = model.moe.num_selects
    model.moe.gate_type = canonical_gate_type(model.moe.gate_type)

    steps_from_tokens(cfg.trainer, cfg.data, notices)

    optim = model.optim
    _numbers_from_strings(optim)
    sched = optim.get("sched")
    if isinstance(sched, DictConfig) and sched.get("max_steps") is None:
        _set(sched, "max_steps", cfg.trainer.max_steps)
    plain_optim = OmegaConf.to_container(optim, resolve=True)
    _check_optim(plain_optim)
    notices.extend(sched_rules(plain_optim, path="model.optim"))
    return notices


def steps_from_tokens(trainer, data, notices: list[str]) -> None:
    """trainer.max_tokens -> trainer.max_steps = ceil(max_tokens / tokens per global batch), with a notice
    (LLaMA-MoE plans in tokens: 10^11 / (block_size x global batch)). The token budget wins over a
    max_steps given beside it, which the notice names."""
    if trainer.max_tokens is None:
        return
    if any(n.startswith(f"trainer.max_tokens={trainer.max_tokens}:") for n in notices):
        return  # validation runs the schema stage again on the composed config: said once
    per_step = int(data.global_batch_size) * int(data.seq_length)
    steps = -(-int(trainer.max_tokens) // per_step)
    replaced = f" (instead of {trainer.max_steps})" if trainer.max_steps != steps else ""
    trainer.max_steps = steps
    notices.append(f"trainer.max_tokens={trainer.max_tokens}: max_steps {steps}{replaced} = ceil(max_tokens / "
                   f"(global batch {data.global_batch_size} x seq_length {data.seq_length} = {per_step} tokens/step))")


def _walk_top(cfg: DictConfig, free_data: bool, numbers: list) -> None:
    fields = {f.name: f for f in dataclasses.fields(schema.NxdtConfig)}
    hints = schema.hints(schema.NxdtConfig)
    for key in list(cfg.keys()):
        key = str(key)
        if key not in fields:
            raise ConfigError(f"unknown key '{key}'{_did_you_mean(key, fields)}")
        sub = schema.section_class(hints[key])
        value = cfg[key]
        if sub is None:
            new = _check_value(value, hints[key], key)
            if not isinstance(value, (DictConfig, ListConfig)) and new is not None and (
                    type(new) is not type(value) or new != value):
                cfg[key] = new
            if ranges.has_range(fields[key].metadata):
                numbers.append((key, new, fields[key].metadata))
            continue
        if value is None and _optional(hints[key]):
            continue
        if not isinstance(value, DictConfig):
            raise ConfigError(f"{key}: expected a mapping, got {value!r} ({_type_of(value)})")
        _walk(value, sub, key, free_extra=(key == "data" and free_data), numbers=numbers)


def _optional(hint: Any) -> bool:
    return get_origin(hint) is Union and type(None) in get_args(hint)


def _check_optim(optim: Any) -> None:
    try:
        from nxdt.config.optim_keys import check_optim
    except ImportError:  # pragma: no cover - the module is written in parallel
        return
    check_optim(optim, path="model.optim")


# --------------------------------------------------------------------------- not supported yet
def check_not_supported(cfg: Any) -> None:
    """Raise `'<key>' is not supported yet` for the first NOT_SUPPORTED_YET entry that matches."""
    for key, predicate in NOT_SUPPORTED_YET.items():
        value = select(cfg, key)
        if predicate(value):
            shown = value if not isinstance(value, (dict, list)) else _one_line(value)
            raise ConfigError(f"'{key}' is not supported yet (got {shown})")
    check_moe_layouts_supported(cfg)
    check_hf_layouts(cfg)


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
                              f"{_did_you_mean(str(name), RECOMPUTE_CLASSES)}; valid: {', '.join(RECOMPUTE_CLASSES)}")


# --------------------------------------------------------------------------- entry
def validate(cfg: DictConfig | schema.NxdtConfig, world_size: int | None = None, check_paths: bool = True,
             check_supported: bool = True, notices: list[str] | None = None) -> schema.NxdtConfig:
    """Validate a composed config; raise ConfigError on the first problem; return it typed.

    A DictConfig is schema-checked (coerced/normalised in place) and converted to an
    `NxdtConfig` (nxdt.config.typed), on which the other checks run; an `NxdtConfig` is
    re-checked as is. `notices`: if given, one-line notices (e.g. sequence_parallel turned
    off, the settings that have no effect in this run) are appended to it, for the caller to
    print once.
    """
    if isinstance(cfg, schema.NxdtConfig):
        typed = cfg
        check_typed_ranges(typed)
    elif isinstance(cfg, DictConfig):
        found = check_schema(cfg)
        if notices is not None:
            notices.extend(found)
        typed = to_typed(OmegaConf.to_container(cfg, resolve=True))
    else:
        raise ConfigError("validate() expects an OmegaConf DictConfig")
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
