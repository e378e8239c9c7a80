"""exp_manager and checkpoint-format units: names, dirs, resume choice, pruning, bad checkpoints, xser dispatch."""

from __future__ import annotations

import random
import shutil
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from nxdt.config.errors import ConfigError
from nxdt.exp import checkpoint as ck
from nxdt.exp import checkpoint_state as ck_state
from nxdt.exp.exp_manager import (
    NxdtCheckpoint,
    complete_checkpoints,
    find_resume_checkpoint,
    format_checkpoint_name,
    resolve_dirs,
)


def _cfg(**exp):
    base = {"explicit_log_dir": None, "exp_dir": None, "name": "run", "version": None, "resume_if_exists": False,
            "resume_ignore_no_checkpoint": False, "resume_from_checkpoint": None}
    return OmegaConf.create({"name": "run", "model": {"weight_init_only": False}, "exp_manager": {**base, **exp}})


def _weights(tmp: Path, name: str, step: int) -> Path:
    path = tmp / name
    ck.save_weights({"w": torch.arange(6.0).reshape(2, 3)}, path, {"step": step})
    return path


def test_checkpoint_name_template():
    name = format_checkpoint_name("megatron_llama--{step}-{consumed_samples}", step=200, consumed_samples=204800.0)
    assert name == "megatron_llama--step=200-consumed_samples=204800.0"
    with pytest.raises(ConfigError, match="unknown field '{loss}'"):
        format_checkpoint_name("x-{loss}", step=1, consumed_samples=0.0)


def test_log_dir_layout(tmp_path, monkeypatch):
    monkeypatch.setenv("NXDT_RUN_VERSION", "v7")
    assert resolve_dirs(_cfg(explicit_log_dir=str(tmp_path / "e"))).checkpoint_dir == tmp_path / "e" / "checkpoints"
    assert resolve_dirs(_cfg(exp_dir=str(tmp_path))).log_dir == tmp_path / "run" / "v7"
    assert resolve_dirs(_cfg(exp_dir=str(tmp_path), resume_if_exists=True)).log_dir == tmp_path / "run"


def test_resume_picks_newest_complete_and_keeps_the_rest(tmp_path):
    dirs = resolve_dirs(_cfg(explicit_log_dir=str(tmp_path), resume_if_exists=True))
    ckpts = dirs.checkpoint_dir
    ckpts.mkdir(parents=True)
    _weights(ckpts, "a--step=2", 2)
    _weights(ckpts, "a--step=4", 4)
    newest = _weights(ckpts, "a--step=6", 6)
    (newest / "COMPLETE").unlink()  # a save that died before its marker
    truncated = _weights(ckpts, "a--step=8", 8)
    shard = next(truncated.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:10])
    (ckpts / ".tmp-a--step=10").mkdir()
    with pytest.warns(UserWarning) as record:
        path, weights_only = find_resume_checkpoint(_cfg(explicit_log_dir=str(tmp_path), resume_if_exists=True), dirs)
    assert path == ckpts / "a--step=4" and not weights_only
    messages = " ".join(str(w.message) for w in record)
    assert "a--step=6" in messages and "COMPLETE is missing" in messages and "truncated" in messages
    assert ".tmp-a--step=10" in messages
    assert sorted(p.name for p in ckpts.iterdir()) == [".tmp-a--step=10", "a--step=2", "a--step=4", "a--step=6",
                                                       "a--step=8"]


def test_resume_without_checkpoint(tmp_path, capsys):
    cfg = _cfg(explicit_log_dir=str(tmp_path), resume_if_exists=True)
    with pytest.raises(ConfigError, match="no complete checkpoint"):
        find_resume_checkpoint(cfg, resolve_dirs(cfg))
    cfg = _cfg(explicit_log_dir=str(tmp_path), resume_if_exists=True, resume_ignore_no_checkpoint=True)
    assert find_resume_checkpoint(cfg, resolve_dirs(cfg)) == (None, False)
    assert "starting from scratch" in capsys.readouterr().out


def test_explicit_checkpoint_must_be_good(tmp_path):
    bad = _weights(tmp_path, "c", 1)
    (bad / "COMPLETE").unlink()
    cfg = _cfg(resume_from_checkpoint=str(bad))
    with pytest.raises(ConfigError, match=r"incomplete: file .*COMPLETE is missing"):
        find_resume_checkpoint(cfg, resolve_dirs(cfg))
    assert bad.is_dir()
    cfg.model.weight_init_only = True
    good = _weights(tmp_path, "d", 1)
    cfg.exp_manager.resume_from_checkpoint = str(good)
    assert find_resume_checkpoint(cfg, resolve_dirs(cfg)) == (good, True)


def test_checkpoint_from_another_model_is_named(tmp_path):
    path = _weights(tmp_path, "c", 1)
    meta = ck.validate_checkpoint(path)
    ck.check_model_matches(path, meta, {"model.w": torch.zeros(2, 3)})
    with pytest.raises(ConfigError, match=r"meta.json: key 'w' has shape \[2, 3\] in the checkpoint but \[3, 3\]"):
        ck.check_model_matches(path, meta, {"model.w": torch.zeros(3, 3)})
    with pytest.raises(ConfigError, match="is from another model: the checkpoint has no key 'v'"):
        ck.check_model_matches(path, meta, {"model.w": torch.zeros(2, 3), "model.v": torch.zeros(1)})
    (path / "meta.json").write_text('{"format": "nxdt-checkpoint", "vers')
    with pytest.raises(ConfigError, match="meta.json is unreadable or truncated"):
        ck.validate_checkpoint(path)


def test_save_top_k_keeps_newest_and_last_link(tmp_path):
    cb = NxdtCheckpoint(tmp_path, "a--{step}", save_top_k=2, save_last=True)
    for step in (2, 4, 6):
        cb._on_complete(_weights(tmp_path, f"a--step={step}", step))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a--step=4", "a--step=6", "last"]
    assert (tmp_path / "last").resolve() == (tmp_path / "a--step=6").resolve()
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [4, 6]


def test_metadata_is_read_without_arbitrary_unpickling(tmp_path):
    import pickle

    path = _weights(tmp_path, "c", 1)
    (path / ".metadata").write_bytes(pickle.dumps(shutil.rmtree))
    with pytest.raises(ConfigError, match="refusing to load global shutil.rmtree"):
        ck_state.read_dcp_metadata(path)


def test_rng_state_round_trips_through_json():
    state = ck_state.rng_state()
    a = (random.random(), np.random.rand(), torch.rand(3))
    ck_state.set_rng_state(state)
    b = (random.random(), np.random.rand(), torch.rand(3))
    assert a[0] == b[0] and a[1] == b[1] and torch.equal(a[2], b[2])


def test_xser_dispatch(tmp_path, monkeypatch):
    assert ck.use_xser(True, "xla") and not ck.use_xser(True, "cpu") and not ck.use_xser(False, "xla")
    saved = {}
    fake = types.ModuleType("torch_xla.utils.serialization")
    fake.save = lambda data, path, master_only=True: saved.update({path: {k: v.clone() for k, v in data.items()}})
    fake.load = lambda path: saved[path]
    for name in ("torch_xla", "torch_xla.utils"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "torch_xla.utils.serialization", fake)
    ck._xser_save({"model.w": torch.ones(2)}, tmp_path, rank=1)
    assert list(saved) == [str(tmp_path / "xser_rank_00001.pt")]
    target = {"model.w": torch.zeros(2)}
    ck._xser_load(target, tmp_path, rank=1)
    assert torch.equal(target["model.w"], torch.ones(2))
