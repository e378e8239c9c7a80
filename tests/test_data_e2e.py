"""End to end through examples/train.py: the HF and SFT modules and the custom-module example train
and validate; bad data files stop the CLI with one line and exit 2. Each launch costs ~10 s of imports,
so every run is a module-scoped fixture shared by the checks."""

from __future__ import annotations

import gzip
import json

import pytest
from conftest import CORPUS, TINY_OVERRIDES, read_scalars, run_cli

STEPS = 4


def _common(log_dir) -> list[str]:
    return ["--config-name", "tiny_llama_cpu", *TINY_OVERRIDES, "trainer.devices=1", f"trainer.max_steps={STEPS}",
            "trainer.val_check_interval=2", "trainer.limit_val_batches=1", "data.data_prefix=null",
            "data.num_workers=0", "model.optim.lr=1e-2", "model.optim.sched.warmup_steps=1",
            f"exp_manager.explicit_log_dir={log_dir}"]


def _chapters(n):
    with gzip.open(CORPUS, "rt", encoding="utf-8") as f:
        return [json.loads(line)["text"] for _, line in zip(range(n), f)]


@pytest.fixture(scope="module")
def hf_run(tmp_path_factory):
    import datasets

    from nxdt.data.tokenizers import build_tokenizer

    root = tmp_path_factory.mktemp("hf_e2e")
    tok = build_tokenizer(None)
    ids = [t for text in _chapters(8) for t in tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]]
    rows = [ids[i : i + 33] for i in range(0, len(ids) - 33, 32)]
    datasets.Dataset.from_dict({"input_ids": rows[:-16]}).save_to_disk(str(root / "train"))
    datasets.Dataset.from_dict({"input_ids": rows[-16:]}).save_to_disk(str(root / "val"))
    log_dir = root / "logs"
    proc = run_cli([*_common(log_dir), "model_source=hf", "model.model_config=${nxdt_conf:model_configs/tiny_llama/config.json}",
                    f"data.train_dir={root / 'train'}", f"data.val_dir={root / 'val'}"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return read_scalars(log_dir)


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft_e2e")
    words = " ".join(_chapters(2)).split()
    rows = [{"input": " ".join(words[i : i + 5]), "output": " ".join(words[i + 5 : i + 5 + 3 + i % 7])}
            for i in range(0, 600, 12)]
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    log_dir = root / "logs"
    proc = run_cli([*_common(log_dir), f"data.train_dir={root / 'train.jsonl'}", f"data.val_dir={root / 'train.jsonl'}",
                    "model_alignment_strategy={sft: {packing: true, prompt_template: 'Q: {input} A: '}}"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return read_scalars(log_dir)


@pytest.fixture(scope="module")
def custom_run(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("custom_e2e")
    proc = run_cli(["--config-path", "examples/conf", "--config-name", "custom_data_module", "trainer.max_steps=3",
                    "trainer.val_check_interval=3", "trainer.limit_val_batches=1", "data.chapters=5", "trainer.log_every_n_steps=1",
                    "trainer.enable_progress_bar=false", f"exp_manager.explicit_log_dir={log_dir}"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return read_scalars(log_dir)


@pytest.mark.parametrize("run", ["hf_run", "sft_run"])
def test_module_trains_and_validates(run, request):
    scalars = request.getfixturevalue(run)
    losses = [v for _, v in sorted(scalars["reduced_train_loss"].items())]
    assert len(losses) == STEPS and all(0 < x < 12 for x in losses)
    assert losses[-1] < losses[0]
    assert len(scalars["val_loss"]) == 2  # val_check_interval=2 over 4 steps
    assert [v for _, v in sorted(scalars["consumed_samples"].items())] == [8.0 * (i + 1) for i in range(STEPS)]


def test_custom_module_example_trains(custom_run):
    assert len(custom_run["reduced_train_loss"]) == 3 and len(custom_run["val_loss"]) == 1


def test_bad_data_files_exit_2_with_one_line(tmp_path, kjv_prefix):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"input": "a", "output": "b"}\n{"input": "c"}\n')
    proc = run_cli([*_common(tmp_path / "l1"), f"data.train_dir={bad}", "model_alignment_strategy={sft: {}}"])
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert lines == [f"error: {bad}:2: row has no 'output' (SFT rows need 'input' and 'output'; has ['input'])"]


def test_bad_megatron_input_exits_2(tmp_path, kjv_prefix):
    import shutil

    prefix = str(tmp_path / "short")
    shutil.copy(kjv_prefix + ".idx", prefix + ".idx")
    with open(kjv_prefix + ".bin", "rb") as src, open(prefix + ".bin", "wb") as dst:
        dst.write(src.read()[:-4])  # the .bin no longer matches its index
    proc = run_cli([*_common(tmp_path / "l2"), f"data.data_prefix=[1.0,{prefix}]"])
    assert proc.returncode == 2
    errors = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(f"error: {prefix}.bin: size ") and "disagrees with" in errors[0]
    proc = run_cli([*_common(tmp_path / "l3"), f"data.data_prefix=[1.0,{kjv_prefix},2.0]"])
    assert proc.returncode == 2
    assert "error: data.data_prefix: expected [weight, path, weight, path, ...]" in proc.stderr, proc.stderr[-500:]
    proc = run_cli([*_common(tmp_path / "l4"), f"data.data_prefix=[heavy,{kjv_prefix}]"])
    assert proc.returncode == 2 and "data.data_prefix" in proc.stderr and "heavy" in proc.stderr, proc.stderr[-500:]
