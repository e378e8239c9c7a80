"""Keys the schema accepts that nxdt does not build: the inert ones, and values refused as not built yet.

nxdt reads NxDT's YAML as it is, so it accepts every key NxDT's configs write (the release configs of
tests/nxdt_release/, checked by tests/test_migration_doc.py). Each key is one of:
- built: some module reads it (a test walks the schema and fails on a key nothing reads);
- refused: `NOT_SUPPORTED_YET` (key -> the values not built), checked by
  `nxdt.config.validate.check_not_supported`: "'<key>' is not supported yet (got ...)";
- inert: `INERT` below, each with the reason. A run with such a key set to another value than
  its default (on a backend where it is inert, and without the setting that makes it act) gets
  one notice at start that names it (`inert_notice`, returned by validation with its other
  notices), and `--help` marks the keys inert everywhere or on some backends.

Backends: "cpu", "cuda", "mps", "neuron" (TorchNeuron's native device) and "xla" (torch-xla: Neuron's
XLA-era path, TPU), as `backend_of` guesses them before torch is imported. This module imports only the standard library and nxdt.config.
"""

from __future__ import annotations

import difflib
import importlib.util
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from nxdt.config import schema
from nxdt.config.errors import ConfigError
from nxdt.config.env import detect_xla, neuron_runtime
from nxdt.config.typed import select

BACKENDS = ("cpu", "cuda", "mps", "neuron", "xla")
OFF_XLA = ("cpu", "cuda", "mps", "neuron")
OFF_NEURON = ("cpu", "cuda", "mps")
"""where the Neuron runtime / compiler knobs have no effect (they act on both Neuron paths)"""
OFF_CUDA = ("cpu", "mps", "neuron", "xla")
# the schema's neuron=True keys that TorchNeuron's native device reads too (runtime, cache, compiler
# variables: nxdt.config.env.apply_env); the others (xser files, the XLA device-move groups, NKI
# layouts) belong to the torch-xla path
NEURON_RUNTIME_KEYS = ("compiler_flags", "compiler_cache_url", "aync_exec_max_inflight_requests",
                       "bucket_size_collectives", "neuron_rt_exec_timeout", "neuron_experimental_compress_rg")


@dataclass(frozen=True)
class NotSupported:
    """A predicate on a key's value (True: the value needs a feature not built yet), and how the
    refused values read in --help ("> 1")."""

    refuses: Callable[[Any], bool]
    shown: str
    why: str = ""
    """What is not built, and why ignoring the value instead would be wrong (docs/migrating-from-nxdt.md)."""

    def __call__(self, value: Any) -> bool:
        return self.refuses(value)


def _gt1(v: Any) -> bool:
    return v is not None and v > 1


# dotted key -> the values validation refuses as not built yet. The lead removes entries as
# features land. (Combinations that are refused live with their checks: moe_checks, arch_checks,
# alignment, nxdt.spec.check_spec.)
NOT_SUPPORTED_YET: dict[str, NotSupported] = {
    "distributed_strategy.token_shuffle_group_size": NotSupported(
        _gt1, "> 1", "NxDT shuffles MoE tokens across this many ranks before routing (load balance); with a "
                     "capacity factor that changes which tokens are dropped, so ignoring it would change the results"),
}


@dataclass(frozen=True)
class Inert:
    """Why a key has no effect, and when."""

    reason: str
    on: tuple[str, ...] = BACKENDS
    """The backends where it has no effect."""
    unless: Callable[[Any], bool] | None = None
    """A setting of the config that makes it act (then it is not reported)."""
    given: Callable[[Any, Any], bool] | None = None
    """(cfg, value) -> whether the value asks for something; default: it differs from the schema default."""
    notice: bool = True
    """False when another module already reports it (nxdt.spec.alignment's notices)."""

    @property
    def always(self) -> bool:
        """Inert in every run: nothing reads it, by design."""
        return self.on == BACKENDS and self.unless is None


def _manual(cfg: Any) -> bool:
    return cfg.precision.type == "manual"


def _saves_checkpoints(cfg: Any) -> bool:
    return cfg.exp_manager.create_checkpoint_callback


_NO_CHECKPOINTS = "no checkpoints are saved: exp_manager.create_checkpoint_callback=false"
_MANUAL_ONLY = "only precision.type manual reads it; the preset decides"
_XLA_COMPILES = "torch-xla traces each step and its compiler compiles the whole graph; no torch.compile"
_SDPA = "attention is always PyTorch's SDPA, which picks flash kernels itself on CUDA"
_FUSED_QKV = "NxDT's fused q/k/v module, a Neuron layout; nxdt's separate q, k, v projections compute the same"
_ROPE = "no rotary embedding: model.position_embedding_type is not rope"
_MOE_OFF = "a dense model: model.moe.num_experts=0"
_FP16_OFF = "fp16 is off: precision.fp16.enabled=false"
_SAMPLES_OFF = "no prompts: exp_manager.samples.prompts is empty"
_PROFILER_OFF = "the profiler is off: exp_manager.profiler.enabled=false"


def _gate(keys: list[str], reason: str, unless: Callable[[Any], bool]) -> list[tuple[str, Inert]]:
    return [(k, Inert(reason, unless=unless)) for k in keys]


def _section_keys(prefix: str, *leave_out: str) -> list[str]:
    return [k for k, *_ in schema.iter_fields() if k.startswith(prefix) and k not in leave_out]


def _kv_heads(cfg: Any) -> int | None:
    """model.num_kv_heads, or (hf) config.json's num_key_value_heads."""
    if cfg.model.num_kv_heads is not None or cfg.model_source != "hf" or not cfg.model.model_config:
        return cfg.model.num_kv_heads
    try:
        with open(cfg.model.model_config, encoding="utf-8") as f:
            hf = json.load(f)
    except (OSError, ValueError):
        return None
    return hf.get("num_key_value_heads", hf.get("num_attention_heads")) if isinstance(hf, dict) else None


def _not_tp_over_kv(cfg: Any, value: Any) -> bool:
    """kv_replicator other than the replicas nxdt makes (tp / num_kv_heads, at least 1)."""
    kv, tp = _kv_heads(cfg), cfg.distributed_strategy.tensor_model_parallel_size
    return value is not None and kv is not None and value != max(1, tp // kv)


def _not_tp_x_pp(cfg: Any, value: Any) -> bool:
    ds = cfg.distributed_strategy
    return value is not None and value != ds.tensor_model_parallel_size * ds.pipeline_model_parallel_size


def _custom_filename(cfg: Any, value: Any) -> bool:
    return value != f"{cfg.exp_manager.name}--{{step}}-{{consumed_samples}}"


def _present(cfg: Any, value: Any) -> bool:
    return value is not None


def _true(cfg: Any, value: Any) -> bool:
    return value is True


def _compute_dtype(cfg: Any) -> str:
    """The dtype the forward runs in, as nxdt.spec.precision reads the preset (bf16 | fp32 | fp16)."""
    p = cfg.precision
    if p.fp16.enabled:
        return "fp16"
    if p.type == "fp32" or (p.type == "manual" and "1" not in (str(p.xla_use_bf16), str(p.xla_downcast_bf16))):
        return "fp32"
    return "bf16"


def _not_compute_dtype(cfg: Any, value: Any) -> bool:
    return value is not None and value != _compute_dtype(cfg)


INERT: list[tuple[str, Inert]] = [
    # nothing reads these, by design
    ("trainer.enable_model_summary",
     Inert("nxdt prints its own start summary (layout, parameters, memory) instead of Lightning's")),
    ("trainer.lnc", Inert("nxdt sets no NEURON_LOGICAL_NC_CONFIG (set it in the environment); only the MFU's "
                          "peak reads it")),
    ("trainer.sequential_move_factor",
     Inert("each rank builds its part of the model in place (meta device or CPU); nothing is moved in groups")),
    ("model.transpose_nki_inputs", Inert("nxdt runs no NKI kernels: " + _SDPA)),
    ("model.fusions.flash_attention", Inert(_SDPA)),
    ("model.qkv_linear", Inert(_FUSED_QKV)),
    ("model.fuse_qkv", Inert(_FUSED_QKV)),
    ("model.persist_layer_norm", Inert("a NeMo/Apex fused layer-norm kernel; nxdt's norms are plain PyTorch")),
    ("exp_manager.load_xser",
     Inert("a checkpoint is read in the format it was written in; xser files are detected")),
    ("exp_manager.ckpt_ptl_version",
     Inert("nxdt's checkpoints record their own format; no Lightning version is checked")),
    ("exp_manager.checkpoint_callback_params.model_parallel_size",
     Inert("informational (NxDT writes tp x pp); nxdt records the layout in every checkpoint",
           given=_not_tp_x_pp)),
    ("data.tokenizer.delimiter", Inert("only NeMo's tabular tokenizer reads it; nxdt has none")),
    ("data.pad_samples_to_global_batch_size",
     Inert("training batches are always full (the data repeats as needed); a last partial validation batch "
           "(data.validation_drop_last=false) is split across the ranks as it is")),
    ("model.optim.sched.monitor",
     Inert("NeMo's Lightning key: the scheduler steps once per optimizer step", given=_present)),
    ("model.optim.sched.reduce_on_plateau",
     Inert("NeMo's Lightning key: the scheduler steps once per optimizer step", given=_present)),
    ("precision.parallel_layers_reduce_dtype",
     Inert("tensor/sequence-parallel reductions run in the compute dtype of the preset (NxDT's default); "
           "another reduce dtype is not built", given=_not_compute_dtype)),
    ("model_alignment_strategy.peft.merge_sharded_lora",
     Inert("nxdt's checkpoints are read whole at any layout", notice=False)),
    # per backend
    ("model.fusions.softmax", Inert("a fusion of Neuron's compiler in torch-xla's graph (NEURON_FUSE_SOFTMAX)",
                                    on=OFF_XLA)),
    ("exp_manager.save_xser", Inert("torch-xla's serialization: checkpoints are torch.distributed.checkpoint "
                                    "files on this device", on=OFF_XLA)),
    ("model.fusions.torch_compile", Inert(_XLA_COMPILES, on=("xla",))),
    ("model.use_torch_compile", Inert(_XLA_COMPILES, on=("xla",))),
    ("exp_manager.profiler.cuda_memory_snapshot",
     Inert(_PROFILER_OFF, unless=lambda c: c.exp_manager.profiler.enabled)),
    ("exp_manager.profiler.cuda_memory_snapshot", Inert("it records the CUDA allocator", on=OFF_CUDA)),
    ("model.optim.capturable",
     Inert("a CUDA-graph / XLA option of torch's optimizers, which assert on it elsewhere: left out of the "
           "optimizer here", on=("cpu", "mps"), given=_true)),
    ("distributed_strategy.kv_replicator",
     Inert("nxdt replicates the K/V heads tensor_model_parallel_size / num_kv_heads times itself",
           given=_not_tp_over_kv)),
    # read only with another setting
    *_gate(["precision.master_weights", "precision.fp32_grad_acc", "precision.fp32_grads_cc",
            "precision.xla_use_bf16", "precision.xla_downcast_bf16", "precision.neuron_rt_stochastic_rounding_en"],
           _MANUAL_ONLY, _manual),
    *_gate(_section_keys("exp_manager.checkpoint_callback_params.",
                         "exp_manager.checkpoint_callback_params.model_parallel_size")
           + ["exp_manager.save_bf16", "exp_manager.async_checkpointing", "exp_manager.save_xser"],
           _NO_CHECKPOINTS, _saves_checkpoints),
    ("exp_manager.resume_ignore_no_checkpoint",
     Inert("only with exp_manager.resume_if_exists=true", unless=lambda c: c.exp_manager.resume_if_exists)),
    ("exp_manager.wandb_logger_kwargs",
     Inert("no W&B logger: exp_manager.create_wandb_logger=false",
           unless=lambda c: c.exp_manager.create_wandb_logger)),
    ("exp_manager.mlflow_logger_kwargs",
     Inert("no MLflow logger: exp_manager.create_mlflow_logger=false",
           unless=lambda c: c.exp_manager.create_mlflow_logger)),
    *_gate(_section_keys("exp_manager.profiler.", "exp_manager.profiler.enabled",
                         "exp_manager.profiler.cuda_memory_snapshot"),
           _PROFILER_OFF, lambda c: c.exp_manager.profiler.enabled),
    *_gate(_section_keys("exp_manager.samples.", "exp_manager.samples.prompts"), _SAMPLES_OFF,
           lambda c: bool(c.exp_manager.samples.prompts)),
    ("trainer.check_val_every_n_epoch",
     Inert("validation runs every trainer.val_check_interval steps (an int)",
           unless=lambda c: not isinstance(c.trainer.val_check_interval, int))),
    ("distributed_strategy.hsdp_replicate_size",
     Inert("only HSDP reads it (distributed_strategy.sharding_strategy=HSDP)",
           unless=lambda c: schema.sharding_way(c.distributed_strategy.sharding_strategy,
                                                    c.distributed_strategy.fsdp).startswith("hybrid"))),
    ("distributed_strategy.schedule",
     Inert("no pipeline: pipeline_model_parallel_size=1",
           unless=lambda c: c.distributed_strategy.pipeline_model_parallel_size > 1)),
    *_gate(["model.activations_checkpoint_recompute", "model.activations_checkpoint_recompute_mlp"],
           "only with model.activations_checkpoint_granularity=selective",
           lambda c: c.model.activations_checkpoint_granularity == "selective"),
    ("model.gpt_j_tied", Inert("only with model.transformer_block_type=gpt_j",
                               unless=lambda c: c.model.transformer_block_type == "gpt_j")),
    *_gate(["model.rotary_percentage", "model.rope_theta", "model.rotary_emb_base", "model.rope_scaling"], _ROPE,
           lambda c: c.model.position_embedding_type == "rope"),
    *_gate(_section_keys("model.moe.", "model.moe.num_experts"), _MOE_OFF, lambda c: c.model.moe.num_experts > 0),
    *_gate(_section_keys("precision.fp16.", "precision.fp16.enabled", "precision.fp16.max_consecutive_skips"),
           _FP16_OFF, lambda c: c.precision.fp16.enabled),
    ("precision.fp16.max_consecutive_skips",
     Inert("no step is skipped: fp16 is off and precision.on_nonfinite=stop",
           unless=lambda c: c.precision.fp16.enabled or c.precision.on_nonfinite == "skip")),
    *_gate(["data.tokenizer.vocab_file", "data.tokenizer.merge_file"],
           "only data.tokenizer.library megatron reads it", lambda c: c.data.tokenizer.library == "megatron"),
    *_gate(["data.tokenizer.model", "data.tokenizer.sentencepiece_legacy"],
           "only data.tokenizer.library sentencepiece reads it",
           lambda c: c.data.tokenizer.library == "sentencepiece"),
    ("data.tokenizer.use_fast", Inert("only data.tokenizer.library huggingface reads it",
                                      unless=lambda c: c.data.tokenizer.library == "huggingface")),
    *_gate(_section_keys("data.dynamic_selection."), "only data.dynamic_data_selection sheared_llama / sheared_llama_paper reads it",
           lambda c: c.data.dynamic_data_selection != "none"),
    *_gate(["data.data_path", "data.col_name", "data.sep_token", "data.bos_token", "data.eos_token",
            "data.bol_token", "data.eol_token", "data.strip_tokens", "data.file_type"],
           "only data.datasets reads it (data_path: its folder; the others: its arrow / parquet shards)",
           lambda c: c.data.datasets is not None),
]


def _neuron_entries() -> list[tuple[str, Inert]]:
    """The schema's `neuron=True` keys not listed above: they act on Neuron/XLA only."""
    listed = {k for k, _ in INERT}
    return [(k, Inert("Neuron only", on=OFF_NEURON) if k in NEURON_RUNTIME_KEYS else Inert("torch-xla only", on=OFF_XLA))
            for k, _t, _d, _h, meta in schema.iter_fields() if meta.get("neuron") and k not in listed]


def entries() -> list[tuple[str, Inert]]:
    return INERT + _neuron_entries()


# --------------------------------------------------------------------------- readers
def backend_of(cfg: Any, environ: Mapping[str, str] | None = None) -> str:
    """cpu | cuda | mps | neuron | xla, as far as it can be told before torch is imported (the same
    rules as nxdt.device: TorchNeuron's native device where installed, nxdt.config.env.neuron_runtime;
    torch-xla asked for, or hinted at and installed)."""
    environ = os.environ if environ is None else environ
    acc = cfg.trainer.accelerator
    if neuron_runtime(cfg, dict(environ)) == "neuron":
        return "neuron"
    if acc in ("xla", "neuron", "tpu"):
        return "xla"
    if acc == "auto" and detect_xla(cfg, dict(environ)) and importlib.util.find_spec("torch_xla") is not None:
        return "xla"
    if acc in ("gpu", "cuda"):
        return "cuda"
    if acc == "mps":
        return "mps"
    if acc == "auto" and environ.get("CUDA_VISIBLE_DEVICES", "0") not in ("", "-1") and (
            os.path.exists("/dev/nvidiactl") or os.path.exists("/proc/driver/nvidia/version")):
        return "cuda"
    return "cpu"


_DEFAULTS: dict[str, Any] = {}


def _default(key: str) -> Any:
    if not _DEFAULTS:
        _DEFAULTS.update({k: d for k, _t, d, _h, _m in schema.iter_fields()})
    return _DEFAULTS.get(key)


def _is_given(entry: Inert, cfg: Any, key: str, value: Any) -> bool:
    if entry.given is not None:
        return entry.given(cfg, value)
    default = _default(key)
    if isinstance(default, str) and "${" in default:  # an interpolated default: needs its own `given`
        return False
    return value is not None and value != default


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    text = "null" if value is None else str(value)
    return text if len(text) <= 40 else text[:37] + "..."


def inert_keys(cfg: Any, backend: str | None = None) -> list[tuple[str, Any, str]]:
    """(key, value, reason) of every key of `cfg` that asks for something and has no effect in this run."""
    backend = backend or backend_of(cfg)
    found, seen = [], set()
    for key, entry in entries():
        if key in seen or backend not in entry.on:
            continue
        value = select(cfg, key)
        if not _is_given(entry, cfg, key, value) or (entry.unless is not None and entry.unless(cfg)):
            continue
        seen.add(key)
        if entry.notice:
            found.append((key, value, entry.reason))
    return found


def inert_notice(cfg: Any, backend: str | None = None) -> str | None:
    """The one line naming this run's inert settings, grouped by reason; None when there are none."""
    backend = backend or backend_of(cfg)
    groups: dict[str, list[str]] = {}
    for key, value, reason in inert_keys(cfg, backend):
        groups.setdefault(reason, []).append(f"{key}={_show(value)}")
    if not groups:
        return None
    return (f"settings with no effect in this run ({backend}): "
            + "; ".join(f"{', '.join(keys)}: {reason}" for reason, keys in groups.items()))


def help_marks(key: str) -> list[str]:
    """--help marks of a key: '[inert: ...]', '[inert on cpu, cuda, mps: ...]', '[not supported yet: > 1]'.
    Keys inert only without another setting are not marked (their help says 'with ...')."""
    marks = []
    for k, entry in INERT:
        if k != key or entry.unless is not None:
            continue
        where = "" if entry.on == BACKENDS else f" on {', '.join(entry.on)}"
        marks.append(f"inert{where}: {entry.reason}")
    if key in NOT_SUPPORTED_YET:
        marks.append(f"not supported yet: {NOT_SUPPORTED_YET[key].shown}")
    return marks


def always_inert(key: str) -> bool:
    """Nothing reads the key, by design (inert in every run, on every backend)."""
    return any(k == key and entry.always for k, entry in INERT)


def describe(section: str | None = None) -> str:
    """Human-readable key reference (for --help): one line per key, optionally one section (or key)
    only. Marks: [Neuron] (acts on Neuron/XLA only), [alias of ...] (the schema's `alias=`), [inert ...]
    and [not supported yet ...] (the tables of this module). An unknown section is a ConfigError with a did-you-mean."""
    fields = list(schema.iter_fields())
    if section:
        fields = [f for f in fields if f[0] == section or f[0].startswith(section + ".")]
        if not fields:
            names = sorted({k.rsplit(".", i)[0] for k, *_ in schema.iter_fields() for i in range(k.count(".") + 1)})
            close = difflib.get_close_matches(section, names, n=1, cutoff=0.6)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ConfigError(f"--help {section}: no such section or key{hint}; sections: "
                              f"{', '.join(sorted({k.split('.')[0] for k in names if '.' in k}))}")
    lines = []
    for key, tname, default, help_, meta in fields:
        shown = "null" if default is None else repr(default)
        alias = [f"alias of {meta['alias']}"] if meta.get("alias") else []
        tags = "".join(f" [{mark}]" for mark in (["Neuron"] if meta.get("neuron") else []) + alias + help_marks(key))
        lines.append(f"{key} ({schema.type_with_range(tname, meta)}, default {shown}){tags}: {help_}")
    return "\n".join(lines)
