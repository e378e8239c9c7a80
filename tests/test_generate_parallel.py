"""`nxdt generate` under torchrun: the model split over 2 ranks with tensor parallelism (each rank reads
only its shards; LoRA adapters merged before the split) gives the one-process greedy tokens, and every
rank draws the same sampled tokens. One launch covers every model family, and then runs tests/test_lm_eval.py's
`nxdt evaluate --tasks` on 2 ranks (its one-process side runs here first): a launch is mostly imports, paid once."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

SOURCES = ("megatron", "hf", "moe", "hf_moe", "neox")  # transformers' GPT-NeoX has no tensor-parallel plan


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    """The checkpoints, the one-process evaluation, and the one 2-rank launch (generation, then evaluation)."""
    from conftest import run_worker
    from test_convert import _nxdt_checkpoint
    from test_generate import _lora_checkpoint
    from test_lm_eval import TASKS, _command, _write_tasks, nxdt

    import datasets.config

    from nxdt.inference.harness import results_path

    tmp_path = tmp_path_factory.mktemp("generate_parallel")
    ckpts = {source: str(_nxdt_checkpoint(tmp_path, source)[1]) for source in SOURCES}
    ckpts["lora_adapter_only"] = str(_lora_checkpoint(tmp_path, adapter_only=True)[0])
    eval_dir = tmp_path / "evaluate"
    eval_dir.mkdir()
    _, eval_ckpt = _nxdt_checkpoint(eval_dir, "megatron")
    tasks_dir = eval_dir / "tasks"
    _write_tasks(tasks_dir, None)
    with pytest.MonkeyPatch.context() as mp:  # as test_lm_eval's _offline
        for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
            mp.setenv(var, "1")
        mp.setattr(datasets.config, "HF_HUB_OFFLINE", True)
        mp.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
        mp.setenv("TOKENIZERS_PARALLELISM", "false")
        assert nxdt(_command(eval_ckpt, tasks_dir)) == 0
    one = eval_dir / "one_process.json"
    shutil.move(results_path(eval_ckpt, TASKS), one)
    (tmp_path / "spec.json").write_text(json.dumps({"generate": ckpts, "evaluate": _command(eval_ckpt, tasks_dir)[1:]}))
    got = run_worker(__file__, 2, tmp_path / "out.json", "NXDT_TEST_OUT", timeout=300)
    return {"ckpts": ckpts, "got": got, "eval_tp": json.loads(results_path(eval_ckpt, TASKS).read_text()),
            "eval_one": json.loads(one.read_text())}


def test_tensor_parallel_generation_equals_one_process(launch):
    from test_generate import PROMPTS

    from nxdt.inference.generate import SamplingParams, generate
    from nxdt.inference.load import load_for_inference

    got = launch["got"]["generate"]
    for name, path in launch["ckpts"].items():
        model = load_for_inference(Path(path)).model
        assert got[name]["greedy"] == generate(model, PROMPTS, SamplingParams(max_new_tokens=10)), name
        assert got[name]["sampled_rank0"] == got[name]["sampled_rank1"], name


@pytest.mark.slow
def test_tensor_parallel_scores_as_one_process(launch):
    """tests/test_lm_eval.py's tasks under `nxdt evaluate --tasks` on 2 ranks, the model split with tensor
    parallelism: the one-process generations and accuracies, its log-likelihoods within 1e-4."""
    from test_lm_eval import _close

    assert launch["got"]["evaluate"] == {"split": True}
    _close(launch["eval_tp"], launch["eval_one"])


def _worker() -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from conftest import exit_worker
    from test_generate import PROMPTS

    import torch.distributed as dist

    from nxdt.inference.generate import SamplingParams, generate
    from nxdt.inference.load import load_for_inference
    from nxdt.inference.load import tensor_parallel_group

    out = Path(os.environ["NXDT_TEST_OUT"])
    spec = json.loads((out.parent / "spec.json").read_text())
    ckpts = spec["generate"]
    rank, mesh = tensor_parallel_group()
    results = {}
    for name, path in ckpts.items():
        model = load_for_inference(Path(path), tp_mesh=mesh).model
        q = model.model.layers[0].self_attn.q_proj.weight
        assert q.to_local().shape[0] * 2 == q.shape[0], name  # really split
        greedy = generate(model, PROMPTS, SamplingParams(max_new_tokens=10))
        sampled = generate(model, PROMPTS, SamplingParams(max_new_tokens=10, temperature=0.9, top_k=40, seed=5))
        both = [None, None]
        dist.all_gather_object(both, sampled)
        results[name] = {"greedy": greedy, "sampled_rank0": both[0], "sampled_rank1": both[1]}
    dist.barrier()
    # then test_lm_eval's `nxdt evaluate --tasks` (rank 0 writes the results) on the same process group
    from nxdt.inference import harness

    argv = spec["evaluate"]
    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        os.environ[var] = "1"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _, mesh = harness.tensor_parallel_group()
    q = load_for_inference(Path(argv[1]), tp_mesh=mesh).model.model.layers[0].self_attn.q_proj.weight
    split = q.to_local().shape[0] * 2 == q.shape[0]
    assert harness.main(argv) == 0  # the command's own process group: destroyed at its end
    assert not dist.is_initialized()
    if rank == 0:
        out.write_text(json.dumps({"generate": results, "evaluate": {"split": split}}))
    exit_worker()


if __name__ == "__main__":
    torch.set_num_threads(1)
    _worker()
