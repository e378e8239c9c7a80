"""Every value checked before the run, and nothing silently ignored (issue 17 items 7-9).

- Every int/float key of the schema has a range; a value outside it is one ConfigError naming
  the key (walked over the whole schema, and model.optim's keys).
- Every schema key is read by some module, or is in nxdt.config.inert (inert by design, or
  refused as not supported yet); the settings that have no effect in a run are named in one notice.
- Paths as nxdt prints them can be pasted back as overrides; log dirs and data files are checked
  before the process group starts; the schedule's rule is one function for validation and the builder.
"""

from __future__ import annotations

import ast
import re
import shlex
import typing
from pathlib import Path

import pytest
from conftest import REPO, run_cli_here

from nxdt.config import ConfigError, describe, ranges, schema

from nxdt.spec import load_config
from nxdt.config.inert import BACKENDS, INERT, NOT_SUPPORTED_YET, always_inert, entries, inert_notice
from nxdt.config.load import quote_value
from nxdt.spec import config_from_dict
from nxdt.config.optim_keys import OPTIMIZERS, SCHEDULERS, VALUE_RANGES
from nxdt.spec.paths import MAKE_DATA_HINT
from nxdt.config.typed import select
from nxdt.spec import validate

CONF = REPO / "conf"
SRC = REPO / "src" / "nxdt"


def load(*overrides, name="tiny_llama_cpu", check_paths=False, world_size=2):
    return load_config(["--config-path", str(CONF), "--config-name", name, *overrides], world_size=world_size,
                       check_paths=check_paths, quiet=True)


def error_of(fn, *args, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        fn(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message
    return message


def nested(dotted: str, value) -> dict:
    out: dict = {}
    node = out
    *parents, leaf = dotted.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value
    return out


# ----------------------------------------------------------------------------- ranges
def outside(bounds: dict, is_float: bool) -> list:
    """Values just outside each side of a range (never one of its sentinels)."""
    step = 0.5 if is_float else 1
    found = []
    if "ge" in bounds or "gt" in bounds:
        v = bounds["ge"] - step if "ge" in bounds else bounds["gt"]
        while v in bounds.get("also", ()):
            v -= 1
        found.append(v)
    if "le" in bounds or "lt" in bounds:
        found.append(bounds["le"] + step if "le" in bounds else bounds["lt"])
    return [float(v) if is_float else int(v) for v in found]


def numeric_cases():
    for key, tname, _default, _help, meta in schema.iter_fields():
        names = tname.split(" or ")
        if not ranges.has_range(meta):
            assert "int" not in names and "float" not in names, f"{key} ({tname}) has no range"
            continue
        kinds = [k for k in ("int", "float") if k in names] or (["float"] if "any" in names else ["int"])
        for kind in kinds:
            for bad in outside(ranges.bounds_of(meta, 0.5 if kind == "float" else 1), kind == "float"):
                yield key, ([bad] if "list" in names else bad)


NUMERIC = list(numeric_cases())


def test_every_numeric_key_has_a_range_and_refuses_values_outside_it():
    """The schema walk (the same check_schema a command line goes through, without Hydra's compose
    per key): each out-of-range value is one line naming the key."""
    assert len(NUMERIC) > 100
    for key, bad in NUMERIC:
        message = error_of(config_from_dict, nested(key, bad))
        where = f"{key}[0]" if isinstance(bad, list) else key
        assert message.startswith(f"{where}: must be "), (key, bad, message)
        assert message.endswith(f"got {bad[0] if isinstance(bad, list) else bad}"), message


@pytest.mark.parametrize("override, message", [
    ("trainer.max_steps=-5", "trainer.max_steps: must be >= 1, got -5"),
    ("trainer.max_epochs=-2", "trainer.max_epochs: must be >= 0 or -1, got -2"),
    ("trainer.val_check_interval=1.5", "trainer.val_check_interval: must be in (0, 1], got 1.5"),
    ("trainer.val_check_interval=0", "trainer.val_check_interval: must be >= 1, got 0"),
    ("model.optim.lr=-1", "model.optim.lr: must be >= 0, got -1"),
    ("model.optim.betas=[0.9,1.0]", "model.optim.betas[1]: must be in [0, 1), got 1.0"),
    ("model.optim.sched.warmup_steps=-1", "model.optim.sched.warmup_steps: must be >= 0, got -1"),
    ("exp_manager.profiler.ranks=[0,-1]", "exp_manager.profiler.ranks[1]: must be >= 0, got -1"),
    # the key the user set is named, not data.seq_length that follows it by interpolation
    ("model.encoder_seq_length=0", "model.encoder_seq_length: must be >= 1, got 0"),
])
def test_ranges_through_the_command_line(override, message):
    assert error_of(load, override) == message


def test_sentinels_and_edges_are_accepted():
    cfg = load("trainer.max_epochs=-1", "trainer.val_check_interval=1.0", "trainer.limit_val_batches=0",
               "exp_manager.checkpoint_callback_params.save_top_k=-1", "model.optim.lr=0", "model.optim.sched.min_lr=0",
               "trainer.gradient_clip_val=0")
    assert (cfg.trainer.max_epochs, cfg.trainer.val_check_interval, cfg.trainer.limit_val_batches) == (-1, 1.0, 0)
    assert cfg.exp_manager.checkpoint_callback_params.save_top_k == -1 and cfg.model.optim["lr"] == 0


INT_SCHED_KEYS = ("max_steps", "last_epoch", "warmup_steps", "constant_steps", "hold_steps", "d_model", "step_size")
REQUIRED_SCHED = {"NoamAnnealing": {"d_model": 8}, "StepLR": {"step_size": 1}, "ExponentialLR": {"gamma": 0.9}}


def test_every_optimizer_and_scheduler_range_is_checked():
    """model.optim is an open mapping: its ranges are optim_keys.VALUE_RANGES, per key name."""
    checked = 0
    for key, meta in VALUE_RANGES.items():
        opt = next((n for n, keys in OPTIMIZERS.items() if key in keys), None)
        sched = next((n for n, keys in SCHEDULERS.items() if key in keys), "CosineAnnealing")  # common keys
        is_float = key not in INT_SCHED_KEYS
        pair = opt is not None and isinstance(OPTIMIZERS[opt][key], tuple)  # betas, etas, ...: each checked
        for bad in outside(ranges.bounds_of(meta, 0.5 if is_float else 1), is_float):
            if opt is not None:
                optim, where = {"name": opt, key: [0.5, bad] if pair else bad}, f"model.optim.{key}"
            else:
                optim = {"name": "adamw", "sched": {"name": sched, **REQUIRED_SCHED.get(sched, {}), key: bad}}
                where = f"model.optim.sched.{key}"
            message = error_of(config_from_dict, {"model": {"optim": optim}})
            assert message == f"{where}{'[1]' if pair else ''}: must be {ranges.text(meta)}, got {bad}", message
            checked += 1
    assert checked >= 30


def test_typed_configs_are_range_checked_too():
    cfg = load()
    cfg.trainer.max_steps = 0  # a config changed in code, validated again
    assert error_of(validate, cfg, world_size=2, check_paths=False) == "trainer.max_steps: must be >= 1, got 0"


def test_a_bad_value_through_the_real_entry_is_one_line_exit_2():
    proc = run_cli_here(["--config-name", "tiny_llama_cpu", "model.optim.lr=-1"])
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == ["error: model.optim.lr: must be >= 0, got -1"]


# ----------------------------------------------------------------------------- nothing silently ignored
# Modules that write configs (import-config's NeoX mapping) name keys without reading them.
WRITERS = {"config/schema.py", "config/inert.py", "tools/neox_mapping.py", "tools/neox_training_keys.py",
           "tools/neox_keys.py", "tools/import_config.py"}
IDENT = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def _reads():
    """Per module: names read (attribute accesses, identifier strings such as getattr's) and words."""
    out = {}
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC).as_posix()
        if rel in WRITERS:
            continue
        text = path.read_text(encoding="utf-8")
        names = set()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Attribute):
                names.add(node.attr)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and IDENT.fullmatch(node.value):
                names.update(node.value.split("."))
        out[rel] = (names, set(re.findall(r"\w+", text)))
    return out


def test_every_schema_key_is_read_or_listed_as_inert_or_refused():
    """A key `a.b.leaf` is read when one module reads `leaf` (attribute or getattr string) and names
    its section `b`: `.enabled` alone does not count for exp_manager.profiler.enabled. The others
    must be inert by design (nxdt.config.inert) or refused (NOT_SUPPORTED_YET)."""
    reads = _reads()
    unread = []
    for key, _t, _d, _h, _m in schema.iter_fields():
        *parents, leaf = key.split(".")
        parent = parents[-1] if parents else None
        hint = schema.hints(_section_class(parents))[leaf]
        if typing.get_origin(hint) is typing.Literal and len(typing.get_args(hint)) == 1:
            continue  # one value only (data.data_impl: mmap): nothing to ignore
        if any(leaf in names and (parent is None or parent in words) for names, words in reads.values()):
            continue
        if always_inert(key) or key in NOT_SUPPORTED_YET:
            continue
        unread.append(key)
    assert not unread, f"schema keys nothing reads (build, refuse or list them in nxdt.config.inert): {unread}"


def _section_class(parents: list[str]) -> type:
    cls = schema.NxdtConfig
    for part in parents:
        cls = schema.section_class(schema.hints(cls)[part])
    return cls


def test_inert_tables_name_real_keys_and_never_refuse_a_default():
    keys = {k for k, *_ in schema.iter_fields()}
    for key, entry in entries():
        assert key in keys or key.startswith("model.optim."), key
        assert set(entry.on) <= set(BACKENDS) and entry.reason
    default = load()
    for key, refused in NOT_SUPPORTED_YET.items():
        assert not refused(select(default, key)), key
    for key in ("model.fusions.flash_attention", "model.qkv_linear", "exp_manager.load_xser",
                "data.tokenizer.delimiter", "trainer.enable_model_summary", "exp_manager.ckpt_ptl_version"):
        assert always_inert(key), key


def test_the_docs_table_is_the_registry():
    """docs/configs.md lists the keys inert on every backend or on some, as INERT has them."""
    text = (REPO / "docs" / "configs.md").read_text(encoding="utf-8")
    section = text.split("## Nothing silently ignored", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1] for line in section.splitlines() if line.startswith("| `")]
    documented = {key for cell in rows for key in re.findall(r"`([\w.]+)`", cell)}
    assert documented == {key for key, entry in INERT if entry.unless is None}


def test_one_notice_names_this_runs_inert_settings():
    cfg = load("model.fusions.flash_attention=true", "model.qkv_linear=true", "model.fuse_qkv=true",
               "exp_manager.load_xser=true", "compiler_cache_url=/c", "model.fusions.softmax=false",
               "exp_manager.create_checkpoint_callback=false", "exp_manager.checkpoint_callback_params.save_top_k=3",
               "~exp_manager.resume_ignore_no_checkpoint",
               "~exp_manager.checkpoint_callback_params.every_n_train_steps")
    notice = inert_notice(cfg, backend="cpu")
    assert notice.startswith("settings with no effect in this run (cpu): model.fusions.flash_attention=true: ")
    assert "model.qkv_linear=true, model.fuse_qkv=true: NxDT's fused q/k/v module" in notice
    assert ("exp_manager.checkpoint_callback_params.save_top_k=3: no checkpoints are saved: "
            "exp_manager.create_checkpoint_callback=false") in notice
    assert "model.fusions.softmax=false: a fusion of Neuron's compiler in torch-xla's graph" in notice
    assert "compiler_cache_url=/c: Neuron only" in notice
    on_neuron = inert_notice(cfg, backend="neuron")  # TorchNeuron: the runtime keys act, torch-xla's do not
    assert "compiler_cache_url" not in on_neuron and "model.fusions.softmax=false" in on_neuron
    on_xla = inert_notice(cfg, backend="xla")  # the Neuron keys act there; the others still do not
    assert "compiler_cache_url" not in on_xla and "softmax" not in on_xla and "flash_attention=true" in on_xla
    assert inert_notice(load("~exp_manager.resume_ignore_no_checkpoint",
                             "~exp_manager.checkpoint_callback_params.every_n_train_steps"), backend="cpu") is None
    # a gate that is open is not reported: checkpoints on, the params act
    on = load("exp_manager.create_checkpoint_callback=true", "exp_manager.checkpoint_callback_params.save_top_k=3")
    assert "save_top_k" not in (inert_notice(on, backend="cpu") or "")


def test_the_notice_reaches_the_command_line_once(capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    load_config(["--config-path", str(CONF), "--config-name", "tiny_llama_cpu", "model.fusions.flash_attention=true",
                 "trainer.accelerator=cpu"], world_size=2, check_paths=False)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "no effect in this run" in line]
    assert len(lines) == 1 and lines[0].startswith("notice: settings with no effect in this run (cpu): ")
    assert "model.fusions.flash_attention=true" in lines[0]


def test_refused_and_meaningless_combinations():
    assert error_of(load, "distributed_strategy.token_shuffle_group_size=2") == (
        "'distributed_strategy.token_shuffle_group_size' is not supported yet (got 2)")
    assert error_of(load, "distributed_strategy.cpu_offload=true").startswith(
        "distributed_strategy.cpu_offload=true needs a sharding data-parallel mode")
    fsdp = load("distributed_strategy.cpu_offload=true", "distributed_strategy.fsdp=true")
    assert fsdp.distributed_strategy.cpu_offload
    manual_bf16 = ["precision.type=manual", "precision.xla_use_bf16=1", "precision.fp32_grads_cc=true"]
    assert "precision.fp32_grads_cc=true with bf16 parameters" in error_of(load, *manual_bf16)
    assert load(*manual_bf16, "distributed_strategy.fsdp=true").precision.fp32_grads_cc is True


# ----------------------------------------------------------------------------- --help
def test_help_shows_ranges_and_marks():
    text = describe()
    assert "trainer.max_steps (int >= 1, default 1000): " in text
    assert "trainer.val_check_interval (int >= 1 or float in (0, 1] or null, default null)" in text
    assert "trainer.max_epochs (int >= 0 or -1, default -1)" in text
    assert "model.fusions.flash_attention (bool, default False) [inert: attention is always PyTorch's SDPA" in text
    assert "model.fusions.softmax (bool, default True) [inert on cpu, cuda, mps, neuron: a fusion of Neuron's compiler" in text
    assert "[not supported yet: > 1]" in next(line for line in text.splitlines()
                                             if line.startswith("distributed_strategy.token_shuffle_group_size"))
    assert "compiler_flags (str or null, default null) [Neuron]: " in text
    assert "exp_manager.profiler.ranks (list (each >= 0), default [0])" in text
    assert describe("model.moe").splitlines()[0].startswith("model.moe.num_experts (int >= 0, default 0)")
    assert describe("trainer.max_steps").count("\n") == 0


def test_help_with_a_misspelled_section_is_one_line_exit_2():
    assert error_of(describe, "trainr").startswith("--help trainr: no such section or key (did you mean 'trainer'?)")
    proc = run_cli_here(["--help", "exp_manger"])
    assert proc.returncode == 2 and proc.stdout == "", (proc.stdout[:500], proc.stderr[-500:])
    assert proc.stderr.strip().splitlines()[-1].startswith(
        "error: --help exp_manger: no such section or key (did you mean 'exp_manager'?)")


# ----------------------------------------------------------------------------- paths and overrides
@pytest.mark.parametrize("name", ["tiny_llama--step=2-consumed_samples=8.0", "with space--step=2",
                                  "it's--step=2", "back\\slash=1\\"])
def test_checkpoint_paths_paste_back_as_printed(tmp_path, name):
    ckpt = tmp_path / name
    ckpt.mkdir()
    printed = shlex.quote(f"exp_manager.resume_from_checkpoint={ckpt}")  # as nxdt's next steps print it
    for line in (*shlex.split(printed), f"exp_manager.resume_from_checkpoint={quote_value(str(ckpt))}"):
        cfg = load(line)
        assert cfg.exp_manager.resume_from_checkpoint == str(ckpt)


def test_a_bad_override_with_an_equals_sign_says_how_to_quote():
    message = error_of(load, "data.data_prefix=[1=2]")
    assert message.startswith("bad override 'data.data_prefix=[1=2]': ")
    assert message.endswith("(quote a value that holds '=': key='a=b', in the shell \"key='a=b'\")")
    assert "quote" not in error_of(load, "trainer.max_steps=[1,")  # no '=' in the value: the usage


@pytest.fixture()
def data_dir(tmp_path, monkeypatch):
    """A working directory with the tiny config's data files (placeholders: validation checks names)."""
    monkeypatch.chdir(tmp_path)
    d = tmp_path / "data" / "kjv"
    d.mkdir(parents=True)
    for ext in (".bin", ".idx"):
        (d / f"kjv_text_document{ext}").write_bytes(b"x")
    return tmp_path


def test_log_dir_problems_stop_before_the_run(data_dir, monkeypatch):
    afile = data_dir / "a_file"
    afile.write_text("x")
    assert error_of(load, f"exp_manager.explicit_log_dir={afile}", check_paths=True) == (
        f"exp_manager.explicit_log_dir: {afile} is a file, not a directory")
    assert error_of(load, f"exp_manager.exp_dir={afile / 'runs'}", check_paths=True) == (
        f"exp_manager.exp_dir: cannot make {afile / 'runs' / 'tiny_llama'}: {afile} is a file")
    import nxdt.spec.paths as path_checks

    monkeypatch.setattr(path_checks.os, "access", lambda p, mode: Path(p) != data_dir / "ro")
    (data_dir / "ro").mkdir()
    assert error_of(load, f"exp_manager.explicit_log_dir={data_dir / 'ro' / 'run'}", check_paths=True) == (
        f"exp_manager.explicit_log_dir: cannot make {data_dir / 'ro' / 'run'} in {data_dir / 'ro'} (permission denied)")
    monkeypatch.undo()
    monkeypatch.chdir(data_dir)
    assert load(f"exp_manager.explicit_log_dir={data_dir / 'new' / 'run'}", check_paths=True)
    missing = data_dir / "tiny_llama--step=2-consumed_samples=8.0"
    assert error_of(load, f"exp_manager.resume_from_checkpoint={missing}", check_paths=True) == (
        f"exp_manager.resume_from_checkpoint: checkpoint not found: {missing}")


def test_missing_data_says_how_to_make_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    message = error_of(load, check_paths=True)
    assert message == (f"data.data_prefix: indexed dataset file not found: "
                       f"{tmp_path / 'data/kjv/kjv_text_document.bin'} ({MAKE_DATA_HINT})")
    assert "nxdt preprocess --input CORPUS.jsonl --tokenizer DIR --output-prefix PREFIX" in message
    assert "make data" in message


# ----------------------------------------------------------------------------- the schedule's one rule
def test_schedule_problems_are_found_at_validation_by_the_rule_the_builder_uses(capsys, monkeypatch):
    import torch

    from nxdt.optim.schedulers import build_scheduler

    monkeypatch.delenv("RANK", raising=False)
    # warmup longer than the run: it runs (as NeMo), with one notice at start
    cfg = load_config(["--config-path", str(CONF), "--config-name", "tiny_llama_cpu", "trainer.max_steps=10"],
                      world_size=2, check_paths=False)
    assert ("notice: model.optim.sched.warmup_steps (30) >= max_steps (10): the run ends before the warmup does"
            in capsys.readouterr().err)
    assert not torch.distributed.is_initialized()
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.model.optim["lr"])
    assert build_scheduler(opt, cfg.model.optim["sched"], 10) is not None
    # a schedule that cannot run: refused at validation, and by the builder with the same line
    bad = ["model.optim.sched.warmup_steps=0", "model.optim.sched.constant_steps=300"]
    message = error_of(load, *bad)
    assert message == ("model.optim.sched: constant_steps (300) = max_steps (300) with no warmup_steps leaves no "
                       "steps to decay over; lower constant_steps")
    sched = {"name": "CosineAnnealing", "warmup_steps": 0, "constant_steps": 300, "min_lr": 1e-4, "max_steps": 300}
    assert error_of(build_scheduler, opt, sched, 300) == message
    assert error_of(load, "model.optim.sched.min_lr=0.5") == (
        "model.optim.sched.min_lr: 0.5 is above the learning rate 0.001 (model.optim.lr)")


def test_an_int_or_float_key_keeps_an_int_whatever_union_typing_cached_first():
    """typing caches Union[int, float] as Union[float, int] when another module made that one first
    (torch / transformers did on a GPU machine): trainer.val_check_interval 100 must stay the int 100
    (a count of steps), not become 100.0 and fail the fraction range."""
    import subprocess
    import sys

    probe = ("from typing import Optional, Union\n"
             "first = Optional[Union[float, int]]\n"
             "from nxdt.spec import load_config\n"
             "cfg = load_config(['--config-name', 'tiny_llama_cpu', 'trainer.val_check_interval=100'], world_size=2,"
             " check_paths=False, quiet=True, default_config_dir='conf')\n"
             "v = cfg.trainer.val_check_interval\n"
             "print(type(v).__name__, v, Optional[Union[int, float]].__args__[0].__name__)\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["int", "100", "float"]  # the cache did reorder the Union; the value kept its type
