"""End to end through examples/train.py: the HF and SFT modules and the custom-module example train
and validate; bad data files stop the run with one line and exit 2. A launch costs ~5 s of imports,
so all runs share one (conftest.run_pool), each through the entry examples/train.py calls."""

from __future__ import annotations

import gzip
import json
import shutil

import pytest
from conftest import CORPUS, TINY_OVERRIDES, read_scalars, run_pool

STEPS = 4


def _common(log_dir) -> list[str]:
    return ["--config-name", "tiny_llama_cpu", *TINY_OVERRIDES, "trainer.devices=1", f"trainer.max_steps={STEPS}",
            "trainer.val_check_interval=2", "trainer.limit_val_batches=1", "data.data_prefix=null",
            "data.num_workers=0", "model.optim.lr=1e-2", "model.optim.sched.warmup_steps=1",
            f"exp_manager.explicit_log_dir={log_dir}"]


def _chapters(n):
    with gzip.open(CORPUS, "rt", encoding="utf-8") as f:
        return [json.loads(line)["text"] for _, line in zip(range(n), f)]


def _hf_data(root):
    import datasets

    from nxdt.data.tokenizers import build_tokenizer

    tok = build_tokenizer(None)
    ids = [t for text in _chapters(8) for t in tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]]
    rows = [ids[i : i + 33] for i in range(0, len(ids) - 33, 32)]
    datasets.Dataset.from_dict({"input_ids": rows[:-16]}).save_to_disk(str(root / "train"))
    datasets.Dataset.from_dict({"input_ids": rows[-16:]}).save_to_disk(str(root / "val"))
    return ["model_source=hf", "model.model_config=${nxdt_conf:model_configs/tiny_llama/config.json}",
            f"data.train_dir={root / 'train'}", f"data.val_dir={root / 'val'}"]


def _sft_data(root):
    words = " ".join(_chapters(2)).split()
    rows = [{"input": " ".join(words[i : i + 5]), "output": " ".join(words[i + 5 : i + 5 + 3 + i % 7])}
            for i in range(0, 600, 12)]
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return [f"data.train_dir={root / 'train.jsonl'}", f"data.val_dir={root / 'train.jsonl'}",
            "model_alignment_strategy={sft: {packing: true, prompt_template: 'Q: {input} A: '}}"]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, kjv_prefix):
    """The bad inputs: an SFT file with a row missing 'output', a Megatron .bin one token short."""
    root = tmp_path_factory.mktemp("bad_inputs")
    bad_sft = root / "bad.jsonl"
    bad_sft.write_text('{"input": "a", "output": "b"}\n{"input": "c"}\n')
    short = str(root / "short")
    shutil.copy(kjv_prefix + ".idx", short + ".idx")
    with open(kjv_prefix + ".bin", "rb") as src, open(short + ".bin", "wb") as dst:
        dst.write(src.read()[:-4])  # the .bin no longer matches its index
    return {"bad_sft": bad_sft, "short": short}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, kjv_prefix, inputs):
    """Every run of this file in one single-process launch (conftest.run_pool): imports paid once."""
    root = tmp_path_factory.mktemp("data_e2e")
    (root / "hf").mkdir()
    (root / "sft").mkdir()
    argv = {
        "hf": [*_common(root / "hf" / "logs"), *_hf_data(root / "hf")],
        "sft": [*_common(root / "sft" / "logs"), *_sft_data(root / "sft")],
        "custom": ["--config-path", "examples/conf", "--config-name", "custom_data_module", "trainer.max_steps=3",
                   "trainer.val_check_interval=3", "trainer.limit_val_batches=1", "data.chapters=5",
                   "trainer.log_every_n_steps=1", "trainer.enable_progress_bar=false",
                   f"exp_manager.explicit_log_dir={root / 'custom' / 'logs'}"],
        "bad_sft": [*_common(root / "l1"), f"data.train_dir={inputs['bad_sft']}", "model_alignment_strategy={sft: {}}"],
        "short_bin": [*_common(root / "l2"), f"data.data_prefix=[1.0,{inputs['short']}]"],
        "odd_prefix": [*_common(root / "l3"), f"data.data_prefix=[1.0,{kjv_prefix},2.0]"],
        "word_weight": [*_common(root / "l4"), f"data.data_prefix=[heavy,{kjv_prefix}]"],
    }
    bad = {"bad_sft", "short_bin", "odd_prefix", "word_weight"}
    procs = run_pool(argv, 1, root / "pool", expect={name: 2 for name in bad})
    return {name: (proc, None if name in bad else read_scalars(root / name / "logs")) for name, proc in procs.items()}


@pytest.mark.parametrize("run", ["hf", "sft"])
def test_module_trains_and_validates(run, runs):
    scalars = runs[run][1]
    losses = [v for _, v in sorted(scalars["reduced_train_loss"].items())]
    assert len(losses) == STEPS and all(0 < x < 12 for x in losses)
    assert losses[-1] < losses[0]
    assert len(scalars["val_loss"]) == 2  # val_check_interval=2 over 4 steps
    assert [v for _, v in sorted(scalars["consumed_samples"].items())] == [8.0 * (i + 1) for i in range(STEPS)]


def test_custom_module_example_trains(runs):
    custom = runs["custom"][1]
    assert len(custom["reduced_train_loss"]) == 3 and len(custom["val_loss"]) == 1


def test_bad_data_files_exit_2_with_one_line(runs, inputs):
    proc = runs["bad_sft"][0]
    lines = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    bad = inputs["bad_sft"]
    assert lines == [f"error: {bad}:2: row has no 'output' (SFT rows need 'input' and 'output'; has ['input'])"]


def test_bad_megatron_input_exits_2(runs, inputs):
    errors = [x for x in runs["short_bin"][0].stderr.splitlines() if x.startswith("error:")]
    prefix = inputs["short"]
    assert len(errors) == 1 and errors[0].startswith(f"error: {prefix}.bin: size ") and "disagrees with" in errors[0]
    stderr = runs["odd_prefix"][0].stderr
    assert "error: data.data_prefix: expected [weight, path, weight, path, ...]" in stderr, stderr[-500:]
    stderr = runs["word_weight"][0].stderr
    assert "data.data_prefix" in stderr and "heavy" in stderr, stderr[-500:]
