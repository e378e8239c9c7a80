"""exp_manager and checkpoint-format units: names, dirs, resume choice, pruning, bad checkpoints, xser dispatch."""

from __future__ import annotations

import json
import random
import shutil
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from nxdt.config.errors import ConfigError
from nxdt.spec import config_from_dict
from nxdt.config.schema import CheckpointCallbackParams
from nxdt.config.typed import to_typed
from nxdt.checkpoint import checkpointer as ck
from nxdt.checkpoint import state as ck_state
from nxdt.checkpoint.callbacks import NxdtCheckpoint
from nxdt.checkpoint.resume import ResumePlan, find_resume_checkpoint
from nxdt.checkpoint.retention import complete_checkpoints, format_checkpoint_name
from nxdt.exp.exp_manager import resolve_dirs


def _cfg(**exp):
    base = {"explicit_log_dir": None, "exp_dir": None, "name": "run", "version": None, "resume_if_exists": False,
            "resume_ignore_no_checkpoint": False, "resume_from_checkpoint": None}
    return config_from_dict({"name": "run", "model": {"weight_init_only": False}, "exp_manager": {**base, **exp}})


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


def test_run_folders_under_torchrun_are_timestamps(monkeypatch):
    """`torchrun --standalone` names its rendezvous with a random uuid: the run folder is the
    launcher's start time instead (readable, sortable, alike on every local rank); a named
    rendezvous (--rdzv-id) is kept as given."""
    import re

    from nxdt.exp.exp_manager import run_version

    monkeypatch.delenv("NXDT_RUN_VERSION", raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "3f2b8c1e-9a4d-4e0f-8b7a-2c5d6e7f8a9b")
    assert re.fullmatch(r"\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d", run_version())
    monkeypatch.delenv("NXDT_RUN_VERSION")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "pretrain-7b")
    assert run_version() == "pretrain-7b"


def test_a_second_run_in_one_process_logs_to_its_own_file_only(tmp_path):
    """Two runs in one process (a sweep, tests/run_pool.py): the second run's lines go to its own
    rank log file, not also to the first run's."""
    import logging

    from nxdt.exp.exp_manager import close_rank_log_file, setup_rank_log_file

    try:
        first = setup_rank_log_file(tmp_path / "first", log_local_rank_0_only=False)
        logging.getLogger("nxdt").info("line of the first run")
        second = setup_rank_log_file(tmp_path / "second", log_local_rank_0_only=False)
        logging.getLogger("nxdt").info("line of the second run")
    finally:
        close_rank_log_file()
        logging.captureWarnings(False)
    assert "line of the first run" in first.read_text() and "second run" not in first.read_text()
    assert "line of the second run" in second.read_text() and "first run" not in second.read_text()


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
        plan = find_resume_checkpoint(_cfg(explicit_log_dir=str(tmp_path), resume_if_exists=True), dirs)
    assert plan == ResumePlan(ckpts / "a--step=4", False)
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
    assert find_resume_checkpoint(cfg, resolve_dirs(cfg)) == ResumePlan()
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
    assert find_resume_checkpoint(cfg, resolve_dirs(cfg)) == ResumePlan(good, True)


def test_a_restarted_fine_tuning_run_continues_its_own_checkpoints(tmp_path, capsys):
    """weight_init_only + resume_from_checkpoint (the pre-trained start) + resume_if_exists: once the
    run has checkpoints of its own, a restart continues them (NeMo's rule), not the pre-trained start."""
    start = _weights(tmp_path, "pretrained", 1)
    cfg = _cfg(explicit_log_dir=str(tmp_path / "run"), resume_if_exists=True, resume_from_checkpoint=str(start))
    cfg.model.weight_init_only = True
    dirs = resolve_dirs(cfg)
    assert find_resume_checkpoint(cfg, dirs) == ResumePlan(start, True)  # the first launch
    own = _weights(dirs.checkpoint_dir, "ft--step=3", 3)
    assert find_resume_checkpoint(cfg, dirs) == ResumePlan(own, False)
    assert "resuming this run's checkpoint ft--step=3" in capsys.readouterr().out


def test_a_fine_tuning_start_over_its_own_checkpoints_is_refused_without_resume_if_exists(tmp_path):
    """resume_from_checkpoint=BASE weight_init_only, resume_if_exists off, in a log dir with the run's
    own checkpoint: the launch would restart at step 0 there: refused, naming the checkpoint. An
    evaluation of the same config (it writes no checkpoint) is not refused."""
    start = _weights(tmp_path, "pretrained", 1)
    cfg = _cfg(explicit_log_dir=str(tmp_path / "run"), resume_from_checkpoint=str(start))
    cfg.model.weight_init_only = True
    dirs = resolve_dirs(cfg)
    assert find_resume_checkpoint(cfg, dirs) == ResumePlan(start, True)  # nothing of its own yet
    _weights(dirs.checkpoint_dir, "ft--step=3", 3)
    with pytest.raises(ConfigError) as err:
        find_resume_checkpoint(cfg, dirs)
    assert str(err.value).startswith(f"exp_manager: log dir {dirs.log_dir} holds a complete checkpoint of an earlier "
                                     "run (ft--step=3); starting over there would lose it: continue that run with "
                                     "exp_manager.resume_if_exists=true, or start a new one in a new folder")
    assert find_resume_checkpoint(cfg, dirs, training=False) == ResumePlan(start, True)


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


# --------------------------------------------------------------------------- save_top_k by a metric
class _Trainer:
    """What NxdtCheckpoint reads of Lightning's trainer; a save writes a small complete
    checkpoint and calls back like the Checkpointer does on rank 0."""

    def __init__(self, cb: NxdtCheckpoint) -> None:
        self.cb, self.global_step, self.current_epoch = cb, 0, 0
        self.is_global_zero, self.sanity_checking = True, False
        self.callback_metrics: dict[str, torch.Tensor] = {}
        self.lightning_module = types.SimpleNamespace(consumed_samples=0)
        self.strategy = types.SimpleNamespace(broadcast=lambda x: x)
        self.events: list[str] = []  # logger flushes and checkpoint writes, in order
        self.loggers = [types.SimpleNamespace(save=lambda: self.events.append("logs flushed"))]

    def save_checkpoint(self, path: str, weights_only: bool = False) -> None:
        self.events.append(f"checkpoint {self.global_step}")
        ck.save_weights({"w": torch.zeros(1)}, Path(path), {"step": self.global_step})
        self.cb._on_complete(Path(path))

    def step(self, val: float | None = None, **train: float) -> None:
        """One training step (logging `train`), its save, then a validation logging val_loss."""
        self.global_step += 1
        self.callback_metrics.update({k: torch.tensor(v) for k, v in train.items()})
        self.cb.save(self)
        if val is not None:
            self.callback_metrics["val_loss"] = torch.tensor(val)
            self.cb.on_validation_end(self, None)


def _steps(path: Path) -> list[int]:
    return sorted(int(p.name.split("step=")[1].split("-")[0]) for p in path.iterdir() if not p.is_symlink())


def test_logs_are_flushed_before_every_checkpoint(tmp_path):
    """A run killed right after a checkpoint completes resumes past the steps it covers: their
    logged values must already be on disk (the SIGKILL test in test_checkpoint_resume.py shows it
    end to end)."""
    t = _Trainer(NxdtCheckpoint(tmp_path, "a--{step}"))
    for _ in range(2):
        t.step()
    assert t.events == ["logs flushed", "checkpoint 1", "logs flushed", "checkpoint 2"]


def test_top_k_by_val_loss_scores_the_validated_step_and_keeps_the_newest(tmp_path, capsys):
    """val_loss, min, top 2, a save every step, validation every 2nd step (after the save, as in
    Lightning): unvalidated checkpoints live only while newest; the newest always survives."""
    cb = NxdtCheckpoint(tmp_path, "a--{step}-{val_loss:.2f}", save_top_k=2, save_last=True, monitor="val_loss",
                        mode="min")
    t = _Trainer(cb)
    seen = []
    for val in (None, 3.0, None, 2.5, None, 2.8):
        t.step(val)
        seen.append(_steps(tmp_path))
    assert seen == [[1], [2], [2, 3], [2, 4], [2, 4, 5], [4, 6]]
    # the name carries the val_loss known when it was written (step 4's validation runs after its save)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a--step=4-val_loss=3.00", "a--step=6-val_loss=2.50", "last"]
    assert (tmp_path / "last").resolve().name == "a--step=6-val_loss=2.50"
    assert json.loads((tmp_path / "a--step=4-val_loss=3.00" / "monitor.json").read_text()) == {
        "monitor": "val_loss", "value": 2.5, "step": 4}
    assert "was not logged" not in capsys.readouterr().out
    # a new callback over the same directory (a resumed run) ranks the recorded scores: step 7
    # (val 2.6) outranks step 6 (2.8), and the newest (8, unvalidated) is kept
    cb2 = NxdtCheckpoint(tmp_path, "a--{step}-{val_loss:.2f}", save_top_k=2, monitor="val_loss", mode="min")
    t2 = _Trainer(cb2)
    t2.global_step, t2.callback_metrics = 6, dict(t.callback_metrics)
    t2.step(2.6)
    t2.step()
    assert _steps(tmp_path) == [4, 7, 8]


def test_top_k_by_train_metric_max_and_missing_metric(tmp_path, capsys):
    cb = NxdtCheckpoint(tmp_path / "a", "a--{step}", save_top_k=1, monitor="reduced_train_loss", mode="max")
    t = _Trainer(cb)
    for loss in (5.0, 7.0, 6.0, 4.0):
        t.step(reduced_train_loss=loss)
    assert _steps(tmp_path / "a") == [2, 4]  # the highest (step 2) and the newest
    # a metric that is never logged: one line, and only the newest checkpoint is kept
    cb = NxdtCheckpoint(tmp_path / "b", "b--{step}", save_top_k=2, monitor="train_los", mode="min")
    t = _Trainer(cb)
    for loss in (5.0, 4.0, 3.0):
        t.step(reduced_train_loss=loss)
    out = [line for line in capsys.readouterr().out.splitlines() if "train_los'" in line]
    assert out == ["note: exp_manager.checkpoint_callback_params.monitor: metric 'train_los' was not logged by step 1 "
                   "(logged: reduced_train_loss); checkpoints without it are kept only while newest"]
    assert _steps(tmp_path / "b") == [3]


def test_top_k_keeps_nan_last_and_async_scores_land_in_the_tmp_dir(tmp_path):
    from nxdt.checkpoint.retention import read_score, to_keep, write_score

    paths = [_weights(tmp_path, f"c--step={s}", s) for s in (1, 2, 3)]
    for path, value in zip(paths, (float("nan"), 1.0, 2.0)):
        write_score(path, "m", value, 0)
    found = [(s, p) for s, p in zip((1, 2, 3), paths)]
    assert to_keep(found, 1, "m", "min") == {paths[1], paths[2]}
    assert to_keep(found, 2, "m", "max") == {paths[2], paths[1]}  # nan ranks last in both modes
    assert to_keep(found, -1, "m", "min") == set(paths) and to_keep(found, 1, "step", "max") == {paths[2]}
    tmp = tmp_path / ".tmp-c--step=4"
    tmp.mkdir()
    assert write_score(tmp_path / "c--step=4", "m", 0.5, 4) and read_score(tmp, "m") == 0.5
    assert read_score(tmp, "other") is None


def test_monitor_and_mode_config_checks():
    from nxdt.checkpoint.callbacks import check_checkpoint_params

    def cfg(**params):
        base = {"monitor": "step", "mode": "max", "filename": "x--{step}"}
        return to_typed({**base, **params}, CheckpointCallbackParams)

    check_checkpoint_params(cfg(monitor="val_loss", mode="min", filename="x--{step}-{val_loss:.3f}"))
    with pytest.raises(ConfigError, match="'min' with monitor 'step' would keep the oldest checkpoints"):
        check_checkpoint_params(cfg(mode="min"))
    with pytest.raises(ConfigError, match=r"filename: unknown field '\{val_loss\}'"):
        check_checkpoint_params(cfg(monitor="reduced_train_loss", filename="x--{val_loss}"))
    with pytest.raises(ConfigError, match="monitor: 'val loss' is not a metric name"):
        check_checkpoint_params(cfg(monitor="val loss"))


# --------------------------------------------------------------------------- save_bf16, master weights, RNG
def test_save_bf16_halves_model_bytes_and_keeps_masters():
    from nxdt.checkpoint.dtype import model_keys_for_export, weights_for_load, weights_for_save

    w = torch.randn(64, 32) * 1e-3 + 1.0  # values bf16 cannot hold
    tensors = {"model.w": w, "optim0.state.w.exp_avg": torch.ones(64, 32)}
    out, notes = weights_for_save(tensors, save_bf16=True, keep_master=True)
    assert out["model.w"].dtype == torch.bfloat16 and out["master.w"] is w and notes == []
    assert out["model.w"].nbytes * 2 == w.nbytes and out["optim0.state.w.exp_avg"].dtype == torch.float32
    out, notes = weights_for_save(tensors, save_bf16=True, keep_master=False)
    assert "master.w" not in out and len(notes) == 1 and "resuming from them is not exact" in notes[0]
    assert weights_for_save(tensors, save_bf16=False, keep_master=True) == (tensors, [])  # fp32: they are the masters
    lowp = {"model.w": w.to(torch.bfloat16)}
    assert "no fp32 master weights" in weights_for_save(lowp, False, True)[1][0]
    assert weights_for_save({**lowp, "optim0.state.w.master": w}, False, True)[1] == []  # adamw_fp32OptState's copy

    # a load takes the masters where they exist: the same target tensor, exact values
    bf16 = types.SimpleNamespace(properties=types.SimpleNamespace(dtype=torch.bfloat16), size=w.shape)
    fp32 = types.SimpleNamespace(properties=types.SimpleNamespace(dtype=torch.float32), size=w.shape)
    target = torch.empty(64, 32)
    request, notes = weights_for_load({"model.w": target}, {"model.w": bf16, "master.w": fp32})
    assert list(request) == ["master.w"] and request["master.w"] is target and notes == []
    request, notes = weights_for_load({"model.w": target}, {"model.w": bf16})
    assert list(request) == ["model.w"] and "1 model tensors as bfloat16 with no fp32 master weights" in notes[0]
    assert model_keys_for_export({"model.w": bf16, "master.w": fp32, "model.v": bf16}) == {"w": "master.w",
                                                                                          "v": "model.v"}


def test_layout_change_reseeds_every_rank_alike():
    a = ck_state.reseed_state(1234, 3)
    ck_state.set_rng_state(a)
    first = (random.random(), np.random.rand(), torch.rand(3))
    ck_state.set_rng_state(a)
    again = (random.random(), np.random.rand(), torch.rand(3))
    assert first[0] == again[0] and first[1] == again[1] and torch.equal(first[2], again[2])
    ck_state.set_rng_state(ck_state.reseed_state(1234, 0))
    assert not torch.equal(torch.rand(3), first[2])  # another step: not step 0's numbers replayed


def test_bf16_params_with_fp32_optimizer_masters_round_trip_exactly(tmp_path):
    """bf16 parameters + adamw_fp32OptState with save_bf16 + use_master_weights_in_ckpt: nothing is
    cast, the optimizer's fp32 `master` is in the checkpoint, and training after the load
    continues bit for bit (DCP in one process, through the same state functions as a run)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    from nxdt.checkpoint.dtype import weights_for_load, weights_for_save
    from nxdt.optim.optimizers import AdamWFP32OptState

    def make():
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 4).to(torch.bfloat16)
        return model, AdamWFP32OptState(model.parameters(), lr=1e-4, weight_decay=0.01)

    def step(model, opt, seed):
        g = torch.Generator().manual_seed(seed)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=g).to(torch.bfloat16)
        opt.step()

    model, opt = make()
    for s in range(3):
        step(model, opt, s)
    tensors, _ = ck_state.split_tensors(ck_state.model_and_optimizer_state(model, [opt]))
    out, notes = weights_for_save(tensors, save_bf16=True, keep_master=True)
    assert notes == [] and not any(k.startswith("master.") for k in out)  # the optimizer holds the masters
    assert out["optim0.state.weight.master"].dtype == torch.float32
    dcp.save(out, storage_writer=FileSystemWriter(str(tmp_path)), no_dist=True)

    model2, opt2 = make()
    state = ck_state.model_and_optimizer_state(model2, [opt2])
    targets, _ = ck_state.split_tensors(state)
    request, notes = weights_for_load(targets, ck_state.SafeReader(str(tmp_path)).read_metadata().state_dict_metadata)
    dcp.load(request, storage_reader=ck_state.SafeReader(str(tmp_path)), no_dist=True)
    state.update(targets)
    ck_state.set_model_and_optimizer_state(model2, [opt2], state)
    for s in range(3, 6):
        step(model, opt, s)
        step(model2, opt2, s)
    assert notes == [] and torch.equal(model.weight, model2.weight) and torch.equal(model.bias, model2.bias)
    assert torch.equal(opt.state[model.weight]["master"], opt2.state[model2.weight]["master"])
