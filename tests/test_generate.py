"""`nxdt generate`: the KV cache, sampling, loading any checkpoint, and greedy output equal to
transformers' `generate()` on the `nxdt convert nxdt-to-hf` export, token for token."""

from __future__ import annotations

import json
import re

import pytest
import torch
from conftest import REPO, TOKENIZER_DIR
from test_convert import _nxdt_checkpoint

from nxdt.checkpoint.checkpointer import save_weights
from nxdt.config import to_yaml
from nxdt.spec import config_from_dict
from nxdt.inference.generate import SamplingParams, filter_logits, generate, next_tokens
from nxdt.inference.load import load_for_inference
from nxdt.models.kv_cache import KVCache, StaticKVCache
from nxdt.models.llama import LlamaArgs, NxdtLlamaForCausalLM
from nxdt.models.moe import MoEArgs
from nxdt.tools import generate as generate_cli
from nxdt.tools.convert import nxdt_to_hf

PROMPTS = [[5, 17, 300, 41, 9, 77, 1000, 3], [812, 4, 66], [2048]]  # left padding: 5 and 7 pad columns

VARIANTS = {
    "llama_gqa": {},
    "sliding_window": {"sliding_window_size": 4},
    "learned_positions": {"position_embedding_type": "learned_absolute"},
    "neox": {"transformer_block_type": "gpt_j", "gpt_j_tied": False, "normalization": "layernorm",
             "activation": "gelu", "has_bias": True, "rotary_percentage": 0.25},
    "post_ln": {"transformer_block_type": "post_ln"},
    "moe": {"moe": MoEArgs(num_experts=4, top_k=2, dropless=True)},
}


def _native(variant: str) -> NxdtLlamaForCausalLM:
    torch.manual_seed(0)
    args = LlamaArgs(vocab_size=2056, hidden_size=64, num_layers=2, num_attention_heads=4, num_kv_heads=2,
                     ffn_hidden_size=96, max_position_embeddings=64, init_method_std=0.2,
                     **VARIANTS[variant])
    model = NxdtLlamaForCausalLM(args)
    model.init_weights()
    with torch.no_grad():  # biases and norms off their init, so a misplaced one changes the tokens
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def _greedy_by_full_forward(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(prompt):].tolist()


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_cache_equals_recompute_and_the_training_forward(variant):
    """A left-padded batch with the cache = without it = each prompt alone = argmax of the plain
    (training) forward over the growing sequence."""
    model = _native(variant)
    params = SamplingParams(max_new_tokens=10)
    cached = generate(model, PROMPTS, params)
    assert cached == generate(model, PROMPTS, params, use_cache=False)
    assert cached == [generate(model, [p], params)[0] for p in PROMPTS]
    assert cached == [_greedy_by_full_forward(model, p, 10) for p in PROMPTS]
    assert len({tuple(c) for c in cached}) == 3


def test_prefill_logits_equal_the_forward_and_decode_logits_match():
    model = _native("llama_gqa")
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        full = model(ids)
        cache = KVCache(16, batch_size=1)
        prefill = model(ids[:, :5], kv_cache=cache)
        steps = [model(ids[:, i:i + 1], kv_cache=cache) for i in range(5, 8)]
    assert (prefill - full[:, :5]).abs().max() < 1e-5
    assert (torch.cat(steps, 1) - full[:, 5:]).abs().max() < 1e-5
    assert cache.length == 8
    with pytest.raises(ValueError, match="KV cache full"):
        model(torch.zeros(1, 9, dtype=torch.long), kv_cache=cache)


def test_top_k_and_top_p_filter_as_transformers_does():
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    torch.manual_seed(1)
    logits = torch.randn(4, 50) * 3
    for k in (1, 5, 50):
        want = TopKLogitsWarper(top_k=k)(None, logits.clone())
        assert torch.equal(filter_logits(logits, k, None), want)
    for p in (0.1, 0.5, 0.9, 0.999):
        want = TopPLogitsWarper(top_p=p)(None, logits.clone())
        assert torch.equal(filter_logits(logits, None, p), want)


def test_sampling_is_seeded_and_padded_vocabulary_rows_are_never_drawn():
    logits = torch.zeros(3, 16)
    logits[:, 12:] = 50.0  # the padding rows are by far the most likely
    params = SamplingParams(temperature=1.0, seed=7, vocab_size=12)
    draws = [next_tokens(logits, params, torch.Generator().manual_seed(7)) for _ in range(2)]
    assert torch.equal(draws[0], draws[1]) and int(draws[0].max()) < 12
    assert int(next_tokens(logits, SamplingParams(vocab_size=12), None).max()) < 12  # greedy too
    model = _native("llama_gqa")
    a = generate(model, PROMPTS, SamplingParams(max_new_tokens=8, temperature=0.9, top_k=20, top_p=0.9, seed=3))
    b = generate(model, PROMPTS, SamplingParams(max_new_tokens=8, temperature=0.9, top_k=20, top_p=0.9, seed=3))
    c = generate(model, PROMPTS, SamplingParams(max_new_tokens=8, temperature=0.9, top_k=20, top_p=0.9, seed=4))
    assert a == b and a != c


def test_a_row_stops_at_eos_and_the_others_go_on():
    model = _native("llama_gqa")
    free = generate(model, PROMPTS, SamplingParams(max_new_tokens=10))
    eos = free[1][3]  # row 1's fourth token ends it
    stopped = generate(model, PROMPTS, SamplingParams(max_new_tokens=10, eos_token_id=eos))
    assert stopped[1] == free[1][:free[1].index(eos) + 1]
    for row in (0, 2):
        want = free[row][:free[row].index(eos) + 1] if eos in free[row] else free[row]
        assert stopped[row] == want


@pytest.mark.parametrize("source", ["megatron", "hf", "moe", "hf_moe", "neox", "hf_neox"])
def test_greedy_equals_transformers_generate_on_the_export(tmp_path, source):
    """The checkpoint loaded by nxdt (from its config.yaml) and the `nxdt convert nxdt-to-hf` folder
    loaded by transformers give the same tokens for a left-padded batch."""
    from transformers import AutoModelForCausalLM

    _, ckpt = _nxdt_checkpoint(tmp_path, source)
    nxdt_to_hf(ckpt, tmp_path / "hf", max_shard_bytes=10**9)
    loaded = load_for_inference(ckpt)
    ours = generate(loaded.model, PROMPTS, SamplingParams(max_new_tokens=12), pad_id=0)

    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32, attn_implementation="sdpa").eval()
    hf.generation_config.eos_token_id = None
    hf.config.output_router_logits = False  # transformers' Mixtral cannot compute its aux loss on a padded batch
    width = max(map(len, PROMPTS))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in PROMPTS])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in PROMPTS])
    with torch.no_grad():
        out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0,
                          eos_token_id=None)
    assert ours == out[:, width:].tolist()


def _lora_checkpoint(tmp_path, adapter_only: bool):
    """A megatron checkpoint whose q/v projections carry trained (non-zero) adapters, and the base."""
    from nxdt.models.lora import inject_lora, merged_state_dict

    base_model, base_ckpt = _nxdt_checkpoint(tmp_path, "megatron")
    torch.manual_seed(3)
    inject_lora(base_model, ["q_proj", "v_proj"], rank=4, alpha=8.0)
    state = {k: v + 0.05 * torch.randn_like(v) if "lora_B" in k else v for k, v in base_model.state_dict().items()}
    lora = {"adapter_only": adapter_only, "lora_rank": 4, "lora_alpha": 8.0, "lora_bias": "none"}
    saved = {k: v for k, v in state.items() if "lora_" in k} if adapter_only else state
    cfg = config_from_dict({**json.loads(json.dumps(_cfg_dict())),
                            "model_alignment_strategy": {"peft": {"lora_rank": 4, "lora_alpha": 8.0}},
                            "exp_manager": {"resume_from_checkpoint": str(base_ckpt)}})
    ckpt = tmp_path / f"lora_{adapter_only}"
    save_weights(saved, ckpt, {"lora": lora}, files={"config.yaml": to_yaml(cfg)})
    return ckpt, merged_state_dict(state, (4, 8.0))


def _cfg_dict():
    from test_convert import TINY

    return {"model_source": "megatron", "model": dict(TINY),
            "data": {"tokenizer": {"library": "huggingface", "type": str(TOKENIZER_DIR)}}}


@pytest.mark.parametrize("adapter_only", [False, True])
def test_lora_checkpoints_generate_as_the_merged_model(tmp_path, adapter_only):
    ckpt, merged = _lora_checkpoint(tmp_path, adapter_only)
    loaded = load_for_inference(ckpt)  # adapter-only: the base from the run's resume_from_checkpoint
    assert any("merged" in n for n in loaded.notes)
    for key, value in merged.items():
        assert torch.equal(loaded.model.state_dict()[key], value), key
    plain = load_for_inference(tmp_path / "ckpt_megatron").model
    params = SamplingParams(max_new_tokens=8)
    assert generate(loaded.model, PROMPTS, params) != generate(plain, PROMPTS, params)  # the adapters count


# --------------------------------------------------------------------------- the command
def _run(capsys, argv):
    from nxdt.cli import main

    code = main(["generate", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_prints_streams_and_writes_jsonl(tmp_path, capsys):
    _, ckpt = _nxdt_checkpoint(tmp_path, "megatron")
    common = ["--checkpoint", ckpt, "--max-new-tokens", 12, "--temperature", 0.9, "--seed", 5, "--ignore-eos"]
    code, out, err = _run(capsys, [*common, "--prompt", "And God said"])
    assert code == 0 and out.startswith("And God said") and "tokens/s" in err
    code, streamed, _ = _run(capsys, [*common, "--prompt", "And God said", "--stream"])
    assert code == 0 and streamed == out
    prompts = tmp_path / "prompts.txt"
    prompts.write_text('In the beginning\n\n{"prompt": "And God said"}\n')
    code, out, _ = _run(capsys, [*common, "--prompt-file", prompts, "--output", tmp_path / "out.jsonl"])
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert code == 0 and [r["prompt"] for r in rows] == ["In the beginning", "And God said"]
    assert all(len(r["tokens"]) == 12 for r in rows) and "--- [2]\nAnd God said" in out


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    _, ckpt = _nxdt_checkpoint(tmp_path, "megatron")
    base = ["--checkpoint", ckpt, "--prompt", "And God said"]
    bigger = tmp_path / "bigger_tokenizer"
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    tok.add_tokens([f"<extra_{i}>" for i in range(300)])
    tok.save_pretrained(bigger)
    broken = tmp_path / "broken"
    import shutil

    shutil.copytree(ckpt, broken)
    (broken / "COMPLETE").unlink()
    empty, run = tmp_path / "empty", tmp_path / "run"
    empty.mkdir()
    shutil.copytree(broken, run / "checkpoints" / "broken")
    cases = {
        "top_p": ([*base, "--top-p", 0], "--top-p must be in (0, 1]"),
        "top_p_high": ([*base, "--top-p", 1.5], "--top-p must be in (0, 1]"),
        "incomplete": (["--checkpoint", broken, "--prompt", "x"], "is incomplete"),
        "not_a_checkpoint": (["--checkpoint", empty, "--prompt", "x"], "not a checkpoint (no meta.json) and no "
                             "checkpoints in it"),
        "no_complete": (["--checkpoint", run, "--prompt", "x"], f"--checkpoint {run}: no complete checkpoint in it "
                        "(1 incomplete"),
        "missing": (["--checkpoint", tmp_path / "nope", "--prompt", "x"], "does not exist"),
        "too_long": (["--checkpoint", ckpt, "--prompt", "And God said " * 60], "longer than the model's context of 128"),
        "tokenizer": ([*base, "--tokenizer", bigger], "does not match the model"),
        "no_config": (None, "has no config.yaml"),
    }
    no_config = tmp_path / "no_config"
    shutil.copytree(ckpt, no_config)
    (no_config / "config.yaml").unlink()
    cases["no_config"] = (["--checkpoint", no_config, "--prompt", "x"], "has no config.yaml")
    for name, (argv, message) in cases.items():
        code, out, err = _run(capsys, argv)
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, (name, err)
        assert "Traceback" not in err


def test_a_transformers_folder_a_converted_checkpoint_and_a_run_folder_generate_alike(tmp_path, capsys):
    """Every form `--checkpoint` takes gives the tokens of the checkpoint itself: its nxdt-to-hf export
    (written with normal file modes, not safetensors' 0600), that export converted back (no config.yaml:
    on main "has no config.yaml"), and a run folder (its newest complete checkpoint, named in a note; also
    as `nxdt convert nxdt-to-hf --input`)."""
    import os
    import shutil
    import stat

    from nxdt.tools.convert import hf_to_nxdt

    _, ckpt = _nxdt_checkpoint(tmp_path, "hf")
    nxdt_to_hf(ckpt, tmp_path / "hf", max_shard_bytes=10**9)
    mask = os.umask(0)
    os.umask(mask)
    assert stat.S_IMODE((tmp_path / "hf" / "model.safetensors").stat().st_mode) == 0o666 & ~mask
    hf_to_nxdt(tmp_path / "hf", tmp_path / "converted")
    checkpoints = tmp_path / "run" / "checkpoints"
    shutil.copytree(ckpt, checkpoints / "tiny--step=5")
    shutil.copytree(ckpt, checkpoints / "tiny--step=10")
    (checkpoints / "tiny--step=10" / "COMPLETE").unlink()  # a save that did not finish
    outs = {}
    for name in ("ckpt_hf", "hf", "converted", "run"):
        code, out, err = _run(capsys, ["--checkpoint", tmp_path / name, "--prompt", "And God said",
                                       "--max-new-tokens", 8, "--temperature", 0, "--ignore-eos"])
        assert code == 0, err
        outs[name] = out
    assert len(set(outs.values())) == 1 and len(outs["hf"]) > len("And God said ")
    assert (f"note: checkpoint {checkpoints / 'tiny--step=5'} (the newest complete one in {tmp_path / 'run'}; "
            "1 incomplete skipped)") in err
    from nxdt.cli import main  # nxdt convert nxdt-to-hf --input RUN_DIR: the same checkpoint

    assert main(["convert", "nxdt-to-hf", "--input", str(tmp_path / "run"), "--output", str(tmp_path / "hf2")]) == 0
    assert f"note: checkpoint {checkpoints / 'tiny--step=5'}" in capsys.readouterr().out
    assert (tmp_path / "hf2" / "model.safetensors").read_bytes() == (tmp_path / "hf" / "model.safetensors").read_bytes()


def test_right_padded_recompute_gives_the_same_tokens():
    """length_multiple (sequence parallelism during training's samples): whole multiples of 4 columns,
    recomputed, padded on the right."""
    model = _native("llama_gqa")
    params = SamplingParams(max_new_tokens=6)
    assert generate(model, PROMPTS, params, length_multiple=4) == generate(model, PROMPTS, params)


@pytest.mark.parametrize("variant", ["llama_gqa", "sliding_window"])
def test_static_cache_decode_logits_equal_the_growing_cache(variant):
    """StaticKVCache (compile_decode's): every step attends to the whole buffer, the columns not yet
    written masked; the logits equal the plain cache's, left padding and a sliding window included."""
    model = _native(variant)
    ids = torch.zeros(3, 8, dtype=torch.long)
    valid = torch.zeros(3, 8, dtype=torch.bool)
    for row, p in enumerate(PROMPTS):
        ids[row, 8 - len(p):], valid[row, 8 - len(p):] = torch.tensor(p), True
    positions = (valid.long().cumsum(-1) - 1).clamp(min=0)
    plain, static = KVCache(20, valid), StaticKVCache(32, valid)
    with torch.no_grad():
        assert torch.equal(model(ids, positions, kv_cache=plain), model(ids, positions, kv_cache=static))
        static.start_decoding()
        for step in range(6):
            token, pos = torch.tensor([[7 + step], [300], [2000 - step]]), positions[:, -1:] + 1 + step
            static.position.fill_(8 + step)
            diff = (model(token, pos, kv_cache=plain) - model(token, pos, kv_cache=static)).abs().max()
            assert diff < 1e-5, (step, diff)


def test_compiled_decode_gives_the_eager_tokens_and_log_probs():
    """compile_decode (torch.compile of the decode step over the static cache): greedy and seeded
    per-row sampling give the eager loop's tokens (one compiled graph), log-probs within 1e-6 relative:
    inductor's fused kernels round differently (measured 1.9e-6 at log-probs of -4 to -7, ~3 fp32
    ulps; the eager loop equals the training forward within 1e-6 absolute, tests/test_grpo.py)."""
    model = _native("llama_gqa")
    greedy = SamplingParams(max_new_tokens=10, eos_token_id=None)
    assert generate(model, PROMPTS, greedy, compile_decode=True) == generate(model, PROMPTS, greedy)
    sampled = SamplingParams(max_new_tokens=10, temperature=1.0, eos_token_id=None)
    runs = []
    for compiled in (False, True):
        logps: list[list[float]] = []
        gens = [torch.Generator().manual_seed(11 + i) for i in range(3)]
        runs.append((generate(model, PROMPTS, sampled, generators=gens, logps=logps, compile_decode=compiled), logps))
    assert runs[0][0] == runs[1][0]
    assert max(abs(a - b) / max(1.0, abs(a)) for x, y in zip(runs[0][1], runs[1][1]) for a, b in zip(x, y)) < 1e-6


@pytest.mark.parametrize("overrides, message", [
    (["exp_manager.samples.top_p=0"], "exp_manager.samples.top_p: must be in (0, 1]"),
    (["exp_manager.samples.max_new_tokens=0"], "exp_manager.samples.max_new_tokens: must be >= 1"),
    (["exp_manager.samples.every_n_train_steps=-1"], "exp_manager.samples.every_n_train_steps: must be >= 0"),
    (["exp_manager.samples.prompts=[' ']"], "exp_manager.samples.prompts[0]: must be non-empty text"),
    (["exp_manager.samples.prompts=[Hi]", "distributed_strategy.pipeline_model_parallel_size=2"],
     "with distributed_strategy.pipeline_model_parallel_size=2 is not supported yet"),
])
def test_samples_keys_are_checked_before_the_run(overrides, message):
    from nxdt.config.errors import ConfigError
    from nxdt.spec import load_config

    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(["--config-name", "tiny_llama_cpu", *overrides], default_config_dir=REPO / "conf")
