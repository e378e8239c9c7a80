"""fms-fsdp's `train_config` -> nxdt keys: the one place import-config keeps what it knows of fms-fsdp.

Source: foundation-model-stack/fms-fsdp at 5a296af (`fms_fsdp/config/training.py`, the
`model_variant` presets of `fms_fsdp/utils/config_utils.py:get_model_config`, the data pipeline
of `fms_fsdp/utils/dataloader_utils.py`, the policies of `fms_fsdp/utils/train_utils.py` and the
loop of `main_training_llama.py`), and fms's `LLaMAConfig` defaults (foundation-model-stack,
`fms/models/llama.py`; the MLP width rule of `fms/modules/feedforward.py`).

`FIELDS` classifies every field of `train_config` (tests/test_import_config_fms.py checks it
against a copy of training.py): mapped (the nxdt key does what fms-fsdp does), approximated
(the closest nxdt setting, the difference in the table), inert (no effect on the run, in
fms-fsdp's main_training_llama.py or here) and not mapped (nxdt has no equivalent).
docs/migrating-from-fms-fsdp.md is the same table for people. This module does not import torch.
"""

from __future__ import annotations

import ast
import difflib
from fractions import Fraction
from pathlib import Path
from typing import Any

import yaml

from nxdt.config.errors import ConfigError
from nxdt.tools.neox_mapping import Output

FMS_COMMIT = "5a296af"

# ----------------------------------------------------------------------------- train_config's fields
# field -> (category, the nxdt key(s) or why not)
FIELDS: dict[str, tuple[str, str]] = {
    "model_variant": ("mapped", "model.* (num_layers, hidden_size, ffn_hidden_size, heads, vocab_size, rope_theta, "
                                "max_position_embeddings) from get_model_config's preset; mamba_*: refused"),
    "ckpt_load_path": ("approximated", "the same folder as ckpt_save_path: exp_manager.resume_if_exists; another "
                                       "folder: not read (fms-fsdp's checkpoints are not nxdt's)"),
    "ckpt_save_path": ("mapped", "exp_manager.explicit_log_dir (checkpoints in its checkpoints/)"),
    "use_dummy_dataset": ("mapped", "data.use_dummy_dataset"),
    "data_path": ("mapped", "data.data_path"),
    "file_type": ("mapped", "data.file_type (arrow, hf_parquet, auto)"),
    "col_name": ("mapped", "data.col_name"),
    "tokenizer_path": ("mapped", "data.tokenizer.type (library huggingface): also tokenizes hf_parquet text"),
    "datasets": ("mapped", "data.datasets"),
    "weights": ("mapped", "data.weights"),
    "seq_length": ("mapped", "data.seq_length and model.encoder_seq_length"),
    "vocab_size": ("inert", "fms-fsdp reads it only in its dummy loader; the model's vocabulary is "
                            "model_variant's (model.vocab_size)"),
    "bos_token": ("mapped", "data.bos_token"),
    "eos_token": ("mapped", "data.sep_token (data.eos_token is accepted as its alias)"),
    "bol_token": ("mapped", "data.bol_token"),
    "eol_token": ("mapped", "data.eol_token"),
    "strip_tokens": ("mapped", "data.strip_tokens"),
    "logical_shards": ("mapped", "data.logical_shards"),
    "num_workers": ("mapped", "data.num_workers"),
    "sharding_strategy": ("mapped", "distributed_strategy.sharding_strategy (fsdp, hsdp: shard within a node, ddp)"),
    "fsdp_activation_checkpointing": ("mapped", "model.selective_checkpointing (whole blocks) when true"),
    "selective_checkpointing": ("mapped", "model.selective_checkpointing (a fraction such as 1/3 too)"),
    "mixed_precision": ("mapped", "precision.type mixed_precision with precision.grad_reduce_dtype bf16 "
                                  "(fms-fsdp's bfSixteen); false: precision.type fp32"),
    "low_cpu_fsdp": ("mapped", "distributed_strategy.low_cpu_fsdp"),
    "batch_size": ("mapped", "data.micro_batch_size; data.global_batch_size = batch_size x world size"),
    "num_steps": ("mapped", "trainer.max_steps"),
    "training_stage": ("approximated", "initial: CosineAnnealing, warmup min(2000, num_steps / 20), min_lr 0.1 x lr "
                                       "(fms-fsdp's warmup is 1 - (1 - x/w)^2, nxdt's linear); annealing: "
                                       "LinearAnnealingWithWarmUp to 0"),
    "learning_rate": ("mapped", "model.optim.lr (AdamW, betas 0.9/0.95, weight decay 0.1 as fms-fsdp)"),
    "grad_clip_thresh": ("mapped", "trainer.gradient_clip_val"),
    "seed": ("mapped", "seed"),
    "resuming_dataset": ("inert", "nxdt restores the data position with the checkpoint it resumes from"),
    "use_profiler": ("mapped", "exp_manager.profiler.enabled (wait 1, warmup 2, active 3 as fms-fsdp)"),
    "profiler_rank0_only": ("mapped", "exp_manager.profiler.ranks ([0], or every rank)"),
    "report_interval": ("mapped", "trainer.log_every_n_steps"),
    "checkpoint_interval": ("mapped", "exp_manager.checkpoint_callback_params.every_n_train_steps"),
    "tracker": ("approximated", "wandb: exp_manager.create_wandb_logger; aim: not mapped (TensorBoard instead)"),
    "tracker_dir": ("mapped", "exp_manager.wandb_logger_kwargs.save_dir (tracker wandb)"),
    "tracker_project_name": ("mapped", "exp_manager.wandb_logger_kwargs.project (tracker wandb)"),
    "tracker_run_id": ("mapped", "exp_manager.wandb_logger_kwargs.id (tracker wandb)"),
    "use_torch_compile": ("mapped", "model.use_torch_compile"),
    **{name: ("inert", "speculator training (speculator/train_speculator.py) only; main_training_llama.py "
                       "does not read it")
       for name in ("tp_size", "model_arch", "model_path", "n_speculator_heads", "speculator_width",
                    "speculator_tie_weights", "speculator_scale_input", "stage2_start_step",
                    "stage2_prompt_length", "stage2_batch_size", "stage2_seq_length")},
}

# train_config's defaults (training.py), used for the fields a config leaves out
DEFAULTS: dict[str, Any] = {
    "model_variant": "7b", "ckpt_load_path": "/fsx/output/ckpt", "ckpt_save_path": "/fsx/output/ckpt",
    "use_dummy_dataset": False, "data_path": "/fsx/data", "file_type": "arrow", "col_name": "tokens",
    "tokenizer_path": "/fsx/tokenizer",
    "datasets": "lang=en/dataset=commoncrawl,lang=en/dataset=webhose,lang=en/dataset=github_clean,"
                "lang=de/dataset=wikipedia,lang=es/dataset=wikipedia,lang=fr/dataset=wikipedia,"
                "lang=ja/dataset=wikipedia,lang=pt/dataset=wikipedia,lang=en/dataset=wikimedia,"
                "lang=en/dataset=uspto,lang=en/dataset=pubmedcentral,lang=en/dataset=arxiv,"
                "lang=en/dataset=stackexchange",
    "weights": "7725,500,550,28,17,22,25,8,100,500,175,250,100", "seq_length": 4096, "vocab_size": 32000,
    "bos_token": None, "eos_token": 0, "bol_token": None, "eol_token": None, "strip_tokens": "",
    "logical_shards": 1024, "num_workers": 1, "sharding_strategy": "hsdp", "fsdp_activation_checkpointing": False,
    "selective_checkpointing": 1, "mixed_precision": True, "low_cpu_fsdp": False, "batch_size": 2,
    "num_steps": 1000000, "training_stage": "initial", "learning_rate": 3e-4, "grad_clip_thresh": 1.0, "seed": 2023,
    "resuming_dataset": False, "use_profiler": False, "profiler_rank0_only": True, "report_interval": 100,
    "checkpoint_interval": 10000, "tracker": None, "tracker_dir": "/fsx/aim_logs/llama",
    "tracker_project_name": "llama", "tracker_run_id": None, "use_torch_compile": True, "tp_size": 8,
    "model_arch": "embedllama", "model_path": "/path/to/model/", "n_speculator_heads": 3, "speculator_width": 4096,
    "speculator_tie_weights": True, "speculator_scale_input": True, "stage2_start_step": 15000,
    "stage2_prompt_length": 64, "stage2_batch_size": 96, "stage2_seq_length": 256,
}
INT_FIELDS = {"seq_length", "vocab_size", "logical_shards", "num_workers", "batch_size", "num_steps", "seed",
              "report_interval", "checkpoint_interval", "bos_token", "eos_token", "bol_token", "eol_token"}
BOOL_FIELDS = {"use_dummy_dataset", "fsdp_activation_checkpointing", "mixed_precision", "low_cpu_fsdp",
               "resuming_dataset", "use_profiler", "profiler_rank0_only", "use_torch_compile"}
FLOAT_FIELDS = {"learning_rate", "grad_clip_thresh"}
OPTIONAL_FIELDS = {"bos_token", "bol_token", "eol_token", "tracker", "tracker_run_id"}

# ----------------------------------------------------------------------------- model_variant presets
# fms's LLaMAConfig defaults (fms/models/llama.py)
LLAMA_DEFAULTS = {"src_vocab_size": 32_000, "emb_dim": 4096, "norm_eps": 1e-5, "nheads": 32, "kvheads": 0,
                  "nlayers": 32, "hidden_grow_factor": 8 / 3, "multiple_of": 256, "max_expected_seq_len": 4096,
                  "rope_theta": 10_000.0, "tie_heads": False, "attn_bias": False, "mlp_bias": False}
_L3 = {"src_vocab_size": 128256, "kvheads": 8, "rope_theta": 500000.0}
# get_model_config's LLaMAConfig arguments, variant by variant
PRESETS: dict[str, dict[str, Any]] = {
    "llama2_70b": {"emb_dim": 8192, "multiple_of": 4096, "nheads": 64, "kvheads": 8, "nlayers": 80,
                   "hidden_grow_factor": 28672 / 8192},
    "llama2_34b": {"emb_dim": 8192, "nheads": 64, "kvheads": 8, "nlayers": 48, "hidden_grow_factor": 22016 / 8192,
                   "max_expected_seq_len": 16384, "rope_theta": 1000000.0},
    "llama2_13b": {"emb_dim": 5120, "nheads": 40, "nlayers": 40, "hidden_grow_factor": 13824 / 5120},
    "llama2_7b": {"hidden_grow_factor": 11008 / 4096, "kvheads": 32},
    "llama2_1.4b": {"emb_dim": 2048, "nheads": 16, "nlayers": 24, "hidden_grow_factor": 3, "kvheads": 4},
    "llama3_8b": {**_L3, "emb_dim": 4096, "nheads": 32, "nlayers": 32, "hidden_grow_factor": 3.5,
                  "max_expected_seq_len": 8192},
    "llama3_8b_4k": {**_L3, "emb_dim": 4096, "nheads": 32, "nlayers": 32, "hidden_grow_factor": 3.5,
                     "max_expected_seq_len": 4096},
    "llama3_1.8b": {**_L3, "emb_dim": 2048, "nheads": 16, "nlayers": 24, "hidden_grow_factor": 3.5,
                    "max_expected_seq_len": 8192},
    "llama3_1.8b_4k": {**_L3, "emb_dim": 2048, "nheads": 16, "nlayers": 24, "hidden_grow_factor": 3.5,
                       "max_expected_seq_len": 4096},
    "llama3_3.2b": {**_L3, "emb_dim": 3072, "nheads": 24, "nlayers": 24, "hidden_grow_factor": 8 / 3,
                    "max_expected_seq_len": 8192},
    "llama3_3.2b_4k": {**_L3, "emb_dim": 3072, "nheads": 24, "nlayers": 24, "hidden_grow_factor": 8 / 3,
                       "max_expected_seq_len": 4096},
    "llama3_70b": {**_L3, "emb_dim": 8192, "nheads": 64, "nlayers": 80, "hidden_grow_factor": 3.5,
                   "max_expected_seq_len": 8192},
    "llama3_70b_4k": {**_L3, "emb_dim": 8192, "nheads": 64, "nlayers": 80, "hidden_grow_factor": 3.5,
                      "max_expected_seq_len": 4096},
    # no kvheads: fms's default 0, i.e. one K/V head per query head
    "llama3_194m_4k": {"src_vocab_size": 128256, "emb_dim": 1024, "nheads": 8, "nlayers": 10,
                       "max_expected_seq_len": 4096, "rope_theta": 500000.0},
}
MAMBA_VARIANTS = ("mamba_9.8b",)


def fms_hidden_dim(emb_dim: int, hidden_grow_factor: float, multiple_of: int | None) -> int:
    """fms's GatedLinearUnit width: int(hidden_grow_factor x emb_dim), rounded up to multiple_of."""
    hidden = int(hidden_grow_factor * emb_dim)
    if multiple_of:
        hidden = multiple_of * ((hidden + multiple_of - 1) // multiple_of)
    return hidden


def preset_model(variant: str) -> dict[str, Any]:
    """The nxdt model.* keys of a model_variant (ConfigError for mamba or an unknown name)."""
    if variant in MAMBA_VARIANTS:
        raise ConfigError(f"model_variant={variant}: a Mamba model (main_training_mamba.py); nxdt trains no Mamba "
                          "models")
    if variant not in PRESETS:
        close = difflib.get_close_matches(variant, list(PRESETS), n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise ConfigError(f"model_variant={variant}: not one of fms-fsdp's get_model_config presets{hint}; "
                          f"they are {', '.join(PRESETS)} (and {', '.join(MAMBA_VARIANTS)})")
    c = {**LLAMA_DEFAULTS, **PRESETS[variant]}
    return {
        "num_layers": c["nlayers"], "hidden_size": c["emb_dim"],
        "ffn_hidden_size": fms_hidden_dim(c["emb_dim"], c["hidden_grow_factor"], c["multiple_of"]),
        "num_attention_heads": c["nheads"], "num_kv_heads": c["kvheads"] or c["nheads"],
        "vocab_size": c["src_vocab_size"], "make_vocab_size_divisible_by": 1,
        "max_position_embeddings": c["max_expected_seq_len"], "rope_theta": c["rope_theta"],
        "layernorm_epsilon": c["norm_eps"], "normalization": "rmsnorm", "activation": "swiglu",
        "position_embedding_type": "rope", "has_bias": False, "share_embeddings_and_output_weights": False,
    }


def preset_parameters(variant: str) -> int:
    """Parameters of a preset's model, counted from its dimensions (embedding, blocks, norm, head)."""
    m = preset_model(variant)
    h, f, v = m["hidden_size"], m["ffn_hidden_size"], m["vocab_size"]
    head_dim = h // m["num_attention_heads"]
    attention = 2 * h * h + 2 * h * m["num_kv_heads"] * head_dim
    block = attention + 3 * h * f + 2 * h
    return 2 * v * h + m["num_layers"] * block + h


# ----------------------------------------------------------------------------- reading fms-fsdp's forms
def _one_line(text: Any) -> str:
    return " ".join(str(text).split())


def parse_cli_value(text: str) -> Any:
    """A `--key=value` value as python-fire parses it: a Python literal when it is one (False, 3e-4,
    None, 7725,500 -> a tuple), else the string."""
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return text
    return list(value) if isinstance(value, tuple) else value


def fire_pairs(argv: list[str], own: set[str]) -> list[str]:
    """python-fire's `--key value` spelling joined into `--key=value` (fire takes both): a `--key` that
    is not one of the command's `own` options and is followed by a word not starting with '-' takes
    that word as its value."""
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        takes = arg.startswith("--") and arg[2:3] != "-" and "=" not in arg and arg not in own
        if takes and i + 1 < len(argv) and not argv[i + 1].startswith("-"):
            out.append(f"{arg}={argv[i + 1]}")
            i += 2
        else:
            out.append(arg)
            i += 1
    return out


def read_fms(files: list[str], args: list[str]) -> tuple[dict[str, Any], dict[str, str]]:
    """fms-fsdp's train_config fields from YAML/JSON files then `--key=value` arguments (later ones
    override): (fields, field -> where it came from)."""
    fields: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for path in files:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"{path}: no such file")
        try:
            data = yaml.safe_load(p.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
            raise ConfigError(f"{path}: not valid YAML/JSON: {_one_line(err)}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a mapping of fms-fsdp train_config fields at the top level")
        for key, value in data.items():
            fields[str(key)] = value
            origin[str(key)] = path
    for arg in args:
        if not arg.startswith("--") or len(arg) < 3:
            raise ConfigError(f"{arg}: expected fms-fsdp's --key=value (as in scripts/train.sh)")
        key, eq, text = arg[2:].partition("=")
        fields[key] = parse_cli_value(text) if eq else True  # fire: a bare --flag is True
        origin[key] = "command line"
    return fields, origin


def _typed(key: str, value: Any) -> Any:
    """A field's value checked against train_config's type (one line naming it when wrong)."""
    def bad(kind: str):
        return ConfigError(f"fms-fsdp {key}: expected {kind}, got {value!r}")

    if value is None and key in OPTIONAL_FIELDS:
        return None
    if key in BOOL_FIELDS:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise bad("true or false")
    if key in INT_FIELDS:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise bad("an integer")
    if key in FLOAT_FIELDS:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise bad("a number")
    return value


def comma_items(key: str, value: Any, kind: type) -> list:
    """fms-fsdp's parse_data_args: a comma string, a list or one value -> a list of `kind` (str, float, int)."""
    items = [v.strip() for v in value.split(",") if v.strip()] if isinstance(value, str) else (
        list(value) if isinstance(value, (list, tuple)) else [value])
    if kind is str:
        return [str(v) for v in items]
    out = []
    for v in items:
        try:
            x = float(v)
        except (TypeError, ValueError):
            x = None
        if x is None or isinstance(v, bool) or (kind is int and x != int(x)):
            raise ConfigError(f"fms-fsdp {key}: expected comma-separated {'integers' if kind is int else 'numbers'}"
                              f", got {value!r}")
        out.append(int(x) if kind is int else x)
    return out


def checkpoint_fraction(value: Any) -> float:
    """selective_checkpointing: a number or a fraction string such as '1/3' (fms-fsdp evals it)."""
    try:
        p = float(Fraction(str(value).strip())) if isinstance(value, str) else float(value)
    except (ValueError, ZeroDivisionError, TypeError):
        raise ConfigError(f"fms-fsdp selective_checkpointing: expected a fraction in [0, 1] such as 0.5 or 1/3, "
                          f"got {value!r}") from None
    if not 0 <= p <= 1:
        raise ConfigError(f"fms-fsdp selective_checkpointing: expected a fraction in [0, 1], got {value!r}")
    return p


# ----------------------------------------------------------------------------- the mapping
class FmsMapper:
    """fms-fsdp fields (as read by read_fms) -> an Output of nxdt keys, comments and the listed fields."""

    def __init__(self, fields: dict[str, Any], origin: dict[str, str], num_gpus: int | None = None,
                 num_nodes: int | None = None):
        self.given = dict(fields)
        self.origin = origin
        self.out = Output()
        self.gpus, self.nodes = num_gpus or 8, num_nodes or 1  # scripts/train.sh: 8 per node
        unknown = [k for k in fields if k not in FIELDS]
        for key in unknown:
            close = difflib.get_close_matches(key, list(FIELDS), n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            # fms-fsdp's update_config prints "Warning: unknown parameter" and goes on
            self.out.add("unknown", key, fields[key], f"not a train_config field (fms-fsdp warns and ignores it; given "
                                                      f"in {origin.get(key, '?')}){hint}")
        self.f = {k: _typed(k, fields.get(k, DEFAULTS[k])) for k in FIELDS}

    def run(self) -> Output:
        self._model()
        self._data()
        self._training()
        self._logging()
        for key in self.given:  # tracker and ckpt_load_path are listed by _logging when they do not act
            if key in FIELDS and FIELDS[key][0] != "mapped" and key not in ("tracker", "ckpt_load_path"):
                self.out.add(FIELDS[key][0], key, self.given[key], FIELDS[key][1])
        return self.out

    def _model(self) -> None:
        o, f = self.out, self.f
        o.set("name", "fms")
        o.set("model_source", "megatron")
        o.set("seed", f["seed"], "seed")
        variant = str(f["model_variant"])
        if "model_variant" not in self.given:
            raise ConfigError("model_variant: not given, and train_config's default '7b' is not one of "
                              f"get_model_config's presets; give one of {', '.join(PRESETS)}")
        for key, value in preset_model(variant).items():
            o.set(f"model.{key}", value, f"model_variant {variant}" if key == "num_layers" else None)
        o.set("model.encoder_seq_length", f["seq_length"], "seq_length")
        o.set("model.use_torch_compile", f["use_torch_compile"], "use_torch_compile")
        if f["fsdp_activation_checkpointing"]:
            p = checkpoint_fraction(f["selective_checkpointing"])
            if p > 0:
                o.set("model.selective_checkpointing", p, "fsdp_activation_checkpointing + selective_checkpointing")
        lr = f["learning_rate"]
        sched: dict[str, Any]
        if f["training_stage"] == "annealing":
            sched = {"name": "LinearAnnealingWithWarmUp", "warmup_steps": 0}
        else:
            sched = {"name": "CosineAnnealing", "warmup_steps": min(2000, f["num_steps"] // 20),
                     "constant_steps": 0, "min_lr": float(f"{0.1 * lr:.12g}")}
            if f["training_stage"] != "initial":
                o.notices.append(f"training_stage={f['training_stage']}: fms-fsdp takes anything but 'annealing' "
                                 "as 'initial' (warmup then cosine)")
        o.set("model.optim", {"name": "adamw", "lr": lr, "betas": [0.9, 0.95], "weight_decay": 0.1, "eps": 1e-8,
                              "sched": sched},
              f"learning_rate; main_training_llama.py's AdamW; training_stage {f['training_stage']}")

    def _data(self) -> None:
        o, f = self.out, self.f
        world = self.gpus * self.nodes
        o.set("data.micro_batch_size", f["batch_size"], "batch_size")
        o.set("data.global_batch_size", f["batch_size"] * world,
              f"batch_size x {world} ranks (fms-fsdp does not accumulate)")
        o.set("data.seq_length", f["seq_length"], "seq_length")
        if f["use_dummy_dataset"]:
            o.set("data.use_dummy_dataset", True, "use_dummy_dataset")
        o.set("data.data_path", f["data_path"], "data_path")
        datasets = comma_items("datasets", f["datasets"], str)
        weights = comma_items("weights", f["weights"], float)
        if len(weights) != len(datasets):
            raise ConfigError(f"fms-fsdp weights: {len(weights)} weights for {len(datasets)} datasets")
        o.set("data.datasets", datasets, "datasets")
        o.set("data.weights", weights, "weights")
        o.set("data.splits_string", "100,0,0", "fms-fsdp trains on every document (no validation split)")
        o.set("data.file_type", str(f["file_type"]), "file_type")
        o.set("data.col_name", str(f["col_name"]), "col_name")
        for key, nxdt in (("bos_token", "bos_token"), ("eos_token", "sep_token"), ("bol_token", "bol_token"),
                          ("eol_token", "eol_token")):
            if f[key] is not None:
                o.set(f"data.{nxdt}", f[key], key)
        strip = comma_items("strip_tokens", f["strip_tokens"], int)
        if strip:
            o.set("data.strip_tokens", strip, "strip_tokens")
        o.set("data.logical_shards", f["logical_shards"], "logical_shards")
        o.set("data.num_workers", f["num_workers"], "num_workers")
        if "tokenizer_path" in self.given or f["file_type"] != "arrow":
            o.set("data.tokenizer.library", "huggingface")
            o.set("data.tokenizer.type", str(f["tokenizer_path"]), "tokenizer_path")
        else:
            o.notices.append("tokenizer_path not given: fms-fsdp reads no tokenizer for arrow shards; nxdt checks the "
                             "shards' ids against data.tokenizer, left at nxdt's bundled tokenizer (8192 ids): set "
                             "data.tokenizer.type to the tokenizer the shards were made with")
        if str(f["file_type"]) not in ("arrow", "hf_parquet", "auto"):
            raise ConfigError(f"fms-fsdp file_type: '{f['file_type']}' is not one of fms-fsdp's arrow, hf_parquet, auto")

    def _training(self) -> None:
        o, f = self.out, self.f
        o.set("trainer.devices", self.gpus, "GPUs per node (--num-gpus; torchrun's --nproc_per_node)")
        o.set("trainer.num_nodes", self.nodes, "--num-nodes")
        o.set("trainer.max_steps", f["num_steps"], "num_steps")
        o.set("trainer.gradient_clip_val", f["grad_clip_thresh"], "grad_clip_thresh")
        strategy = str(f["sharding_strategy"])
        if strategy not in ("fsdp", "hsdp", "ddp"):
            o.notices.append(f"sharding_strategy={strategy}: fms-fsdp builds FULL_SHARD for anything but fsdp, hsdp "
                             "and ddp: FSDP")
            strategy = "fsdp"
        o.set("distributed_strategy.sharding_strategy", {"fsdp": "FSDP", "hsdp": "HSDP", "ddp": "DDP"}[strategy],
              "sharding_strategy" + (" (shards within a node, replicas across nodes)" if strategy == "hsdp" else ""))
        if f["low_cpu_fsdp"]:
            o.set("distributed_strategy.low_cpu_fsdp", True, "low_cpu_fsdp")
        if f["mixed_precision"]:
            o.set("precision.type", "mixed_precision", "mixed_precision (bf16 compute, fp32 sharded parameters)")
            o.set("precision.grad_reduce_dtype", "bf16", "mixed_precision: fms-fsdp's bfSixteen reduces in bf16")
        else:
            o.set("precision.type", "fp32", "mixed_precision false")

    def _logging(self) -> None:
        o, f = self.out, self.f
        o.set("trainer.log_every_n_steps", f["report_interval"], "report_interval")
        o.set("exp_manager.explicit_log_dir", str(f["ckpt_save_path"]), "ckpt_save_path")
        o.set("exp_manager.checkpoint_callback_params.every_n_train_steps", f["checkpoint_interval"],
              "checkpoint_interval")
        o.set("exp_manager.checkpoint_callback_params.save_top_k", -1, "fms-fsdp keeps every checkpoint")
        load, save = str(f["ckpt_load_path"]).rstrip("/"), str(f["ckpt_save_path"]).rstrip("/")
        o.set("exp_manager.resume_if_exists", load == save, "ckpt_load_path = ckpt_save_path" if load == save else
              "ckpt_load_path is another folder: not read")
        if load == save:
            o.set("exp_manager.resume_ignore_no_checkpoint", True, "fms-fsdp starts fresh without a checkpoint")
        if load != save and "ckpt_load_path" in self.given:
            o.add("not mapped", "ckpt_load_path", self.given["ckpt_load_path"],
                  "another run's fms-fsdp checkpoint: nxdt does not read fms-fsdp's checkpoints")
        if f["use_profiler"]:
            o.set("exp_manager.profiler", {"enabled": True, "wait": 1, "warmup": 2, "active": 3, "repeat": 1,
                                           "ranks": [0] if f["profiler_rank0_only"] else
                                           list(range(self.gpus * self.nodes)),
                                           "record_shapes": True, "profile_memory": True},
                  "use_profiler (fms-fsdp's schedule)")
        tracker = f["tracker"]
        if tracker == "wandb":
            kwargs = {"project": str(f["tracker_project_name"]), "save_dir": str(f["tracker_dir"])}
            if f["tracker_run_id"]:
                kwargs["id"] = str(f["tracker_run_id"])
            o.set("exp_manager.create_wandb_logger", True, "tracker wandb")
            o.set("exp_manager.wandb_logger_kwargs", kwargs, "tracker_project_name, tracker_dir, tracker_run_id")
        elif tracker is not None:
            o.add("not mapped", "tracker", tracker, "nxdt has no Aim logger: TensorBoard (and W&B, MLflow) instead")
