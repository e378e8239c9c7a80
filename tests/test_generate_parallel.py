"""`nxdt generate` under torchrun: the model split over 2 ranks with tensor parallelism (each rank reads
only its shards; LoRA adapters merged before the split) gives the one-process greedy tokens, and every
rank draws the same sampled tokens. One launch covers every model family."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

SOURCES = ("megatron", "hf", "moe", "hf_moe", "neox")  # transformers' GPT-NeoX has no tensor-parallel plan


def test_tensor_parallel_generation_equals_one_process(tmp_path):
    from conftest import run_worker
    from test_convert import _nxdt_checkpoint
    from test_generate import PROMPTS, _lora_checkpoint

    from nxdt.inference.generate import SamplingParams, generate
    from nxdt.inference.load import load_for_inference

    ckpts = {source: str(_nxdt_checkpoint(tmp_path, source)[1]) for source in SOURCES}
    ckpts["lora_adapter_only"] = str(_lora_checkpoint(tmp_path, adapter_only=True)[0])
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(ckpts))
    got = run_worker(__file__, 2, tmp_path / "out.json", "NXDT_TEST_OUT", timeout=300)
    for name, path in ckpts.items():
        model = load_for_inference(Path(path)).model
        assert got[name]["greedy"] == generate(model, PROMPTS, SamplingParams(max_new_tokens=10)), name
        assert got[name]["sampled_rank0"] == got[name]["sampled_rank1"], name


def _worker() -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from conftest import exit_worker
    from test_generate import PROMPTS

    import torch.distributed as dist

    from nxdt.inference.generate import SamplingParams, generate
    from nxdt.inference.load import load_for_inference
    from nxdt.inference.load import tensor_parallel_group

    out = Path(os.environ["NXDT_TEST_OUT"])
    ckpts = json.loads((out.parent / "spec.json").read_text())
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
    if rank == 0:
        out.write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()
    exit_worker()


if __name__ == "__main__":
    torch.set_num_threads(1)
    _worker()
