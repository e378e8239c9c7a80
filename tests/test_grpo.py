"""GRPO's pieces in one process: advantages and every loss_type against TRL's formulas (trl 1.16's
GRPOTrainer, re-derived here: importing trl costs ~5 s), the reward plug-ins (shipped rewards,
TRL's calling convention, a failing function named), the prompt rows and the shipped task, and the
rollouts: the generator's log-probs equal the training forward's (fp32, 1e-6), the first
iteration's ratio is exactly 1, and completions do not depend on how the rows are split over ranks.
"""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from nxdt.config.errors import ConfigError
from nxdt.data.prompts import PromptRow, arithmetic_rows, prompt_ids, read_prompt_rows
from nxdt.data.tokenizers import build_tokenizer
from nxdt.inference.generate import SamplingParams, filter_logits, next_tokens
from nxdt.models.llama import LlamaArgs, NxdtLlamaForCausalLM
from nxdt.models.lora import adapters_disabled, inject_lora
from nxdt.precision.precision import Precision
from nxdt.spec import build_spec, config_from_dict
from nxdt.spec.alignment import scale_rewards_of
from nxdt.rl.grpo_loss import group_advantages, grpo_loss, total_rewards
from nxdt.rl.rewards import (RewardError, accuracy, call_rewards, final_answer, format_reward, length_penalty,
                             load_reward_funcs, token_fraction)
from nxdt.rl.rollout import ReferenceWeights, RolloutOptions, forward_logps, rollout, sample_seed
from nxdt.rl.step import GRPOForwardBackward, LossOptions


# ---- TRL's formulas (trl/trainer/grpo_trainer.py, _generate_and_score_completions / _compute_loss)
def _trl_nanstd(tensor, dim=None):
    mean = torch.nanmean(tensor, dim=dim, keepdim=True)
    variance = torch.nanmean((tensor - mean) ** 2, dim=dim, keepdim=True)
    count = torch.sum(~torch.isnan(tensor), dim=dim, keepdim=True)
    correction = count / (count - 1)
    correction = torch.where(count > 1, correction, torch.full_like(correction, float("nan")))
    variance *= correction
    std = torch.sqrt(variance)
    return std.squeeze(dim) if dim is not None else std.squeeze()


def _trl_advantages(rewards_per_func, weights, num_generations, scale_rewards):
    unscorable = torch.isnan(rewards_per_func).all(dim=1)
    rewards = (rewards_per_func * weights.unsqueeze(0)).nansum(dim=1)
    rewards[unscorable] = torch.nan
    mean = torch.nanmean(rewards.view(-1, num_generations), dim=1).repeat_interleave(num_generations, dim=0)
    if scale_rewards in ("group", "none"):
        std = _trl_nanstd(rewards.view(-1, num_generations), dim=1).repeat_interleave(num_generations, dim=0)
    else:
        std = _trl_nanstd(rewards).expand_as(rewards)
    advantages = rewards - mean
    if scale_rewards != "none":
        advantages = advantages / (std + 1e-4)
    advantages[unscorable] = 0.0  # TRL: an unscorable completion's advantage is forced to 0
    return torch.nan_to_num(advantages, nan=0.0)


def _trl_loss(per_token_logps, old, ref, advantages, mask, *, loss_type, eps_low, eps_high, beta, max_len,
              num_items_in_batch, num_processes, ga_steps):
    coef_1 = torch.exp(per_token_logps - old)
    per_token_kl = torch.exp(ref - per_token_logps) - (ref - per_token_logps) - 1
    coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
    per_token_loss = -torch.min(coef_1 * advantages.unsqueeze(1), coef_2 * advantages.unsqueeze(1))
    per_token_loss = per_token_loss + beta * per_token_kl
    if loss_type == "grpo":
        return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean() / ga_steps
    if loss_type == "bnpo":
        return (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0) / ga_steps
    if loss_type == "dr_grpo":
        return (per_token_loss * mask).sum() / (per_token_loss.size(0) * max_len) / ga_steps
    normalizer = num_items_in_batch.clamp(min=1.0) / num_processes * ga_steps / ga_steps  # dapo
    return (per_token_loss * mask).sum() / normalizer


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_advantages_equal_trl(scale_rewards):
    g = torch.Generator().manual_seed(0)
    per_func = torch.rand(24, 3, generator=g, dtype=torch.float64)
    per_func[3, 1] = math.nan  # one function without an opinion
    per_func[7] = math.nan  # no function has one: advantage 0
    weights = torch.tensor([1.0, 0.5, -0.2], dtype=torch.float64)
    ours = group_advantages(total_rewards(per_func, weights), 4, scale_rewards)
    trl = _trl_advantages(per_func, weights, 4, scale_rewards)
    assert torch.allclose(ours, trl, atol=1e-6, rtol=0) and ours[7] == 0
    assert float(ours.abs().max()) > 0.5  # numbers that could fail


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo", "bnpo"])
def test_each_loss_type_equals_trl_over_micro_batches_and_ranks(loss_type):
    """2 ranks x 2 micro-batches of 3 completions; the ratio off 1 so both clip bounds bite; KL on."""
    g = torch.Generator().manual_seed(1)
    n_ranks, n_mb, b, t = 2, 2, 3, 7
    logps = -torch.rand(n_ranks, n_mb, b, t, generator=g, dtype=torch.float64) * 3
    old = logps + 0.3 * torch.randn(logps.shape, generator=g, dtype=torch.float64)
    ref = logps + 0.2 * torch.randn(logps.shape, generator=g, dtype=torch.float64)
    adv = torch.randn(n_ranks, n_mb, b, generator=g, dtype=torch.float64)
    mask = (torch.rand(n_ranks, n_mb, b, t, generator=g) > 0.3).double()
    num_items = mask.sum()
    kw = dict(epsilon=0.2, epsilon_high=0.28, beta=0.04)
    ours = trl = 0.0
    for r in range(n_ranks):
        for m in range(n_mb):
            parts = grpo_loss(logps[r, m], old[r, m], adv[r, m], mask[r, m], loss_type=loss_type,
                              ref_logps=ref[r, m], num_microbatches=n_mb, max_completion_length=t,
                              tokens_per_rank=float(num_items) / n_ranks, **kw)
            ours += float(parts.loss) / n_ranks  # the data-parallel mean
            trl += float(_trl_loss(logps[r, m], old[r, m], ref[r, m], adv[r, m], mask[r, m], loss_type=loss_type,
                                   eps_low=0.2, eps_high=0.28, beta=0.04, max_len=t, num_items_in_batch=num_items,
                                   num_processes=n_ranks, ga_steps=n_mb)) / n_ranks
            assert bool(parts.clipped.any())
    assert ours == pytest.approx(trl, abs=1e-6) and abs(trl) > 1e-3


# ---- rewards
def test_shipped_rewards_and_the_calling_convention():
    assert final_answer("so the total is \\boxed{1,024} done") == "1024"
    assert final_answer("12 apples\n#### 42\n") == "42"
    assert final_answer("first 3 then 7.0") == "7"
    assert accuracy(None, ["The answer is 19", "#### 18", "\\boxed{19}"], answer=["19", "19", "19"]) == [1.0, 0.0, 1.0]
    assert format_reward(None, ["#### 5", "5"]) == [1.0, 0.0]
    assert length_penalty(None, ["a", "b"], completion_ids=[[1, 2], [1, 2, 3, 4]]) == [-0.02, -0.04]
    assert token_fraction(None, ["x"], completion_ids=[[5, 2000, 7, 9999]]) == [0.5]
    seen = {}

    def trl_style(prompts, completions, answer, **kwargs):  # a TRL reward function, unchanged
        seen.update(kwargs, answer=answer, prompts=prompts)
        return [None if c == "?" else float(len(c)) for c in completions]

    out = call_rewards([trl_style], ["p1", "p2"], ["ab", "?"], [[1], [2]], {"answer": ["1", "2"], "level": [3, 4]})
    assert out[0][0] == 2.0 and math.isnan(out[0][1])
    assert seen["answer"] == ["1", "2"] and seen["level"] == [3, 4] and seen["completion_ids"] == [[1], [2]]


def test_a_failing_reward_function_is_named():
    def broken(prompts, completions, **_):
        raise KeyError("answer")

    def short(prompts, completions, **_):
        return [1.0]

    with pytest.raises(RewardError, match=r"^reward function broken raised KeyError"):
        call_rewards([broken], ["p"] * 2, ["c"] * 2, [[1]] * 2, {})
    with pytest.raises(RewardError, match=r"^reward function short returned 1 values for 2 completions$"):
        call_rewards([short], ["p"] * 2, ["c"] * 2, [[1]] * 2, {})
    with pytest.raises(ConfigError, match=r"reward_funcs\[1\]: cannot import 'no_such_pkg.rewards'"):
        load_reward_funcs(["nxdt.rl.rewards.accuracy", "no_such_pkg.rewards.accuracy"])
    with pytest.raises(ConfigError, match=r"reward_funcs\[0\]: 'nxdt.rl.rewards' has no function 'nope'"):
        load_reward_funcs(["nxdt.rl.rewards.nope"])


# ---- prompts
def test_the_shipped_task_is_deterministic_and_rows_are_checked(tmp_path):
    rows = arithmetic_rows()
    assert len(rows) == 1024 and rows == arithmetic_rows()
    a, op, b = rows[0]["prompt"][len("What is "):-1].split()
    assert rows[0]["answer"] == str(int(a) + int(b) if op == "+" else int(a) * int(b))
    good = tmp_path / "p.jsonl"
    good.write_text(json.dumps({"prompt": "hi", "answer": "3"}) + "\n")
    assert read_prompt_rows(str(good))[0][0] == {"prompt": "hi", "answer": "3"}
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "hi"}) + "\n" + json.dumps({"question": "x"}) + "\n")
    with pytest.raises(ConfigError, match=r"bad.jsonl:2: row has no 'prompt'"):
        read_prompt_rows(str(bad))
    tok = build_tokenizer()
    ids = prompt_ids(tok, "What is 3 + 4? " * 20, 10)
    assert len(ids) == 10 and ids[0] == tok.bos_token_id  # the end kept, BOS first
    chat = [{"role": "user", "content": "What is 3 + 4?"}]
    with pytest.raises(ConfigError, match="no chat template"):
        prompt_ids(tok, chat, 64)
    tok.chat_template = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}assistant:{% endif %}")
    rendered = prompt_ids(tok, chat, 64)
    assert rendered == [tok.bos_token_id] + tok("user: What is 3 + 4?\nassistant:", add_special_tokens=False)["input_ids"]


# ---- rollouts
VOCAB = 256


def _model(seed=0):
    torch.manual_seed(seed)
    args = LlamaArgs(vocab_size=VOCAB, hidden_size=64, ffn_hidden_size=176, num_layers=2,
                     num_attention_heads=4, num_kv_heads=2, max_position_embeddings=128)
    return NxdtLlamaForCausalLM(args)


class _Tok:
    eos_token_id = 3

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def _options(**kw):
    base = dict(num_generations=4, max_completion_length=8, temperature=0.9, top_p=1.0, top_k=0, seq_length=24,
                scale_rewards="group", mask_truncated=False, reward_weights=[1.0], eos_token_id=3, pad_id=0,
                vocab_size=VOCAB, seed=7)
    return RolloutOptions(**{**base, **kw})


def _rows():
    return [PromptRow(f"p{i}", [1] + [10 + i, 20 + 2 * i, 30][: 1 + i % 3], {"answer": str(i)}) for i in range(4)]


def _low_ids(prompts, completions, completion_ids, **_):
    return [sum(t < VOCAB // 4 for t in ids) / max(len(ids), 1) for ids in completion_ids]


def _hf_model(seed=0):
    """transformers' LlamaForCausalLM (model_source: hf) of _model's shapes."""
    from transformers import LlamaConfig, LlamaForCausalLM  # reason: transformers only for this model

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=False)
    return LlamaForCausalLM(config)


@pytest.mark.parametrize("source", ["native", "hf"])
def test_generator_logps_equal_the_training_forward_and_the_first_ratio_is_one(source):
    model = _model() if source == "native" else _hf_model()
    r = rollout(model, _rows(), step=3, opts=_options(), reward_funcs=[_low_ids], tokenizer=_Tok())
    mask = r.mask.bool()
    assert int(mask.sum()) > 40 and float(r.advantages.abs().max()) > 0.5
    train = forward_logps(model, r.input_ids, r.labels, 0.9, micro_batch_size=4)
    assert float((train - r.gen_logps)[mask].abs().max()) < 1e-6
    options = LossOptions("grpo", 0.2, None, 0.0, 0.9, 8)
    r.old_logps = train  # num_iterations > 1: the old policy's forward, before any update
    fb = GRPOForwardBackward(model, Precision.from_spec(build_spec(config_from_dict({})), rank=0), r, options, num_microbatches=2)
    fb()
    assert torch.equal(fb.first_logps[mask], train[mask])  # ratio exp(0) = 1 exactly: nothing clipped
    assert float(fb.sums["clipped"]) == 0 and float(fb.sums["tokens"]) == int(mask.sum())
    assert all(p.grad is not None and float(p.grad.abs().sum()) > 0 for p in model.parameters())


def test_per_row_sampling_draws_from_the_filtered_distribution():
    """Per-row generators (the rollouts'): one uniform per row and the inverse CDF of the batch. The
    frequencies over 3,000 rows match the top-k-filtered softmax, a filtered token is never drawn,
    and a row's token depends on its own seed only."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 3.0]]).repeat(3000, 1)
    params = SamplingParams(max_new_tokens=1, temperature=0.7, top_k=4)
    gens = [torch.Generator().manual_seed(1000 + i) for i in range(3000)]
    drawn = next_tokens(logits.clone(), params, gens)
    want = filter_logits(logits[:1] / 0.7, 4, None).softmax(-1)[0]
    freq = torch.bincount(drawn, minlength=6).double() / 3000
    assert float((freq - want.double()).abs().max()) < 0.03 and freq[3] == 0 and freq[4] == 0, (freq, want)
    alone = next_tokens(logits[7:8].clone(), params, [torch.Generator().manual_seed(1007)])
    assert int(alone[0]) == int(drawn[7])


def test_completions_do_not_depend_on_the_ranks():
    """dp 2's rank 1 samples completions 8..15 exactly as one process samples them (own seeds, the
    step's prompt width), and the seeds differ per step, prompt row and sample."""
    model = _model()
    whole = rollout(model, _rows(), 5, _options(), [_low_ids], tokenizer=_Tok(), row_ids=[40, 41, 42, 43])
    half = rollout(model, _rows(), 5, _options(), [_low_ids], tokenizer=_Tok(), dp_rank=1, dp_size=2,
                   row_ids=[40, 41, 42, 43], gather=lambda x: torch.cat([torch.zeros_like(x), x]))
    assert torch.equal(half.input_ids, whole.input_ids[8:]) and half.completions == whole.completions[8:]
    assert torch.equal(half.rewards[8:], whole.rewards[8:])
    other = rollout(model, _rows(), 6, _options(), [_low_ids], tokenizer=_Tok(), row_ids=[40, 41, 42, 43])
    assert other.completions != whole.completions
    assert len({sample_seed(7, s, row, k) for s in range(3) for row in range(3) for k in range(3)}) == 27


def test_the_reference_weights_are_the_start():
    model = _model()
    ref = ReferenceWeights(model)
    ids = torch.randint(0, VOCAB, (2, 12))
    before = forward_logps(model, ids, ids, 1.0, micro_batch_size=2)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    moved = forward_logps(model, ids, ids, 1.0, micro_batch_size=2)
    with ref.swapped(model):
        assert torch.equal(forward_logps(model, ids, ids, 1.0, micro_batch_size=2), before)
    assert torch.equal(forward_logps(model, ids, ids, 1.0, micro_batch_size=2), moved)
    assert not torch.equal(moved, before)


def test_lora_grpo_trains_only_adapters_against_the_base():
    """With peft the reference is the base with the adapters off (no second copy): it stays put while
    the adapters (only they) train, and the policy moves away from it."""
    model = _model()
    inject_lora(model, ["q_proj", "v_proj", "down_proj"], 4, 8.0)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    opts = _options(seq_length=24)
    r = rollout(model, _rows(), 0, opts, [_low_ids], tokenizer=_Tok())
    with adapters_disabled(model):
        r.ref_logps = forward_logps(model, r.input_ids, r.labels, 0.9, micro_batch_size=4)
    assert float((r.ref_logps - r.gen_logps)[r.mask.bool()].abs().max()) < 1e-6  # B = 0: policy = base at start
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(trainable, lr=1e-2)
    precision = Precision.from_spec(build_spec(config_from_dict({})), rank=0)
    for _ in range(2):
        optimizer.zero_grad()
        GRPOForwardBackward(model, precision, r, LossOptions("dapo", 0.2, 0.28, 0.04, 0.9, 8), num_microbatches=2)()
        assert all(p.grad is None for n, p in model.named_parameters() if n in frozen)
        assert any(float(p.grad.abs().sum()) > 0 for p in trainable)
        optimizer.step()
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if n in frozen)
    with adapters_disabled(model):
        assert torch.equal(forward_logps(model, r.input_ids, r.labels, 0.9, micro_batch_size=4), r.ref_logps)
    moved = forward_logps(model, r.input_ids, r.labels, 0.9, micro_batch_size=4)
    assert float((moved - r.ref_logps)[r.mask.bool()].abs().max()) > 1e-3


# ---- the config's checks (no torch needed; one line each)
TINY_MODEL = {"encoder_seq_length": 32, "num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 176,
              "num_attention_heads": 4, "max_position_embeddings": 128}


def _grpo_config(grpo: dict, **data):
    return config_from_dict({"model_alignment_strategy": {"grpo": {"task": "arithmetic", "num_generations": 4,
                                                                   "max_completion_length": 8,
                                                                   "reward_funcs": ["nxdt.rl.rewards.accuracy"],
                                                                   **grpo}},
                             "data": {"global_batch_size": 16, "micro_batch_size": 4, "seq_length": 32, **data},
                             "model": TINY_MODEL}, world_size=1, check=True)


def test_the_config_speaks_trls_names_and_refuses_combinations():
    assert scale_rewards_of(_grpo_config({"scale_rewards": True}).model_alignment_strategy.grpo) == "group"
    assert scale_rewards_of(_grpo_config({"scale_rewards": False}).model_alignment_strategy.grpo) == "none"
    cases = [({"reward_weights": [1.0, 2.0]}, "reward_weights: 2 weights for 1 reward_funcs"),
             ({"epsilon": 0.3, "epsilon_high": 0.2}, "epsilon_high (0.2) is below epsilon (0.3)"),
             ({"reward_funcs": []}, "reward_funcs: empty"),
             ({"max_completion_length": 32}, "max_completion_length (32) must be below data.seq_length (32)"),
             ({"task": None}, "no prompts; set data.train_dir"),
             ({"loss_type": "cispo"}, "loss_type"),
             ({"top_p": 0}, "top_p")]
    for values, fragment in cases:
        with pytest.raises(ConfigError, match=re.escape(fragment)):
            _grpo_config(values)
    with pytest.raises(ConfigError, match="model_alignment_strategy.sft are both set"):
        config_from_dict({"model_alignment_strategy": {"grpo": {"task": "arithmetic", "reward_funcs": ["a.b"]},
                                                       "sft": {}}, "model": TINY_MODEL}, world_size=1, check=True)
