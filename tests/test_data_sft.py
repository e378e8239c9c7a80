"""SFT data: reading input/output rows, prompt masks, packing, and packed == unpacked losses."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from nxdt.config.errors import ConfigError
from nxdt.spec import config_from_dict
from nxdt.data.sft import SFTDataModule, SFTRows, pack_examples, read_pairs, tokenize_pairs
from nxdt.data.tokenizers import build_tokenizer

PAIRS = [
    ("In the beginning", "God created the heaven and the earth."),
    ("And the earth was", "without form, and void."),
    ("And God said,", "Let there be light: and there was light."),
    ("And God saw the light,", "that it was good."),
    ("And the evening", "and the morning were the first day."),
]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(None)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def sft_cfg(train, packing=False, seq=32, template=None, pack=None, **data):
    sft = {"packing": packing} if pack is None else {"pack": pack}
    if template is not None:
        sft["prompt_template"] = template
    return config_from_dict({
        "seed": 1, "trainer": {"max_steps": 3, "limit_val_batches": 1, "limit_test_batches": 1},
        "model_alignment_strategy": {"sft": sft},
        "data": {"train_dir": train, "seq_length": seq, "micro_batch_size": 2, "global_batch_size": 2,
                 "num_workers": 0, **data},
    })


def test_prompt_is_masked_and_output_trained(tok, tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"input": i, "output": o} for i, o in PAIRS])
    dm = SFTDataModule(sft_cfg(path, template="Q: {input}\nA: "), None)
    dm.setup()
    item = dm.datasets["train"][0]
    prompt = [tok.bos_token_id] + tok("Q: In the beginning\nA: ", add_special_tokens=False)["input_ids"]
    out = tok("God created the heaven and the earth.", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    full = prompt + out
    n = len(full) - 1
    assert item["input_ids"][:n].tolist() == full[:-1]
    assert item["labels"][:n].tolist() == full[1:]
    # labels -100 on the prompt: the first prediction that counts is the first output token
    expect = [0.0] * (len(prompt) - 1) + [1.0] * len(out) + [0.0] * (32 - n)
    assert item["loss_mask"].tolist() == expect
    assert item["input_ids"][n:].eq(dm.pad_id).all()
    assert item["labels"][item["loss_mask"] > 0].tolist() == out  # the trained targets are exactly output + EOS


def test_packing_layout(tok):
    examples = tokenize_pairs(tok, PAIRS, None)
    lengths = [len(t) for t, _ in examples]
    rows = pack_examples(lengths, 24)
    assert [i for row in rows for i in row] == list(range(len(PAIRS)))  # every example once, in order
    for row in rows:
        assert sum(lengths[i] - 1 for i in row) <= 24
    ds = SFTRows(examples, 24, 2, packing=True)
    item = ds[0]
    pos = item["position_ids"].tolist()
    at = 0
    for i in rows[0]:  # positions restart at 0 per example; masks are per example
        n = lengths[i] - 1
        assert pos[at:at + n] == list(range(n))
        t, p = examples[i]
        assert item["loss_mask"][at:at + n].tolist() == [float(j + 1 >= p) for j in range(n)]
        assert item["input_ids"][at:at + n].tolist() == t[:-1].tolist()
        at += n
    assert item["loss_mask"][at:].sum() == 0


def _per_token_losses(model, batch):
    with torch.no_grad():
        out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"])
    logits = out.logits if hasattr(out, "logits") else out
    losses = F.cross_entropy(logits.float().flatten(0, 1), batch["labels"].flatten(), reduction="none")
    mask = batch["loss_mask"].flatten() > 0
    return losses[mask]


def _batch(ds):
    items = [ds[i] for i in range(len(ds))]
    return {k: torch.stack([it[k] for it in items]) for k in items[0]}


def _tiny_native(vocab):
    from nxdt.models.llama import LlamaArgs, NxdtLlamaForCausalLM

    torch.manual_seed(0)
    fields = {"vocab_size": vocab, "hidden_size": 64, "num_layers": 2, "num_attention_heads": 4, "num_kv_heads": 2,
              "ffn_hidden_size": 128, "max_position_embeddings": 128}
    names = set(LlamaArgs.__dataclass_fields__)
    model = NxdtLlamaForCausalLM(LlamaArgs(**{k: v for k, v in fields.items() if k in names}))
    model.init_weights()
    return model.eval()


def _tiny_hf():
    from conftest import REPO

    from nxdt.models.hf import build_hf_model

    torch.manual_seed(0)
    return build_hf_model(REPO / "conf/model_configs/tiny_llama/config.json",
                          {"num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 128, "num_attention_heads": 4,
                           "num_kv_heads": 2}).eval()


@pytest.mark.parametrize("source", ["native", "hf"])
def test_packed_and_unpacked_give_the_same_per_token_losses(tok, source):
    examples = tokenize_pairs(tok, PAIRS, "### Q: {input}\n### A: ")
    seq = 64
    unpacked, packed = SFTRows(examples, seq, 2, packing=False), SFTRows(examples, seq, 2, packing=True)
    assert len(packed) < len(unpacked)  # several examples share a row
    model = _tiny_native(len(tok)) if source == "native" else _tiny_hf()
    a = _per_token_losses(model, _batch(unpacked))
    b = _per_token_losses(model, _batch(packed))
    assert a.numel() == b.numel() == sum(len(t) - p for t, p in examples)
    torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)
    # without per-example positions the packed losses differ: the check above has teeth
    naive = _batch(packed)
    naive["position_ids"] = torch.arange(seq).expand_as(naive["position_ids"])
    assert (_per_token_losses(model, naive) - a).abs().max() > 1e-3


def test_arrow_and_save_to_disk_inputs(tmp_path):
    import datasets

    ds = datasets.Dataset.from_dict({"input": [p[0] for p in PAIRS], "output": [p[1] for p in PAIRS]})
    ds.save_to_disk(str(tmp_path / "disk"))
    assert read_pairs(str(tmp_path / "disk"), "train_dir") == PAIRS
    arrow = next((tmp_path / "disk").glob("*.arrow"))
    assert read_pairs(str(arrow), "train_dir", limit=2) == PAIRS[:2]
    bad = datasets.Dataset.from_dict({"input": ["x"], "answer": ["y"]})
    bad.save_to_disk(str(tmp_path / "bad"))
    with pytest.raises(ConfigError, match=r"bad: no 'output' column"):
        read_pairs(str(tmp_path / "bad"), "train_dir")


@pytest.mark.parametrize("text, message", [
    ("", r"e\.jsonl: no examples \(empty file\)"),
    ('{"input": "a", "output": "b"}\n{"input": "a"}\n', r"e\.jsonl:2: row has no 'output'"),
    ('{"output": "b"}\n', r"e\.jsonl:1: row has no 'input'"),
    ('{"input": "a", "output": "b"}\n{oops\n', r"e\.jsonl:2: invalid JSON"),
    ('{"input": 3, "output": "b"}\n', r"e\.jsonl:1: 'input' is int, expected a string"),
])
def test_bad_sft_rows_name_file_and_line(tmp_path, text, message):
    (tmp_path / "e.jsonl").write_text(text)
    with pytest.raises(ConfigError, match=message):
        read_pairs(str(tmp_path / "e.jsonl"), "train_dir")


def test_sft_module_loaders_and_resume(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"input": i, "output": o} for i, o in PAIRS])
    cfg = sft_cfg(path, packing=False, val_dir=path, dev_choose_samples=4)
    dm = SFTDataModule(cfg, None)
    batches = list(dm.train_dataloader())
    assert len(batches) == 3 and batches[0]["input_ids"].shape == (2, 32)
    # dev_choose_samples=4: the 3rd global batch wraps around to example 0
    assert torch.equal(batches[2]["input_ids"], batches[0]["input_ids"])
    val = list(dm.val_dataloader())
    assert len(val) == 2
    with pytest.raises(ConfigError, match=r"unknown key 'model_alignment_strategy.sft.pack' \(did you mean"):
        sft_cfg(path, pack=True)


def test_packing_from_data_key(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"input": i, "output": o} for i, o in PAIRS])
    cfg = sft_cfg(path, packing=False, seq=64)
    cfg.data.packing = True
    dm = SFTDataModule(cfg, None)
    dm.setup()
    assert dm.packing and len(dm.datasets["train"]) < len(PAIRS)
    assert np.unique(dm.datasets["train"][0]["position_ids"].numpy()).size < 64
