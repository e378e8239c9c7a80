"""`nxdt import-config neox`: an nxdt YAML from GPT-NeoX config files.

    nxdt import-config neox FILE.yml [FILE2.yml ...] --output conf/NAME.yaml
                       [--num-gpus G] [--num-nodes N] [--vocab-size V] [--name NAME]

The files are merged as NeoX's `deepy.py` merges them: top-level keys in file order, '-' and '_'
in key names meaning the same (`num-layers` = `num_layers`); a later file's key overrides an
earlier one's (NeoX itself refuses a key repeated with the same spelling; the override is listed
in the output's header). NeoX YAML is plain YAML: Python-style True/False and comments are fine.

The output is an nxdt config (megatron model source) for the same model and training run:
shape and block type (GPT-NeoX's parallel residual = `transformer_block_type: gpt_j`), partial
rotary, vocabulary padding, parallelism and ZeRO stage, optimizer and LR decay, fp16/bf16, batch
sizes, data blend, tokenizer, activation checkpointing, checkpoints and evaluation. The mapping
is in nxdt.tools.neox_mapping and in docs/models.md ("Coming from GPT-NeoX"). Every NeoX key it
does not map is listed once, in a comment block at the end of the output and on stdout.

World size: NeoX takes the number of GPUs from its launcher; here it is --num-gpus (per node)
x --num-nodes, else the files' num_gpus / num_nodes, else one node of tp x pp GPUs (data
parallel 1). global_batch_size = micro batch x gradient accumulation x data parallel, so pass
the GPUs the NeoX config was written for.

The output is checked by nxdt's validator before it is written; on any problem (a file that is
missing, does not parse or is not a mapping; a value of the wrong type; an output that does not
validate) one line goes to stderr, the exit code is 2 and --output is left untouched.
This module and nxdt.tools.neox_mapping do not import torch.

    nxdt import-config fms [FILE.yaml|FILE.json ...] [--key=value ...] --output conf/NAME.yaml
                       [--num-gpus G] [--num-nodes N] [--name NAME]

fms-fsdp's train_config fields, from files and/or its own `--key=value` (or fire's `--key value`)
arguments (scripts/train.sh; values parsed as python-fire parses them), files first. The table of every field is
nxdt.tools.fms_mapping (docs/migrating-from-fms-fsdp.md); the output, the listed fields and the
errors follow the NeoX importer's rules above.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

from nxdt.config.errors import ConfigError
from nxdt.config.load import compose
from nxdt.spec import check_not_supported, validate
from nxdt.tools.fms_mapping import FIELDS as FMS_FIELDS
from nxdt.tools.fms_mapping import FMS_COMMIT, FmsMapper, fire_pairs, read_fms
from nxdt.tools.neox_mapping import NeoxMapper

# top-level order of the written YAML (as in the shipped configs)
SECTIONS = ("name", "model_source", "seed", "trainer", "exp_manager", "distributed_strategy", "data", "model",
            "precision")
FORMATS = ("neox", "fms")
CATEGORIES = ("not mapped", "approximated", "inert", "unknown")


# --------------------------------------------------------------------------- reading NeoX files
def _one_line(text: Any) -> str:
    return " ".join(str(text).split())


def read_neox(paths: list[str]) -> tuple[dict[str, Any], dict[str, tuple[str, str]], list[tuple[str, str, str]]]:
    """Merge NeoX YAML files in order: (merged config with '-' turned into '_' in top-level keys,
    key -> (file, key as spelled there), [(key, earlier file, later file)] for each override)."""
    merged: dict[str, Any] = {}
    origin: dict[str, tuple[str, str]] = {}
    overrides: list[tuple[str, str, str]] = []
    for path in paths:
        p = Path(path)
        if not p.exists():
            raise ConfigError(f"{path}: no such file")
        if not p.is_file():
            raise ConfigError(f"{path}: not a file")
        try:
            text = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise ConfigError(f"{path}: cannot read: {_one_line(err)}") from None
        try:
            data = yaml.safe_load(text)
        except yaml.MarkedYAMLError as err:
            mark = err.problem_mark or err.context_mark
            line = f" at line {mark.line + 1}" if mark is not None else ""
            raise ConfigError(f"{path}: not valid YAML{line}: {_one_line(err.problem or err.context)}") from None
        except yaml.YAMLError as err:
            raise ConfigError(f"{path}: not valid YAML: {_one_line(err)}") from None
        if not isinstance(data, dict):
            got = "an empty file" if data is None else f"a {type(data).__name__}"
            raise ConfigError(f"{path}: expected a mapping of NeoX keys at the top level, got {got}")
        for raw_key, value in data.items():
            key = str(raw_key).replace("-", "_")
            if key in origin and origin[key][0] != path:
                overrides.append((str(raw_key), origin[key][0], path))
            merged[key] = value
            origin[key] = (path, str(raw_key))
    return merged, origin, overrides


# --------------------------------------------------------------------------- writing YAML
def _scalar(value: Any) -> str:
    text = yaml.safe_dump(value, default_flow_style=True, width=10**9, allow_unicode=True, sort_keys=False).strip()
    if text.endswith("..."):
        text = text[:-3].strip()
    return text


def _emit(values: dict, comments: dict[str, str], prefix: str = "", depth: int = 0) -> list[str]:
    lines: list[str] = []
    keys = list(values)
    if depth == 0:
        keys = [k for k in SECTIONS if k in values] + [k for k in keys if k not in SECTIONS]
    for key in keys:
        value, dotted, pad = values[key], f"{prefix}{key}", "  " * depth
        note = f"  # {comments[dotted]}" if comments.get(dotted) else ""
        if isinstance(value, dict) and value:
            if depth == 0 and lines and lines[-1] != "":
                lines.append("")
            lines.append(f"{pad}{key}:{note}")
            lines += _emit(value, comments, dotted + ".", depth + 1)
        else:
            lines.append(f"{pad}{key}: {_scalar(value)}{note}")
    return lines


def unmapped_lines(listed: list[tuple[str, str, str, str]], source: str = "NeoX") -> list[str]:
    """The block of `source` keys that were not mapped, grouped by category (no comment marks)."""
    rows = sorted(listed, key=lambda r: (CATEGORIES.index(r[0]) if r[0] in CATEGORIES else 9, r[1]))
    head = [f"{source} keys not mapped: {len(rows)}" + (" (every key was mapped)" if not rows else ""),
            f"(not mapped: nxdt has no equivalent, the run differs from {source} there; approximated: the closest "
            f"nxdt setting; inert: no effect in nxdt; unknown: not a {source} key import-config knows)"]
    return head + [f"  {cat:<12} {key} = {value}: {why}" for cat, key, value, why in rows]


def render(name: str, out: Any, command: str, files: list[str], overrides: list[tuple[str, str, str]]) -> str:
    values = dict(out.values)
    values["name"] = name
    header = [
        f"{name}: a GPT-NeoX config imported by nxdt import-config (docs/models.md, \"Coming from GPT-NeoX\").",
        "",
        f"  {command}",
        "",
        "Merged in order (a later file's key overrides an earlier one's; '-' and '_' in NeoX key names are the same):",
        *[f"  {f}" for f in files],
        *[f"Overridden: {key} ({old} -> {new})" for key, old, new in overrides],
        "global_batch_size = micro batch x gradient accumulation x data parallel (world / (tp x pp)), with the",
        "world of trainer.devices x trainer.num_nodes: re-import with --num-gpus / --num-nodes for other GPU counts.",
        "The NeoX keys not mapped are listed at the end.",
    ]
    lines = [f"# {h}".rstrip() for h in header] + [""]
    lines += _emit(values, out.comments)
    lines += ["", "# " + "-" * 98]
    lines += [f"# {h}".rstrip() for h in unmapped_lines(out.listed)]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- validation
def validate_text(text: str) -> tuple[Any, list[str]]:
    """Load `text` as a config file through nxdt's loader and validator (no file checks, features not
    built yet allowed); returns (typed config, notices). ConfigError when it does not validate."""
    notices: list[str] = []
    with tempfile.TemporaryDirectory(prefix="nxdt-import-") as tmp:
        (Path(tmp) / "imported.yaml").write_text(text, encoding="utf-8")
        try:
            cfg = compose(["--config-path", tmp, "--config-name", "imported"], notices=notices)
            typed = validate(cfg, check_paths=False, check_supported=False, notices=notices)
        except ConfigError as err:
            raise ConfigError(f"the imported config does not validate (nothing written): {err}") from None
    try:
        check_not_supported(typed)
    except ConfigError as err:
        notices.append(f"nxdt validates this config but cannot train it yet: {err}")
    return typed, notices


# --------------------------------------------------------------------------- entry point
def import_neox(files: list[str], *, name: str, command: str, num_gpus: int | None = None,
                num_nodes: int | None = None, vocab_size: int | None = None) -> tuple[str, Any, list[str]]:
    """(YAML text, Output, notices) for NeoX `files`; ConfigError on bad input."""
    merged, origin, overrides = read_neox(files)
    out = NeoxMapper(merged, origin, num_gpus=num_gpus, num_nodes=num_nodes, vocab_size=vocab_size).run()
    text = render(name, out, command, files, overrides)
    _, notices = validate_text(text)
    return text, out, out.notices + notices


def import_fms(files: list[str], args: list[str], *, name: str, command: str, num_gpus: int | None = None,
               num_nodes: int | None = None) -> tuple[str, Any, list[str]]:
    """(YAML text, Output, notices) for fms-fsdp's train_config fields in `files` (YAML/JSON) and
    `args` (`--key=value`, as scripts/train.sh passes them); ConfigError on bad input."""
    fields, origin = read_fms(files, args)
    out = FmsMapper(fields, origin, num_gpus=num_gpus, num_nodes=num_nodes).run()
    values = dict(out.values)
    values["name"] = name
    header = [
        f"{name}: an fms-fsdp train_config imported by nxdt import-config (docs/migrating-from-fms-fsdp.md).",
        "", f"  {command}", "",
        f"fms-fsdp {FMS_COMMIT}: {len(FMS_FIELDS)} train_config fields; those given: "
        + (", ".join(files) or "no file") + (f" + {len(args)} --key=value arguments" if args else ""),
        "Fields left out take train_config's defaults (fms_fsdp/config/training.py).",
        "global_batch_size = batch_size x trainer.devices x trainer.num_nodes: re-import with --num-gpus / "
        "--num-nodes for other GPU counts.",
    ]
    lines = [f"# {h}".rstrip() for h in header] + [""] + _emit(values, out.comments)
    lines += ["", "# " + "-" * 98]
    lines += [f"# {h}".rstrip() for h in unmapped_lines(out.listed, "fms-fsdp")]
    text = "\n".join(lines) + "\n"
    _, notices = validate_text(text)
    return text, out, out.notices + notices


def _positive(flag: str, value: int | None) -> int | None:
    if value is not None and value < 1:
        raise ConfigError(f"{flag}: must be >= 1, got {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="nxdt import-config", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    parser.add_argument("format", choices=FORMATS, help="the source config format (neox: GPT-NeoX's YAML; fms: "
                                                        "fms-fsdp's train_config fields)")
    parser.add_argument("files", nargs="*", help="NeoX YAML files, merged in order (later ones override); fms: "
                                                 "YAML/JSON files of train_config fields, then --key=value arguments")
    parser.add_argument("--output", "-o", required=True, help="the nxdt YAML to write (e.g. conf/NAME.yaml)")
    parser.add_argument("--num-gpus", type=int, default=None,
                        help="GPUs per node (default: the files' num_gpus, else tp x pp)")
    parser.add_argument("--num-nodes", type=int, default=None, help="nodes (default: the files' num_nodes, else 1)")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="tokenizer size before padding (default: counted from a local tokenizer.json, else "
                             "50277 for HFTokenizer (GPT-NeoX-20B's), 50257 for GPT-2)")
    parser.add_argument("--name", default=None, help="the config's name (default: the --output file name)")
    if argv[:1] == ["fms"]:  # fire's `--key value` as `--key=value`
        argv = ["fms", *fire_pairs(argv[1:], {o for a in parser._actions for o in a.option_strings})]
    args, extra = parser.parse_known_args(argv)
    fms_args = [a for a in extra if args.format == "fms" and a.startswith("--") and a[2:3] != "-"]
    if len(fms_args) != len(extra) or (args.format == "neox" and not args.files):
        parser.parse_args(argv)  # argparse's own message (exit 2) for what neither format takes
    if args.format == "fms" and not (args.files or fms_args):
        raise ConfigError("import-config fms: give a YAML/JSON file of train_config fields or --key=value arguments")
    for flag in ("num_gpus", "num_nodes", "vocab_size"):
        _positive("--" + flag.replace("_", "-"), getattr(args, flag))
    output = Path(args.output)
    if output.is_dir():
        raise ConfigError(f"--output {output}: is a directory; give a file name like conf/NAME.yaml")
    if not output.parent.is_dir() and str(output.parent) not in ("", "."):
        raise ConfigError(f"--output {output}: directory {output.parent} does not exist")
    name = args.name or output.name.rsplit(".", 1)[0]
    command = shlex.join(["nxdt", "import-config", *argv])
    if args.format == "fms":
        text, out, notices = import_fms(args.files, fms_args, name=name, command=command, num_gpus=args.num_gpus,
                                        num_nodes=args.num_nodes)
    else:
        text, out, notices = import_neox(args.files, name=name, command=command, num_gpus=args.num_gpus,
                                         num_nodes=args.num_nodes, vocab_size=args.vocab_size)
    fd, tmp = tempfile.mkstemp(prefix=f".{output.name}.", dir=str(output.parent or "."))
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, output)
    except OSError as err:
        Path(tmp).unlink(missing_ok=True)
        raise ConfigError(f"--output {output}: cannot write: {_one_line(err)}") from None
    for notice in dict.fromkeys(notices):
        print(f"notice: {notice}", file=sys.stderr)
    source = "NeoX file(s)" if args.format == "neox" else f"fms-fsdp file(s) and {len(fms_args)} argument(s)"
    print(f"wrote {output} from {len(args.files)} {source}")
    for line in unmapped_lines(out.listed, "NeoX" if args.format == "neox" else "fms-fsdp"):
        print(line)
    return 0


if __name__ == "__main__":
    from nxdt.config.load import main_guard

    sys.exit(main_guard(main)())
