"""DPO / ORPO: the losses against TRL 1.16's own code (DPOTrainer._compute_loss, ORPOTrainer's
odds_ratio_loss and get_batch_loss_metrics, called with stand-ins for the trainer), the step's
micro-batch conventions, the reference table (dp-strided, checkpointed bit for bit), the
preference data module, and the KJV preference generator."""

from __future__ import annotations

import json
import math
from collections import defaultdict
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from nxdt.checkpoint.state import from_json, to_json
from nxdt.config.errors import ConfigError
from nxdt.spec import build_spec, config_from_dict
from nxdt.data.assets import bundled_corpus_path
from nxdt.data.preference import RESPONSES, PreferenceDataModule
from nxdt.data.tokenizers import build_tokenizer
from nxdt.precision.precision import Precision
from nxdt.tools.preference_data import make_preference_rows, read_chapters
from nxdt.training.loss import dpo_loss, orpo_loss, reward_metrics, sequence_logps
from nxdt.training.preference import (
    batch_reference_logps,
    compute_reference_logps,
    preference_forward_backward,
    preference_microbatch_loss,
    reference_from_table,
)

SEQ = 48


# ----------------------------------------------------------------------------- fixtures and helpers


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(None)


@pytest.fixture(scope="module")
def chapters():
    return read_chapters(bundled_corpus_path())


@pytest.fixture(scope="module")
def rows(chapters):
    return make_preference_rows(chapters, 6, prompt_words=8, response_words=6, seed=7)


@pytest.fixture(scope="module")
def fp32():
    return Precision.from_spec(build_spec(config_from_dict({})), rank=0)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def pref_cfg(train, kind="dpo", seq=SEQ, block=None, gbs=2, mbs=1, **data):
    return config_from_dict({
        "seed": 1, "trainer": {"max_steps": 3, "limit_val_batches": 1, "limit_test_batches": 1},
        "model_alignment_strategy": {kind: block or {}},
        "data": {"train_dir": train, "seq_length": seq, "micro_batch_size": mbs, "global_batch_size": gbs,
                 "num_workers": 0, **data},
    })


def module_for(tmp_path, rows, name="p.jsonl", **kw) -> PreferenceDataModule:
    dm = PreferenceDataModule(pref_cfg(write_jsonl(tmp_path / name, rows), **kw), None)
    dm.setup()
    return dm


def collate(items):
    return {k: torch.stack([it[k] for it in items]) for k in items[0]}


def tiny_native(vocab):
    from nxdt.models.llama import LlamaArgs, NxdtLlamaForCausalLM

    torch.manual_seed(0)
    fields = {"vocab_size": vocab, "hidden_size": 32, "num_layers": 2, "num_attention_heads": 4, "num_kv_heads": 2,
              "ffn_hidden_size": 64, "max_position_embeddings": 128}
    names = set(LlamaArgs.__dataclass_fields__)
    model = NxdtLlamaForCausalLM(LlamaArgs(**{k: v for k, v in fields.items() if k in names}))
    model.init_weights()
    return model


@pytest.fixture(scope="module")
def hf_model():
    """A tiny transformers Llama with TRL's fused LM head added (as DPOTrainer does); called
    without fused_lm_head it is the plain model nxdt forwards."""
    from conftest import REPO

    from nxdt.models.hf import build_hf_model

    trl_utils = pytest.importorskip("trl.trainer.utils")
    torch.manual_seed(0)
    model = build_hf_model(REPO / "conf/model_configs/tiny_llama/config.json",
                           {"num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 128, "num_attention_heads": 4,
                            "num_kv_heads": 2}).eval()
    trl_utils.add_fused_lm_head(model, outputs=("log_probs", "entropy", "mean_logits", "is_top1"))
    return model


class Accelerator:
    """What TRL's loss code asks of accelerate in one process."""

    device = torch.device("cpu")

    def gather(self, t):
        return t

    gather_for_metrics = gather


def trl_dpo_self(loss_type, beta):
    """The attributes DPOTrainer._compute_loss reads (TRL 1.16), for the plain DPO it computes."""
    return SimpleNamespace(
        model=SimpleNamespace(training=True), accelerator=Accelerator(), aux_loss_enabled=False, ld_alpha=None,
        precompute_ref_logps=True, f_divergence_type="reverse_kl", loss_types=[loss_type], loss_weights=[1.0],
        beta=beta, label_smoothing=0.0, use_weighting=False,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)}, _total_train_tokens=0, _tp_size=1)


def full_sequences(example, seq_length):
    """Per response: (tokens, completion flags) as TRL sees them, cut like nxdt (seq_length + 1 tokens)."""
    out = {}
    for name in RESPONSES:
        tokens = np.concatenate([example.prompt, getattr(example, name)])[: seq_length + 1].tolist()
        out[name] = (tokens, [0] * len(example.prompt) + [1] * (len(tokens) - len(example.prompt)))
    return out


def padded(seqs, value):
    width = max(len(s) for s in seqs)
    return torch.tensor([list(s) + [value] * (width - len(s)) for s in seqs])


# ----------------------------------------------------------------------------- losses against TRL


@pytest.mark.parametrize("loss_type", ["sigmoid", "hinge", "ipo"])
def test_dpo_loss_matches_trl_compute_loss(loss_type):
    """Random per-token log-probs through TRL's own DPOTrainer._compute_loss (a stand-in model
    returns them as its fused head would) and through dpo_loss: loss and logged rewards agree."""
    DPOTrainer = pytest.importorskip("trl.trainer.dpo_trainer").DPOTrainer
    B, L, beta = 5, 11, 0.3
    g = torch.Generator().manual_seed(1)
    completion = torch.zeros(2 * B, L, dtype=torch.long)
    for i in range(2 * B):
        start = int(torch.randint(1, 5, (1,), generator=g))
        completion[i, start:int(torch.randint(start + 1, L + 1, (1,), generator=g))] = 1
    per_token = -3 * torch.rand(2 * B, L - 1, generator=g) * completion[:, 1:]
    ref = -20 * torch.rand(2 * B, generator=g)
    zeros = torch.zeros(2 * B, L - 1)
    model = lambda **kw: SimpleNamespace(log_probs=per_token, entropy=zeros, mean_logits=zeros,  # noqa: E731
                                         is_top1=zeros.bool())
    trl_self = trl_dpo_self(loss_type, beta)
    inputs = {"input_ids": torch.randint(0, 50, (2 * B, L), generator=g), "attention_mask": torch.ones(2 * B, L),
              "completion_mask": completion, "ref_chosen_logps": ref[:B], "ref_rejected_logps": ref[B:]}
    expected = DPOTrainer._compute_loss(trl_self, model, inputs, False)

    sums, counts = per_token.sum(1), completion[:, 1:].sum(1).float()
    losses, chosen_r, rejected_r = dpo_loss(sums[:B], sums[B:], ref[:B], ref[B:], beta, loss_type,
                                            counts[:B], counts[B:])
    torch.testing.assert_close(losses.mean(), expected, rtol=1e-6, atol=1e-6)
    for name, value in reward_metrics(chosen_r, rejected_r).items():
        assert value.item() == pytest.approx(trl_self._metrics["train"][name][0], rel=1e-6, abs=1e-6), name


def test_orpo_odds_ratio_matches_trl():
    """ORPOTrainer.odds_ratio_loss (TRL's code, `self` a stand-in with beta) against orpo_loss, on
    average log-probs on both sides of log1mexp's branch at -ln 2."""
    ORPOTrainer = pytest.importorskip("trl.experimental.orpo.orpo_trainer").ORPOTrainer
    g = torch.Generator().manual_seed(2)
    chosen, rejected = -4 * torch.rand(16, generator=g) - 1e-3, -4 * torch.rand(16, generator=g) - 1e-3
    nll, beta = torch.tensor(2.5), 0.25
    losses, trl_chosen_r, trl_rejected_r, log_odds_ratio, log_odds_chosen = ORPOTrainer.odds_ratio_loss(
        SimpleNamespace(beta=beta, accelerator=Accelerator()), chosen, rejected)
    out = orpo_loss(chosen, rejected, nll, beta)
    torch.testing.assert_close(out.loss, nll - losses.mean(), rtol=1e-6, atol=1e-6)  # get_batch_loss_metrics' sum
    torch.testing.assert_close(out.chosen_rewards, trl_chosen_r, rtol=0, atol=0)
    torch.testing.assert_close(out.rejected_rewards, trl_rejected_r, rtol=0, atol=0)
    torch.testing.assert_close(out.log_odds_ratio, log_odds_ratio, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out.log_odds_chosen, log_odds_chosen, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_dpo_micro_batch_matches_trl_on_a_model(tmp_path, rows, hf_model, fp32, loss_type):
    """The whole DPO micro-batch — nxdt's data, one [chosen; rejected] forward, log-probs, loss —
    against TRL's _compute_loss on the same rows and the same (transformers) model."""
    DPOTrainer = pytest.importorskip("trl.trainer.dpo_trainer").DPOTrainer
    dm = module_for(tmp_path, rows)
    ds = dm.datasets["train"]
    table = -40 * torch.rand(len(ds), 2, generator=torch.Generator().manual_seed(3))
    mb = collate([ds[i] for i in range(len(ds))])
    with torch.no_grad():
        loss, metrics = preference_microbatch_loss(hf_model, mb, fp32, kind="dpo", beta=0.2, loss_type=loss_type,
                                                   reference=reference_from_table(table))
    seqs = [full_sequences(ex, SEQ) for ex in ds.examples]
    ordered = [s[name] for name in RESPONSES for s in seqs]  # TRL's batch: all chosen, then all rejected
    inputs = {"input_ids": padded([t for t, _ in ordered], 0),
              "attention_mask": padded([[1] * len(t) for t, _ in ordered], 0),
              "completion_mask": padded([c for _, c in ordered], 0),
              "ref_chosen_logps": table[:, 0], "ref_rejected_logps": table[:, 1]}
    trl_self = trl_dpo_self(loss_type, 0.2)
    with torch.no_grad():
        expected = DPOTrainer._compute_loss(trl_self, hf_model, inputs, False)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
    for name, value in metrics.items():
        assert value.item() == pytest.approx(trl_self._metrics["train"][name][0], rel=1e-5, abs=1e-5), name


def test_orpo_micro_batch_matches_trl_on_a_model(tmp_path, rows, hf_model, fp32):
    """ORPO's micro-batch loss and metrics against TRL's ORPOTrainer.get_batch_loss_metrics (its own
    concatenated_forward, get_batch_logps and odds_ratio_loss) on the same rows and model; TRL's
    NLL covers the chosen prompt and response."""
    orpo = pytest.importorskip("trl.experimental.orpo.orpo_trainer").ORPOTrainer

    class TRLSelf:  # the methods get_batch_loss_metrics calls, and the attributes they read
        concatenated_forward = orpo.concatenated_forward
        concatenated_inputs = staticmethod(orpo.concatenated_inputs)
        get_batch_logps = staticmethod(orpo.get_batch_logps)
        odds_ratio_loss = orpo.odds_ratio_loss
        is_encoder_decoder, padding_value, aux_loss_enabled, beta = False, 0, False, 0.15
        accelerator = Accelerator()

    dm = module_for(tmp_path, rows, kind="orpo")
    ds = dm.datasets["train"]
    mb = collate([ds[i] for i in range(len(ds))])
    with torch.no_grad():
        loss, metrics = preference_microbatch_loss(hf_model, mb, fp32, kind="orpo", beta=0.15)
    batch = {}
    for name in RESPONSES:
        seqs = [full_sequences(ex, SEQ)[name] for ex in ds.examples]
        batch[f"{name}_input_ids"] = padded([t for t, _ in seqs], 0)
        batch[f"{name}_attention_mask"] = padded([[1] * len(t) for t, _ in seqs], 0)
        batch[f"{name}_labels"] = padded([[t if c else -100 for t, c in zip(*s)] for s in seqs], -100)
    with torch.no_grad():
        expected, trl_metrics = orpo.get_batch_loss_metrics(TRLSelf(), hf_model, batch)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
    for name, value in metrics.items():
        assert value.item() == pytest.approx(trl_metrics[name], rel=1e-5, abs=1e-5), name


def test_sequence_logps_by_hand():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 6, 11, generator=g, dtype=torch.bfloat16)
    labels = torch.randint(0, 11, (3, 6), generator=g)
    mask = (torch.rand(3, 6, generator=g) > 0.4).float()
    sums, counts = sequence_logps(logits, labels, mask)
    assert sums.dtype == torch.float32
    for b in range(3):
        expect = 0.0
        for t in range(6):
            if mask[b, t]:
                row = logits[b, t].double()
                expect += (row[labels[b, t]] - torch.logsumexp(row, 0)).item()
        assert sums[b].item() == pytest.approx(expect, abs=1e-5)
        assert counts[b].item() == mask[b].sum().item()


# ----------------------------------------------------------------------------- the step


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _zero(model):
    for p in model.parameters():
        p.grad = None


def test_forward_backward_equals_one_direct_forward_and_micro_batches_agree(tmp_path, rows, tok, fp32):
    dm = module_for(tmp_path, rows, seq=32)
    ds = dm.datasets["train"]
    batch = collate([ds[i] for i in range(4)])
    table = -30 * torch.rand(len(ds), 2, generator=torch.Generator().manual_seed(5))
    model, beta = tiny_native(len(tok)), 0.1

    # by hand: one forward of all 8 sequences, log_softmax + gather, TRL's sigmoid loss, mean over prompts
    inputs = torch.cat([batch["chosen_input_ids"], batch["rejected_input_ids"]])
    labels = torch.cat([batch["chosen_labels"], batch["rejected_labels"]])
    mask = torch.cat([batch["chosen_loss_mask"], batch["rejected_loss_mask"]])
    logps = torch.log_softmax(model(input_ids=inputs).float(), -1).gather(-1, labels[..., None])[..., 0]
    chosen, rejected = ((logps * mask).sum(-1)).chunk(2)
    ref = table[batch["index"]]
    direct = -F.logsigmoid(beta * ((chosen - ref[:, 0]) - (rejected - ref[:, 1]))).mean()
    direct.backward()
    expected = _grads(model)

    results = {}
    # 1 micro-batch of 4 prompts, 2 of 2, 4 of 1: the mean convention; chunk 16: the model scores the
    # response tokens itself, 16 at a time, the prompt and padding skipping the output layer
    for n, chunk in ((1, None), (2, None), (4, None), (2, 16)):
        _zero(model)
        fb = preference_forward_backward(model, fp32, n, kind="dpo", beta=beta, reference=reference_from_table(table),
                                         batch_size=4, loss_chunk_size=chunk)
        loss = fb(batch)
        torch.testing.assert_close(loss, direct.detach(), rtol=1e-5, atol=1e-6)
        for name, grad in _grads(model).items():
            torch.testing.assert_close(grad, expected[name], rtol=1e-4, atol=1e-6, msg=f"{n} micro-batches: {name}")
        results[n] = fb.metrics
    with torch.no_grad():
        want = batch_reference_logps(model, batch, fp32)
    for got, ref in zip(batch_reference_logps(model, batch, fp32, loss_chunk_size=16), want):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert set(results[1]) == {"rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
                               "logps/chosen", "logps/rejected"}
    for name in results[1]:
        torch.testing.assert_close(results[2][name], results[1][name], rtol=1e-5, atol=1e-6)
    with pytest.raises(RuntimeError, match="batch of 4 prompts, expected"):
        preference_forward_backward(model, fp32, 1, kind="dpo", beta=beta, reference=reference_from_table(table),
                                    batch_size=2)(batch)


def test_orpo_step_is_the_mean_of_its_micro_batch_losses(tmp_path, rows, tok, fp32):
    dm = module_for(tmp_path, rows, kind="orpo", seq=32)
    ds = dm.datasets["train"]
    batch = collate([ds[i] for i in range(4)])
    model = tiny_native(len(tok))
    halves = [{k: v[i:i + 2] for k, v in batch.items()} for i in (0, 2)]
    with torch.no_grad():
        parts = [preference_microbatch_loss(model, h, fp32, kind="orpo", beta=0.1)[0] for h in halves]
    fb = preference_forward_backward(model, fp32, 2, kind="orpo", beta=0.1)
    torch.testing.assert_close(fb(batch), (parts[0] + parts[1]) / 2, rtol=1e-6, atol=1e-6)
    assert {"nll_loss", "log_odds_ratio", "log_odds_chosen", "rewards/accuracies"} <= set(fb.metrics)
    assert all(p.grad is not None for p in model.parameters())


def test_reference_table_strided_over_dp_and_first_dpo_step(tmp_path, rows, tok, fp32, capsys):
    dm = module_for(tmp_path, rows[:5], seq=32)
    ds = dm.datasets["train"]
    model = tiny_native(len(tok)).train()
    whole = torch.cat([torch.stack(batch_reference_logps(model, collate([ds[i]]), fp32), 1) for i in range(5)])
    one = compute_reference_logps(model, ds, 2, fp32)
    torch.testing.assert_close(one, whole, rtol=1e-6, atol=1e-5)
    assert model.training  # restored after the eval-mode pass
    assert "5/5 rows (100%" in capsys.readouterr().out

    # two dp ranks, 5 rows: rank 0 rows 0, 2, 4; rank 1 rows 1, 3 (+ a repeat); the gather in rank order
    captured = {}

    def keep_rank1(local):
        captured["r1"] = local
        return torch.zeros(2, *local.shape)

    compute_reference_logps(model, ds, 2, fp32, dp_rank=1, dp_size=2, progress=False, all_gather=keep_rank1)
    two = compute_reference_logps(model, ds, 2, fp32, dp_rank=0, dp_size=2, progress=False,
                                  all_gather=lambda local: torch.stack([local, captured["r1"]]))
    torch.testing.assert_close(two, one, rtol=1e-6, atol=1e-5)

    # the policy is the reference at the first step: zero rewards, loss log 2
    dm.set_reference_logps("train", one)
    fb = preference_forward_backward(model, fp32, 1, kind="dpo", beta=0.1,
                                     reference=reference_from_table(dm.reference_logps["train"]))
    loss = fb(collate([ds[i] for i in (4, 1)]))
    assert loss.item() == pytest.approx(math.log(2), abs=1e-5)
    assert abs(fb.metrics["rewards/margins"].item()) < 1e-5


# ----------------------------------------------------------------------------- data


def test_masks_prompt_and_responses(tmp_path, tok):
    row = {"prompt": "In the beginning", "chosen": " God created the heaven", "rejected": " was the Word"}
    dm = module_for(tmp_path, [row, row])
    item = dm.datasets["train"][1]
    assert item["index"].dtype == torch.int64 and item["index"].item() == 1
    prompt = [tok.bos_token_id] + tok(row["prompt"], add_special_tokens=False)["input_ids"]
    for name in RESPONSES:
        response = tok(row[name], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        full = prompt + response
        n = len(full) - 1
        assert item[f"{name}_input_ids"][:n].tolist() == full[:-1]
        assert item[f"{name}_labels"][:n].tolist() == full[1:]
        assert item[f"{name}_loss_mask"].tolist() == [0.0] * (len(prompt) - 1) + [1.0] * len(response) + \
            [0.0] * (SEQ - n)
        assert item[f"{name}_labels"][item[f"{name}_loss_mask"] > 0].tolist() == response  # response + EOS
        assert item[f"{name}_input_ids"][n:].eq(dm.pad_id).all() and item[f"{name}_input_ids"].shape == (SEQ,)


def test_prompt_truncation_modes(tmp_path, tok):
    words = " ".join(f"w{i}" for i in range(40))
    row = {"prompt": words, "chosen": " yes", "rejected": " no"}
    ids = tok(words, add_special_tokens=False)["input_ids"]
    assert len(ids) > 6
    start = module_for(tmp_path, [row], block={"max_dpo_prompt_length": 6, "truncation_mode": "keep_start"})
    ex = start.datasets["train"].examples[0]
    assert ex.prompt.tolist() == [tok.bos_token_id] + ids[:5]
    end = module_for(tmp_path, [row], kind="orpo", block={"max_prompt_length": 6, "truncation_mode": "keep_end"})
    ex = end.datasets["train"].examples[0]
    assert ex.prompt.tolist() == [tok.bos_token_id] + ids[-5:]
    item = end.datasets["train"][0]
    assert item["chosen_loss_mask"][:5].sum() == 0 and item["chosen_loss_mask"][5] == 1  # trained from the response
    path = write_jsonl(tmp_path / "long.jsonl", [{"prompt": "a b", "chosen": " c", "rejected": " d"}, row])
    with pytest.raises(ConfigError, match=r"long\.jsonl:2: the prompt is \d+ tokens, longer than "
                                          r"model_alignment_strategy\.dpo\.max_dpo_prompt_length \(6\); set "
                                          r"model_alignment_strategy\.dpo\.truncation_mode"):
        PreferenceDataModule(pref_cfg(path, block={"max_dpo_prompt_length": 6, "truncation_mode": None}), None).setup()


def test_long_response_is_cut_prompt_kept(tmp_path, tok):
    row = {"prompt": "And God said,", "chosen": " " + " ".join(["light"] * 80), "rejected": " darkness"}
    dm = module_for(tmp_path, [row], seq=16)
    item = dm.datasets["train"][0]
    prompt = [tok.bos_token_id] + tok(row["prompt"], add_special_tokens=False)["input_ids"]
    chosen = tok(row["chosen"], add_special_tokens=False)["input_ids"]
    full = (prompt + chosen)[:17]  # seq_length + 1 tokens: no EOS left
    assert item["chosen_input_ids"].tolist() == full[:-1] and item["chosen_labels"].tolist() == full[1:]
    assert item["chosen_loss_mask"].sum().item() == 17 - len(prompt)
    assert item["rejected_loss_mask"].sum().item() == len(tok(" darkness", add_special_tokens=False)["input_ids"]) + 1


@pytest.mark.parametrize("text, message", [
    ('{"prompt": "a", "chosen": "b", "rejected": "c"}\n{"prompt": "a", "chosen": "b"}\n',
     r"^[^\n]*e\.jsonl:2: row has no 'rejected' \(preference rows need 'prompt', 'chosen' and 'rejected'; "
     r"has \['chosen', 'prompt'\]\)$"),
    ('{"chosen": "b", "rejected": "c"}\n', r"e\.jsonl:1: row has no 'prompt' \(preference rows need"),
    ('{"prompt": "a", "chosen": 3, "rejected": "c"}\n', r"e\.jsonl:1: 'chosen' is int, expected a string"),
    ("", r"e\.jsonl: no examples \(empty file\)"),
])
def test_bad_preference_rows_name_file_and_line(tmp_path, text, message):
    (tmp_path / "e.jsonl").write_text(text)
    with pytest.raises(ConfigError, match=message):
        PreferenceDataModule(pref_cfg(str(tmp_path / "e.jsonl")), None).setup()


def test_arrow_rows_and_missing_column(tmp_path, rows):
    import datasets

    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "disk"))
    dm = PreferenceDataModule(pref_cfg(str(tmp_path / "disk")), None)
    dm.setup()
    assert len(dm.datasets["train"]) == len(rows)
    datasets.Dataset.from_list([{"prompt": "a", "chosen": "b"}]).save_to_disk(str(tmp_path / "bad"))
    with pytest.raises(ConfigError, match=r"bad: no 'rejected' column \(preference rows need"):
        PreferenceDataModule(pref_cfg(str(tmp_path / "bad")), None).setup()


def test_loader_counts_prompts_dev_choose_samples_and_index(tmp_path, rows):
    path = write_jsonl(tmp_path / "t.jsonl", rows)
    dm = PreferenceDataModule(pref_cfg(path, gbs=2, mbs=1, dev_choose_samples=5, val_dir=path), None)
    batches = list(dm.train_dataloader())
    assert len(batches) == 3 and batches[0]["chosen_input_ids"].shape == (2, SEQ)
    assert len(dm.datasets["train"]) == 5
    # 3 steps x 2 prompts over 5 rows: the last step wraps round to row 0
    assert [b["index"].tolist() for b in batches] == [[0, 1], [2, 3], [4, 0]]
    assert len(list(dm.val_dataloader())) == 2


def test_reference_table_state_is_bitwise_through_json(tmp_path, rows):
    path = write_jsonl(tmp_path / "t.jsonl", rows)
    dm = PreferenceDataModule(pref_cfg(path), None)
    dm.setup()
    assert "reference_logps" not in dm.state_dict()
    g = torch.Generator().manual_seed(6)
    table = (torch.randn(len(rows), 2, generator=g) * torch.logspace(-30, 30, len(rows))[:, None]).float()
    table[0, 0] = -1e-45  # a subnormal
    dm.set_reference_logps("train", table)
    stored = json.loads(json.dumps(to_json(dm.state_dict())))  # what nxdt's checkpointer writes and reads
    fresh = PreferenceDataModule(pref_cfg(path), None)
    fresh.load_state_dict(from_json(stored))  # before setup(), as Lightning may: checked once the rows are read
    fresh.setup()
    assert torch.equal(fresh.reference_logps["train"].view(torch.int32), table.view(torch.int32))
    with pytest.raises(ValueError, match=r"shape \(2, 2\), expected \(6, 2\)"):
        dm.set_reference_logps("train", table[:2])
    other = PreferenceDataModule(pref_cfg(write_jsonl(tmp_path / "o.jsonl", rows[::-1])), None)
    other.setup()
    with pytest.raises(ConfigError, match="reference log-probs were computed on other train rows"):
        other.load_state_dict(from_json(stored))


# ----------------------------------------------------------------------------- the generator


def test_generator_is_deterministic_and_rejected_differs(chapters, tmp_path, capsys):
    a = make_preference_rows(chapters, 20, prompt_words=10, response_words=5, seed=3)
    assert a == make_preference_rows(chapters, 20, prompt_words=10, response_words=5, seed=3)
    assert a != make_preference_rows(chapters, 20, prompt_words=10, response_words=5, seed=4)
    for row in a:
        assert row["chosen"] != row["rejected"]
        assert len(row["prompt"].split()) == 10 and len(row["chosen"].split()) == len(row["rejected"].split()) == 5
        assert row["chosen"].startswith(" ") and row["rejected"].startswith(" ")
    from nxdt.cli import main

    out = tmp_path / "kjv_pref.jsonl"
    assert main(["preference-data", "--output", str(out), "--rows", "3", "--seed", "3"]) == 0
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert written == make_preference_rows(chapters, 3, seed=3)
    # bad input: one line, exit 2, the existing file kept
    for args, message in ((["--rows", "0", "--force"], "must be >= 1"),
                          (["--corpus", str(tmp_path / "none.jsonl"), "--force"], "not found"),
                          ([], "exists (nothing is overwritten")):
        with pytest.raises(SystemExit) as info:
            main(["preference-data", "--output", str(out), *args])
        assert info.value.code == 2, args
        assert message in capsys.readouterr().err.strip().splitlines()[-1], args
    assert [json.loads(line) for line in out.read_text().splitlines()] == written
    assert main(["preference-data", "--output", str(out), "--rows", "2", "--force"]) == 0
