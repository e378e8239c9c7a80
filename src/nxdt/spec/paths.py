"""Checks of the paths a config names, run before the process group starts (validation's last stage).

Files the run reads must exist (data, tokenizer, transformers config.json, the checkpoint to
resume); the directory it writes must be one it can make or write in (a log dir that is a file
or in a read-only place is one line here, not a FileExistsError traceback on rank 0 later).
Each problem is one line naming the key and the path; all of a config's problems are reported
together, in one ConfigError (a first line saying how many, then a line each). Imports no torch.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from nxdt.spec.data import parse_data_prefix
from nxdt.config.errors import ConfigError, ConfigErrors

# the files of a data.datasets shard folder (nxdt.data.arrow_shards reads them)
SHARD_SUFFIXES = (".arrow", ".parquet")
# how to make the Megatron .bin/.idx files that data.data_prefix names
MAKE_DATA_HINT = ("make them with: nxdt preprocess --input CORPUS.jsonl --tokenizer DIR --output-prefix PREFIX; "
                  "the bundled corpus: make data")


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def hub_id_hint(value: Any) -> str:
    """For a path that does not exist and reads as a Hugging Face hub id (`org/name`), how to get the
    folder: nxdt reads from disk only. Empty for anything else."""
    text = str(value)
    if os.path.exists(os.path.expanduser(text)) or not _HUB_ID.fullmatch(text):
        return ""
    return (f"'{text}' looks like a Hugging Face hub id; nxdt downloads nothing: download it first with "
            f"hf download {text} --local-dir DIR (or huggingface-cli download) and pass the folder")


class PathProblems:
    """The path problems of one config, collected so that all are reported at once (`check_files`).
    `look`: True, every file is looked at; False, none; a tuple of keys, only theirs. A key whose
    file is not looked at is recorded in `skipped` instead (`nxdt plan` lists them as not checked);
    the rules that need no file (a data source is named) run either way."""

    def __init__(self, look: bool | tuple[str, ...] = True) -> None:
        self.look = look
        self.problems: list[str] = []
        self.skipped: list[str] = []

    def add(self, message: str) -> None:
        self.problems.append(message)

    def skip(self, key: str) -> bool:
        """True (and `key` recorded as not checked) when files are not looked at."""
        looked = self.look if isinstance(self.look, bool) else key in self.look
        shown = key.split(" (")[0]  # the key alone, not its note
        if not looked and shown not in self.skipped:
            self.skipped.append(shown)
        return not looked

    def need(self, path: Any, key: str, what: str = "file", kind: str = "any", hint: str = "") -> bool:
        """`path` exists (as a `kind`: dir, file or any); else a problem naming the key. False if it is missing."""
        if self.skip(key):
            return True
        p = Path(os.path.expanduser(str(path)))
        ok = p.is_dir() if kind == "dir" else p.is_file() if kind == "file" else p.exists()
        if not ok:
            shown = p if p.is_absolute() else os.path.abspath(p)
            self.add(f"{key}: {what} not found: {shown}" + (f" ({hint})" if hint else ""))
        return ok

    def raise_any(self) -> None:
        """One ConfigError: the one problem as its line, or every problem under a line saying how many."""
        if len(self.problems) == 1:
            raise ConfigError(self.problems[0])
        if self.problems:
            raise ConfigErrors(f"{len(self.problems)} missing or unusable paths:", self.problems)


def _has_shards(folder: Path) -> bool:
    """A .arrow / .parquet file anywhere under `folder` (what nxdt.data.arrow_shards reads)."""
    return any(name.endswith(SHARD_SUFFIXES) for _, _, names in os.walk(folder) for name in names)


def dataset_path(entry: Any, data_path: Any) -> str:
    """A data.datasets entry as a path: a relative one is under data.data_path (fms-fsdp) when set."""
    return os.path.join(os.path.expanduser(str(data_path)), str(entry)) if data_path else str(entry)


def is_shard_folder(path: str) -> bool:
    """A dataset read as a folder of arrow / parquet shards: a directory, unless PREFIX.bin and
    PREFIX.idx sit beside it (then it is Megatron data, as before shard folders existed)."""
    return os.path.isdir(path) and not all(os.path.isfile(f"{path}{ext}") for ext in (".bin", ".idx"))


def _check_dataset(entry: Any, data_path: Any, key: str, found: PathProblems) -> None:
    """One data.datasets entry: a folder holding arrow / parquet shards (fms-fsdp), else a Megatron
    prefix with its .bin and .idx."""
    if found.skip(key):
        return
    p = Path(dataset_path(entry, data_path))
    megatron = [Path(f"{p}{ext}").is_file() for ext in (".bin", ".idx")]
    if is_shard_folder(str(p)):
        if not _has_shards(p):
            found.add(f"{key}: {p.absolute()} has no .arrow or .parquet shards")
        return
    if not any(megatron):
        found.add(f"{key}: not found: {p.absolute()} (a folder of .arrow / .parquet shards, or a Megatron "
                  f"prefix of .bin/.idx files; {MAKE_DATA_HINT})")
        return
    for ext in (".bin", ".idx"):
        if not found.need(f"{p}{ext}", key, "indexed dataset file", "file", MAKE_DATA_HINT):
            break


def _writable_dir(path: Any, key: str) -> str | None:
    """`path` is a directory this process can write in, or one it can make: refused before the
    process group starts rather than as a FileExistsError / PermissionError traceback later.
    Returns the problem (None: none)."""
    p = Path(os.path.expanduser(str(path))).absolute()
    if p.exists() and not p.is_dir():
        return f"{key}: {p} is a file, not a directory"
    parent = p
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        return f"{key}: cannot make {p}: {parent} is a file"
    if not os.access(parent, os.W_OK | os.X_OK):
        what = "write in" if parent == p else f"make {p} in"
        return f"{key}: cannot {what} {parent} (permission denied)"
    return None


def check_log_dir(cfg: Any, found: PathProblems | None = None) -> None:
    """Where the run writes (nxdt.exp.exp_manager.resolve_dirs): explicit_log_dir, else
    exp_dir/name (exp_dir null: ./nxdt_experiments). Evaluation writes beside the checkpoint instead.
    Without `found`: a ConfigError for the problem."""
    exp = cfg.exp_manager
    if cfg.trainer.max_epochs == 0:
        return
    if exp.explicit_log_dir:
        path, key = exp.explicit_log_dir, "exp_manager.explicit_log_dir"
    else:
        key = "exp_manager.exp_dir" if exp.exp_dir else "exp_manager.exp_dir (null: ./nxdt_experiments)"
        path = Path(exp.exp_dir or "nxdt_experiments") / (exp.name or cfg.name)
    if found is not None and found.skip(key):
        return
    problem = _writable_dir(path, key)
    if problem and found is None:
        raise ConfigError(problem)
    if problem:
        found.add(problem)


def _check_data_files(cfg: Any, found: PathProblems) -> None:
    """The data source a config must name, and the files of data.* (not data.tokenizer)."""
    data = cfg.data
    mas = cfg.model_alignment_strategy
    shipped_prompts = mas is not None and mas.grpo is not None and mas.grpo.task is not None  # GRPO's own task
    has_source = (data.data_prefix is not None or data.train_dir is not None or data.use_dummy_dataset
                  or data.datasets is not None or shipped_prompts)
    if cfg.model_source == "megatron" and not has_source:
        found.add("data.data_prefix is required for model_source megatron "
                  "(or set data.train_dir, data.use_dummy_dataset or data.data_module)")
    if cfg.model_source == "hf" and not has_source:
        found.add("data.train_dir is required for model_source hf "
                  "(or set data.data_prefix, data.use_dummy_dataset or data.data_module)")
    if data.data_prefix is not None and not data.use_dummy_dataset:
        for p in parse_data_prefix(data.data_prefix).paths:
            for ext in (".bin", ".idx"):  # one problem per prefix: its first missing file
                if not found.need(str(p) + ext, "data.data_prefix", "indexed dataset file", "file", MAKE_DATA_HINT):
                    break
    for key in ("train_dir", "val_dir", "test_dir"):
        if getattr(data, key) is not None:
            found.need(getattr(data, key), f"data.{key}", "data path")
    if data.datasets is not None and not data.use_dummy_dataset:
        for i, p in enumerate(data.datasets):
            _check_dataset(p, data.data_path, f"data.datasets[{i}]", found)


def path_problems(cfg: Any, look: bool | tuple[str, ...] = True) -> PathProblems:
    """Every path problem of a config, in the order of its keys (see PathProblems for `look`)."""
    found = PathProblems(look)
    data, model = cfg.data, cfg.model
    if data.data_module is None:
        _check_data_files(cfg, found)
    tok = data.tokenizer
    if tok.library == "huggingface" and tok.type is not None:
        found.need(tok.type, "data.tokenizer.type", "tokenizer directory", "dir", hub_id_hint(tok.type))
    for key in ("model", "vocab_file", "merge_file"):
        if getattr(tok, key) is not None:
            found.need(getattr(tok, key), f"data.tokenizer.{key}", "tokenizer file", "file")
    if cfg.model_source == "hf" and model.model_config is not None:
        found.need(model.model_config, "model.model_config", "transformers config.json", "file")
    if cfg.exp_manager.resume_from_checkpoint is not None:
        found.need(cfg.exp_manager.resume_from_checkpoint, "exp_manager.resume_from_checkpoint", "checkpoint")
    check_log_dir(cfg, found)
    return found


def check_files(cfg: Any, look: bool | tuple[str, ...] = True) -> list[str]:
    """Every path problem of a config as one ConfigError (one line, or a line per problem under a
    first line saying how many). `look` (see PathProblems): False, only the rules that need no file
    (a data source is named); returns the keys whose files were not looked at (empty when all were)."""
    found = path_problems(cfg, look)
    found.raise_any()
    return found.skipped
