"""Data-path throughput next to the training step rate: does data ever limit training?

    .venv/bin/python benchmarks/data.py [--chapters 300] [--steps 30] [--train-steps 8]

On the bundled King James corpus (the first --chapters chapters) it measures:
  * `nxdt preprocess` tokens/s (1 worker and 2 workers);
  * samples/s of every data module's train loader (Megatron, Megatron with cyclic, HF from disk,
    SFT unpacked and packed, dummy, logical shards), one process, num_workers=0 (the main process
    does all the work: the worst case);
  * the training step rate of the tiny demo model (conf/tiny_llama_cpu.yaml sizes, 1 process,
    seq 128, global batch 16), measured in-process with the native model and AdamW,
and prints samples/s of each module over the samples/s training consumes (the headroom).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from nxdt.config import config_from_dict  # noqa: E402

SEQ, GBS, MBS = 128, 16, 4


def corpus(root: Path, chapters: int) -> tuple[Path, list[str]]:
    from nxdt.data.assets import bundled_corpus_path

    texts = []
    with gzip.open(bundled_corpus_path(), "rt", encoding="utf-8") as f:
        for _, line in zip(range(chapters), f):
            texts.append(json.loads(line)["text"])
    path = root / "kjv.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path, texts


def bench_preprocess(src: Path, root: Path, workers: int) -> float:
    from nxdt.data.indexed import IndexedDataset
    from nxdt.tools import preprocess

    prefix = root / f"kjv_w{workers}"
    start = time.perf_counter()
    preprocess.main(["--input", str(src), "--output-prefix", str(prefix), "--workers", str(workers), "--quiet",
                     "--overwrite"])
    elapsed = time.perf_counter() - start
    return int(IndexedDataset(str(prefix)).sizes.sum()) / elapsed


def cfg_for(steps: int, alignment: dict | None = None, **data):
    """A typed config (schema defaults for everything not given)."""
    return config_from_dict({
        "seed": 1, "model_source": "megatron", "model": {"vocab_size": None},
        "trainer": {"max_steps": steps, "val_check_interval": steps, "limit_val_batches": 1, "limit_test_batches": 1},
        "data": {"seq_length": SEQ, "micro_batch_size": MBS, "global_batch_size": GBS, "num_workers": 0,
                 "splits_string": "980,10,10", **data},
        "model_alignment_strategy": alignment,
    })


def bench_module(cfg) -> float:
    from nxdt.data.select import build_datamodule

    dm = build_datamodule(cfg, None)
    loader = dm.train_dataloader()  # setup (index building, tokenizing) is not timed
    start = time.perf_counter()
    n = sum(batch["input_ids"].shape[0] for batch in loader)
    return n / (time.perf_counter() - start)


def bench_training(steps: int) -> float:
    """Samples/s of the demo model's optimizer steps (forward + backward + AdamW), 1 process."""
    import torch
    import torch.nn.functional as F

    from nxdt.models.llama import LlamaArgs, NxdtLlamaForCausalLM

    torch.manual_seed(0)
    model = NxdtLlamaForCausalLM(LlamaArgs(vocab_size=8192, hidden_size=256, num_layers=4, num_attention_heads=8,
                                           num_kv_heads=4, ffn_hidden_size=704, max_position_embeddings=1024))
    model.init_weights()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 8192, (GBS, SEQ + 1))

    def step():
        opt.zero_grad()
        for mb in x.split(MBS):
            logits = model(mb[:, :-1])
            (F.cross_entropy(logits.flatten(0, 1), mb[:, 1:].flatten()) / (GBS // MBS)).backward()
        opt.step()

    step()  # warm-up
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return steps * GBS / (time.perf_counter() - start)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chapters", type=int, default=300)
    parser.add_argument("--steps", type=int, default=30, help="global batches read per data module")
    parser.add_argument("--train-steps", type=int, default=3, help="optimizer steps timed for the training rate")
    args = parser.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    import datasets

    from nxdt.data.tokenizers import build_tokenizer

    datasets.disable_progress_bars()
    with tempfile.TemporaryDirectory(prefix="nxdt-bench-") as tmp:
        root = Path(tmp)
        src, texts = corpus(root, args.chapters)
        rows = []
        rows.append(("preprocess, 1 worker", bench_preprocess(src, root, 1), "tokens/s"))
        rows.append(("preprocess, 2 workers", bench_preprocess(src, root, 2), "tokens/s"))
        prefix = str(root / "kjv_w1")

        tok = build_tokenizer(None)
        ids = [t for text in texts for t in tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]]
        blocks = [ids[i : i + SEQ + 1] for i in range(0, len(ids) - SEQ - 1, SEQ)]
        datasets.Dataset.from_dict({"input_ids": blocks}).save_to_disk(str(root / "hf"))
        words = " ".join(texts).split()  # SFT pairs: 12 words of prompt, 8 to 40 words of answer
        pairs = [(" ".join(words[i : i + 12]), " ".join(words[i + 12 : i + 20 + i % 33])) for i in range(0, len(words) - 60, 50)]
        (root / "sft.jsonl").write_text("".join(json.dumps({"input": a, "output": b}) + "\n" for a, b in pairs))
        sft = {"train_dir": str(root / "sft.jsonl")}
        s = args.steps
        modules = [
            ("megatron (single)", cfg_for(s, data_prefix=[1.0, prefix])),
            ("megatron (cyclic)", cfg_for(s, data_prefix=[1.0, prefix], dataloader_type="cyclic")),
            ("megatron, blend of 2", cfg_for(s, data_prefix=[0.7, prefix, 0.3, str(root / "kjv_w2")])),
            ("hf (save_to_disk)", cfg_for(s, train_dir=str(root / "hf"))),
            ("sft (unpacked)", cfg_for(s, alignment={"sft": {}}, **sft)),
            ("sft (packed)", cfg_for(s, alignment={"sft": {"packing": True}}, **sft)),
            ("dummy", cfg_for(s, use_dummy_dataset=True)),
            ("logical shards (2 datasets)", cfg_for(s, datasets=[prefix, str(root / "kjv_w2")], weights=[3, 1],
                                                    logical_shards=8)),
        ]
        for name, cfg in modules:
            rows.append((name, bench_module(cfg), "samples/s"))
        train = bench_training(args.train_steps)

    print(f"\nbundled corpus: {args.chapters} chapters; seq {SEQ}, global batch {GBS}; 1 process, num_workers=0")
    print(f"training (tiny demo model, 1 process): {train:,.1f} samples/s = {train * SEQ:,.0f} tokens/s\n")
    print(f"{'what':<30} {'rate':>14}   {'x training':>10}")
    for name, rate, unit in rows:
        need = train * SEQ if unit == "tokens/s" else train
        print(f"{name:<30} {rate:>10,.0f} {unit:<10} {rate / need:>8,.0f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
