"""`nxdt report`: run directories written by Lightning's TensorBoardLogger / CSVLogger exactly as
nxdt writes them (save_dir=log_dir, name="", version=""), with numbers chosen so that every value
the report prints is known: the summary, the gap between two runs, --assert-equal's exit codes."""

from __future__ import annotations

import struct
import sys

import pytest
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from nxdt.cli import main as cli_main
from nxdt.config import to_yaml
from nxdt.spec import config_from_dict
from nxdt.tools.report import main as report_main
from nxdt.tools.report import FROM_ZERO, merge_sessions, plot_lines, read_run, run_labels

TINY = {"name": "tiny", "trainer": {"devices": 4}, "distributed_strategy": {"tensor_model_parallel_size": 2},
        "data": {"micro_batch_size": 1, "global_batch_size": 4, "seq_length": 16},
        "model": {"num_layers": 2, "hidden_size": 32, "ffn_hidden_size": 64, "num_attention_heads": 4,
                  "vocab_size": 128, "encoder_seq_length": 16}}
# embeddings 128x32 + 2 layers x (4 x 32x32 attention + 3 x 32x64 MLP + 2 x 32 norm) + 32 final norm + 128x32 head
TINY_PARAMETERS = "28,832"


def _scalars(step: int) -> dict[str, float]:
    """Run A's step: loss 3 - step/8 (lowest 2.0 at step 8: step 9 goes back up), lr, tokens/s
    1000 + 10 step (median over 0..9: 1045), MFU 40 + step (median 44.5), peak memory up to 3.75."""
    loss = 2.5 if step == 9 else 3.0 - 0.125 * step
    out = {"reduced_train_loss": loss, "lr": 0.001 * (step + 1), "throughput": 1000.0 + 10 * step,
           "mfu": 40.0 + step, "memory/peak_gib": 1.5 + 0.25 * step, "global_step": float(step + 1)}
    if step == 4:
        out["val_loss"] = 2.25
    if step == 9:
        out["val_loss"] = 2.5
    return out


def _write_run(path, sessions: list[dict[int, dict[str, float]]]):
    """One TensorBoardLogger per session, as each (re)start of a run makes. The sessions' keys are
    0-based step indices; each is logged at index + 1, the optimizer steps done (as nxdt logs)."""
    path.mkdir(parents=True)
    (path / "config.yaml").write_text(to_yaml(config_from_dict(TINY)), encoding="utf-8")
    for steps in sessions:
        logger = TensorBoardLogger(save_dir=str(path), name="", version="", default_hp_metric=False)
        for step, scalars in steps.items():
            logger.log_metrics(scalars, step + 1)
        logger.finalize("success")
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A: steps 0..9 in one session. B: a first session to step 6 whose steps 5-6 are abandoned
    (100.0: never to be seen), resumed at step 4 and stopped after step 5, with step 5's loss
    0.375 above A's and val_loss 0.0625 above A's at step 4."""
    root = tmp_path_factory.mktemp("report")
    a = _write_run(root / "a", [{s: _scalars(s) for s in range(10)}])
    first = {s: _scalars(s) for s in range(7)}
    first[5]["reduced_train_loss"] = first[6]["reduced_train_loss"] = 100.0
    resumed = {s: _scalars(s) for s in (4, 5)}
    resumed[4]["val_loss"] = 2.3125
    resumed[5]["reduced_train_loss"] += 0.375
    b = _write_run(root / "b", [first, resumed])
    return root, a, b


def _png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_one_run_summary_and_plots(runs, capsys):
    _, a, _ = runs
    assert report_main([str(a)]) == 0
    out = a / "report"
    md = (out / "report.md").read_text()
    assert "| steps trained | 10 |" in md
    assert "| train loss first / last / min | 3 (step 1) / 2.5 (step 10) / 2 (step 9) |" in md
    assert "| best val loss | 2.25 (step 5) |" in md
    assert "| median tokens/s | 1,045 |" in md and "| median MFU (%) | 44.5 |" in md
    assert "| peak memory (GiB) | 3.75 |" in md
    assert "| layout | world 4: dp 2, tp 2, pp 1, cp 1 |" in md and f"| parameters | {TINY_PARAMETERS} |" in md
    assert "Not logged: `gradient_norm`." in md
    for metric in ("reduced_train_loss", "val_loss", "lr", "throughput", "mfu", "memory_peak_gib"):
        assert f"]({metric}.png)" in md
        assert _png_size(out / f"{metric}.png") == (700, 400)
    assert not (out / "gradient_norm.png").exists()
    assert "(6 plots)" in capsys.readouterr().out


def test_two_runs_max_gap_and_assert_equal(runs, capsys):
    root, a, b = runs
    out = root / "ab"
    assert report_main([str(a), str(b), "--output", str(out), "--assert-equal", "0.5"]) == 0
    printed = capsys.readouterr().out
    assert "reduced_train_loss       0.375 at step 6 (6 shared steps)" in printed  # not 97.5: step 7 was dropped
    assert "val_loss                 0.0625 at step 5 (1 shared steps)" in printed
    assert "equal within 0.5: reduced_train_loss, val_loss" in printed
    md = (out / "report.md").read_text()
    assert "| steps trained | 10 | 6 |" in md
    assert "| `reduced_train_loss` | 6 | 0.375 | 6 | 2.375 / 2.75 |" in md
    assert _png_size(out / "reduced_train_loss.png") == (700, 600)  # with the difference panel

    assert report_main([str(a), str(b), "--output", str(out), "--assert-equal", "0.25", "--metrics", "lr"]) == 0
    assert report_main([str(a), str(b), "--output", str(out), "--assert-equal", "0.25",
                        "--metrics", "reduced_train_loss"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["not equal: reduced_train_loss differs by 0.375 at step 6 (tolerance 0.25): a 2.375, b 2.75"]
    assert report_main([str(a), str(b), "--output", str(out), "--assert-equal", "0.05", "--metrics", "val_loss"]) == 1
    assert "val_loss differs by 0.0625 at step 5" in capsys.readouterr().err


def test_sessions_merge_last_value_wins_and_restart_drops_the_rest():
    first = {"reduced_train_loss": [(0, 1.0), (1, 2.0), (1, 3.0), (2, 4.0), (3, 5.0)], "lr": [(3, 0.5)]}
    evaluate_only = {"val_loss": [(2, 7.0)]}  # trains nothing: truncates nothing
    resumed = {"reduced_train_loss": [(2, 6.0)]}
    merged = merge_sessions([first, evaluate_only, resumed])
    assert merged == {"reduced_train_loss": {0: 1.0, 1: 3.0, 2: 6.0}}  # val at 2 and lr at 3 were after the restart


def test_metrics_csv_when_there_are_no_event_files(tmp_path):
    """Lightning's CSV rows in logging order; a resumed run appends, here restarting at step 2."""
    logger = CSVLogger(save_dir=str(tmp_path), name="", version="")
    for step, loss in enumerate((4.0, 3.5, 3.75), start=1):
        logger.log_metrics({"reduced_train_loss": loss, "lr": 0.01}, step)
    logger.log_metrics({"val_loss": 3.25}, 1)
    logger.log_metrics({"reduced_train_loss": 3.0}, 2)  # the resumed run: the old steps 2-3 are gone
    logger.finalize("success")
    assert (tmp_path / "metrics.csv").is_file()
    assert report_main([str(tmp_path), "--output", str(tmp_path / "r")]) == 0
    md = (tmp_path / "r" / "report.md").read_text()
    assert "| read from | metrics.csv |" in md and "| steps trained | 2 |" in md
    assert "| train loss first / last / min | 4 (step 1) / 3 (step 2) / 3 (step 2) |" in md
    assert "| best val loss | 3.25 (step 1) |" in md
    assert "| config | no config.yaml |" in md and "wall time" not in md


def test_without_matplotlib_the_summary_is_still_written(runs, monkeypatch, capsys):
    root, a, _ = runs
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)  # import raises ImportError
    out = root / "noplots"
    assert report_main([str(a), "--output", str(out)]) == 0
    assert "pip install 'nxdt[report]'" in (out / "report.md").read_text()
    assert sorted(p.name for p in out.iterdir()) == ["report.md"]
    assert "no plots: pip install 'nxdt[report]'" in capsys.readouterr().out


def test_bad_input_is_one_line_and_exit_2(runs, tmp_path, capsys):
    root, a, _ = runs
    missing = tmp_path / "no_such_run"
    assert cli_main(["report", str(missing)]) == 2
    assert capsys.readouterr().err.strip() == f"error: {missing}: no such run directory"
    (tmp_path / "empty").mkdir()
    assert cli_main(["report", str(tmp_path / "empty")]) == 2
    assert "no TensorBoard event files with scalars nor metrics.csv" in capsys.readouterr().err
    assert cli_main(["report", str(root), "--output", str(tmp_path / "x")]) == 2  # the runs' parent folder
    assert "event files are in its sub-folders a, b: pass one of them" in capsys.readouterr().err
    assert cli_main(["report", str(a), "--metrics", "reduced_train_los"]) == 2
    assert "did you mean 'reduced_train_loss'?" in capsys.readouterr().err
    assert cli_main(["report", str(a), "--assert-equal", "0.1"]) == 2
    assert "needs two or more RUN_DIRs" in capsys.readouterr().err


def test_labels_tell_same_named_runs_apart(tmp_path):
    assert run_labels([tmp_path / "x" / "run", tmp_path / "y" / "run"]) == ["x/run", "y/run"]
    assert run_labels([tmp_path / "ref", tmp_path / "tp2"]) == ["ref", "tp2"]


def test_a_run_started_from_a_checkpoint_counts_its_own_steps_and_loss_plots_show_val(runs, tmp_path, capsys):
    """A log that begins at step 5 (a run started from another run's checkpoint): 5 steps trained, not the
    global_step 10 (on main: 10); the training-loss plot carries the validation loss; memory from 0."""
    started = _write_run(tmp_path / "started", [{s: _scalars(s) for s in range(5, 10)}])
    out = tmp_path / "out"
    assert report_main([str(started), "--output", str(out)]) == 0
    md = (out / "report.md").read_text()
    assert "| steps trained | 5 (steps 6–10: started from a checkpoint at step 5) |" in md
    # logged every 10 steps (rows 10, 20, 30): 30 steps from scratch, then 20 more resumed at step 30
    # (rows 40, 50; not 50 and not "started ... at step 40")
    every10 = {"trainer": {**TINY["trainer"], "log_every_n_steps": 10}}
    for name, steps, said in (("fresh", (9, 19, 29), "| steps trained | 30 |"),
                              ("resumed", (39, 49), "| steps trained | 20 (steps 40–50: started from a checkpoint at "
                                                    "step 30) |")):
        run_dir = _write_run(tmp_path / name, [{s: _scalars(s) for s in steps}])
        (run_dir / "config.yaml").write_text(to_yaml(config_from_dict({**TINY, **every10})), encoding="utf-8")
        assert report_main([str(run_dir), "--output", str(tmp_path / f"{name}_out")]) == 0
        assert said in (tmp_path / f"{name}_out" / "report.md").read_text()
    lines = plot_lines(read_run(runs[1], "a"), "reduced_train_loss")
    assert [(line["label"], line["style"]) for line in lines] == [("reduced_train_loss", "-"), ("val_loss", "--")]
    assert lines[1]["steps"] == [5, 10] and lines[1]["values"] == [2.25, 2.5]
    assert "memory/peak_gib" in FROM_ZERO and "reduced_train_loss" not in FROM_ZERO
