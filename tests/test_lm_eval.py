"""`nxdt evaluate --tasks` through lm-evaluation-harness, offline (one process and tensor parallel).

A tiny random Llama checkpoint (tests/test_convert.py's) is exported with `nxdt convert nxdt-to-hf`.
Three task YAMLs the test writes, on local JSON lines, cover the harness's three requests: multiple
choice (loglikelihood), a generate_until task and a rolling-log-likelihood task with documents longer
than the model's context (several windows each). Each runs through nxdt's LM (the command,
`nxdt evaluate --tasks`) and through the harness's own transformers model (HFLM) on the export:
the same accuracies and exact-match, the same generations, log-likelihoods within 1e-4 (a long
document's float32 total within 1e-4 + 1e-7 of its size), and the
results JSON beside the checkpoint holds the command's numbers. Under torchrun (2 ranks, gloo) the
model split with tensor parallelism gives the one-process generations and accuracies, and its
log-likelihoods within 1e-4: tests/test_generate_parallel.py's test_tensor_parallel_scores_as_one_process,
in that module's 2-rank launch (one launch's imports for both).
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import pytest
from conftest import CORPUS
from test_convert import _nxdt_checkpoint

from nxdt.cli import main as nxdt_main
from nxdt.inference.harness import evaluate_tasks, results_path, task_manager
from nxdt.inference.harness_lm import NxdtLM
from nxdt.inference.load import load_for_inference
from nxdt.tools.convert import nxdt_to_hf

TASKS = ["nxdt_mc", "nxdt_gen", "nxdt_rolling"]
TOL = 1e-4
STOPS = [".", "\n"]

MC = """task: nxdt_mc
dataset_path: json
dataset_kwargs:
  data_files: {{test: {data}}}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: choices
doc_to_target: answer
metric_list:
  - {{metric: acc, aggregation: mean, higher_is_better: true}}
  - {{metric: acc_norm, aggregation: mean, higher_is_better: true}}
"""
GEN = """task: nxdt_gen
dataset_path: json
dataset_kwargs:
  data_files: {{test: {data}}}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{target}}}}"
generation_kwargs:
  until: {stops}
  max_gen_toks: 6
  do_sample: false
metric_list:
  - {{metric: exact_match, aggregation: mean, higher_is_better: true}}
"""
ROLLING = """task: nxdt_rolling
dataset_path: json
dataset_kwargs:
  data_files: {{test: {data}}}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - {{metric: word_perplexity, aggregation: weighted_perplexity, higher_is_better: false}}
  - {{metric: byte_perplexity, aggregation: weighted_perplexity, higher_is_better: false}}
  - {{metric: bits_per_byte, aggregation: bits_per_byte, higher_is_better: false}}
"""


def _verses(n: int) -> list[str]:
    with gzip.open(CORPUS, "rt", encoding="utf-8") as corpus:
        text = " ".join(json.loads(next(corpus))["text"] for _ in range(4))
    return [v.strip() + "." for v in text.split(".") if len(v.split()) > 6][:n]


def _write_tasks(folder: Path, gen_targets: list[str] | None) -> list[str]:
    """The three task YAMLs and their data; the generation prompts (targets: `gen_targets`)."""
    folder.mkdir(exist_ok=True)
    verses = _verses(60)
    mc, prompts = [], []
    for i, v in enumerate(verses[:8]):
        words = v.split()
        right = " " + " ".join(words[5:8])
        wrong = [" " + " ".join(verses[(i + k) % 8].split()[5:8]) for k in (3, 5)]
        choices = [right, *wrong][i % 3:] + [right, *wrong][:i % 3]
        mc.append({"context": " ".join(words[:5]), "choices": choices, "answer": choices.index(right)})
        prompts.append(" ".join(words[:6]))
    gen = [{"prompt": p, "target": (gen_targets or [""] * 8)[i]} for i, p in enumerate(prompts)]
    rolling = [{"text": " ".join(verses[i:i + 20])} for i in range(0, 60, 20)]  # 500+ tokens: windows of 128
    for name, rows, template in (("mc", mc, MC), ("gen", gen, GEN), ("rolling", rolling, ROLLING)):
        data = folder / f"{name}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        (folder / f"{name}.yaml").write_text(template.format(data=json.dumps(str(data)), stops=json.dumps(STOPS)))
    return prompts


def nxdt(argv) -> int:
    """`nxdt ...` in this process: its exit status (bad input ends in SystemExit(2) via main_guard)."""
    try:
        return int(nxdt_main([str(a) for a in argv]) or 0)
    except SystemExit as stop:
        return int(stop.code)


def _command(ckpt: Path, tasks_dir: Path) -> list[str]:
    return ["evaluate", "--checkpoint", str(ckpt), "--tasks", ",".join(TASKS), "--include-path", str(tasks_dir),
            "--batch-size", "4", "--log-samples"]


def _per_sample(results: dict, task: str) -> list:
    """Each example's responses, as JSON has them (lists, not tuples)."""
    return json.loads(json.dumps([s["resps"] for s in sorted(results["samples"][task], key=lambda s: s["doc_id"])]))


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    import datasets.config

    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        monkeypatch.setenv(var, "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")


def test_tasks_score_as_the_harness_scores_the_export(tmp_path, capsys):
    from lm_eval.models.huggingface import HFLM

    _, ckpt = _nxdt_checkpoint(tmp_path, "megatron")
    nxdt_to_hf(ckpt, tmp_path / "hf", max_shard_bytes=10**9)
    tasks_dir = tmp_path / "tasks"
    _write_tasks(tasks_dir, None)
    # half the generation targets are nxdt's own greedy continuations: exact-match 0.5, not a trivial 0
    lm = NxdtLM(load_for_inference(ckpt), batch_size=4)
    manager = task_manager(TASKS, tasks_dir)
    first = evaluate_tasks(lm, ["nxdt_gen"], manager, log_samples=True)
    greedy = [r[0][0] for r in _per_sample(first, "nxdt_gen")]
    assert len(greedy) == 8 and any(g.strip() for g in greedy)
    _write_tasks(tasks_dir, [g if i % 2 == 0 else g + " amen" for i, g in enumerate(greedy)])

    assert nxdt(_command(ckpt, tasks_dir)) == 0
    printed = capsys.readouterr().out
    saved = json.loads(results_path(ckpt, TASKS).read_text())
    assert results_path(ckpt, TASKS).parent == ckpt.parent and "nxdt_mc" in printed
    ours = evaluate_tasks(lm, TASKS, manager, log_samples=True)
    for task in TASKS:  # the command's per-example records are these
        assert _per_sample(saved, task) == _per_sample(ours, task)
    hf = HFLM(pretrained=str(tmp_path / "hf"), device="cpu", dtype="float32", batch_size=4)
    theirs = evaluate_tasks(hf, TASKS, manager, log_samples=True)

    _close(ours, theirs)
    _close(saved, theirs)
    assert ours["results"]["nxdt_gen"]["exact_match,none"] == 0.5
    assert 0 < ours["results"]["nxdt_mc"]["acc,none"] < 1  # some right, some wrong: the comparison can fail
    assert all(r[0][0] < -100 for r in _per_sample(ours, "nxdt_rolling"))
    ppl = saved["results"]["nxdt_rolling"]["word_perplexity,none"]
    assert abs(ppl / theirs["results"]["nxdt_rolling"]["word_perplexity,none"] - 1) < 1e-4
    docs = [json.loads(line)["text"] for line in (tasks_dir / "rolling.jsonl").read_text().splitlines()]
    assert min(len(lm.tok_encode(d)) for d in docs) > 3 * lm.max_length  # several windows per document


def _close(ours: dict, theirs: dict) -> None:
    """Equal metrics and generations; each log-likelihood within TOL."""
    for task, metric in (("nxdt_mc", "acc,none"), ("nxdt_mc", "acc_norm,none"), ("nxdt_gen", "exact_match,none")):
        assert ours["results"][task][metric] == theirs["results"][task][metric], (task, metric)
    assert _per_sample(ours, "nxdt_gen") == _per_sample(theirs, "nxdt_gen")
    for task in ("nxdt_mc", "nxdt_rolling"):
        a, b = _per_sample(ours, task), _per_sample(theirs, task)
        flat = [(x[0], y[0]) for ra, rb in zip(a, b) for x, y in zip(ra, rb)]
        assert len(flat) == {"nxdt_mc": 24, "nxdt_rolling": 3}[task]
        for x, y in flat:
            x, y = (x, y) if task == "nxdt_mc" else ([x], [y])
            # a document's total (600+ tokens, about -4500) is a float32 sum: float32's spacing there is 5e-4
            assert abs(x[0] - y[0]) < TOL + 1e-7 * abs(y[0]) and x[1:] == y[1:], (task, x, y)


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    _, ckpt = _nxdt_checkpoint(tmp_path, "megatron")
    cases = {
        "unknown task": (["--checkpoint", ckpt, "--tasks", "no_such_task_here"], "unknown task no_such_task_here"),
        "missing": (["--checkpoint", tmp_path / "nope", "--tasks", "x"], "does not exist"),
        "include": (["--checkpoint", ckpt, "--tasks", "x", "--include-path", tmp_path / "nope"], "not a directory"),
        "batch": (["--checkpoint", ckpt, "--tasks", "x", "--batch-size", "0"], "--batch-size must be >= 1"),
        "no tasks": (["--checkpoint", ckpt, "--tasks", ","], "at least one task"),
    }
    for name, (argv, message) in cases.items():
        code = nxdt(["evaluate", *argv])
        err = capsys.readouterr().err
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, (name, err)
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # not installed
    monkeypatch.delitem(sys.modules, "nxdt.inference.harness_lm", raising=False)
    assert nxdt(["evaluate", "--checkpoint", str(ckpt), "--tasks", "x"]) == 2
    assert "install nxdt[eval]" in capsys.readouterr().err
