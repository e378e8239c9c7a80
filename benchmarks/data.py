"""Data-path throughput next to the training step rate: does data ever limit training?

    .venv/bin/python benchmarks/data.py [--chapters 300] [--steps 30] [--train-steps 8]

On the bundled King James corpus (the first --chapters chapters) it measures:
  * `nxdt preprocess` tokens/s (1 worker and 2 workers);
  * samples/s of every data module's train loader (Megatron, Megatron with cyclic, HF from disk,
    SFT unpacked and packed, dummy, logical shards), one process, num_workers=0 (the main process
    does all the work: the worst case);
  * the same for fms-fsdp shard folders: the Megatron documents written with pyarrow as a folder of
    4 Arrow IPC files (one record batch per document, int32 `tokens`) and a folder holding one
    parquet file (list<int32> `tokens`, one document per row), read through data.datasets +
    data.data_path + data.logical_shards (LogicalShardDataModule over ArrowShardDocuments);
  * dynamic data selection (data.dynamic_data_selection=sheared_llama) over a 2-domain Megatron
    blend (the corpus cut in two halves, splits 900,50,50): the loader, its batch sampler alone (the
    per-step domain draw + global-position pick, no tokens read: keys/s) at global batch 16 and 1024
    (dp 1; every rank follows the whole global batch, so this is the per-rank cost at any dp), and
    one weight update (`updated_weights`);
  * the training step rate of the tiny demo model (conf/tiny_llama_cpu.yaml sizes, 1 process,
    seq 128, global batch 16), measured in-process with the native model and AdamW,
and prints, under the CPU model and torch's CPU capability, samples/s (keys/s) of each loader
(sampler) over the samples/s training consumes (the headroom).
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

from nxdt.spec import build_spec, config_from_dict  # noqa: E402

SEQ, GBS, MBS = 128, 16, 4
BIG_GBS = 1024  # the dynamic-selection sampler at a cluster-scale global batch (dp 1)


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


def cfg_for(steps: int, alignment: dict | None = None, gbs: int = GBS, **data):
    """A typed config (schema defaults for everything not given)."""
    return config_from_dict({
        "seed": 1, "model_source": "megatron", "model": {"vocab_size": None},
        "trainer": {"max_steps": steps, "val_check_interval": steps, "limit_val_batches": 1, "limit_test_batches": 1},
        "data": {"seq_length": SEQ, "micro_batch_size": MBS, "global_batch_size": gbs, "num_workers": 0,
                 "splits_string": "980,10,10", **data},
        "model_alignment_strategy": alignment,
    })


def bench_module(cfg) -> float:
    from nxdt.data.select import build_datamodule

    dm = build_datamodule(build_spec(cfg), None)
    loader = dm.train_dataloader()  # setup (index building, tokenizing) is not timed
    start = time.perf_counter()
    n = sum(batch["input_ids"].shape[0] for batch in loader)
    return n / (time.perf_counter() - start)


def write_shards(prefix: str, root: Path) -> Path:
    """The Megatron documents of `prefix` in fms-fsdp's layouts, written with pyarrow directly:
    root/arrow (4 Arrow IPC files, every record batch one document, an int32 column `tokens`) and
    root/parquet (one file, a list<int32> column `tokens`, one document per row)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from nxdt.data.indexed import IndexedDataset

    ix = IndexedDataset(prefix)
    docs = [np.asarray(ix.get(i), dtype=np.int32) for i in range(len(ix))]
    schema = pa.schema([pa.field("tokens", pa.int32())])
    (root / "arrow").mkdir(parents=True)
    per = -(-len(docs) // 4)
    for f in range(4):
        with pa.ipc.new_file(str(root / "arrow" / f"shard_{f}.arrow"), schema) as writer:
            for doc in docs[f * per : (f + 1) * per]:
                writer.write(pa.record_batch([pa.array(doc, pa.int32())], schema=schema))
    (root / "parquet").mkdir()
    offsets = pa.array(np.concatenate([[0], np.cumsum([len(d) for d in docs])]).astype(np.int32))
    column = pa.ListArray.from_arrays(offsets, pa.array(np.concatenate(docs), pa.int32()))
    pq.write_table(pa.table({"tokens": column}), str(root / "parquet" / "docs.parquet"))
    return root


def split_prefix(prefix: str, root: Path) -> list[str]:
    """Two Megatron prefixes, the first and second half of `prefix`'s documents (two domains)."""
    from nxdt.data.indexed import IndexedDataset, IndexedDatasetBuilder

    ix = IndexedDataset(prefix)
    half = len(ix) // 2
    out = []
    for name, ids in (("kjv_a", range(half)), ("kjv_b", range(half, len(ix)))):
        with IndexedDatasetBuilder(str(root / name), dtype=ix.dtype) as builder:
            for i in ids:
                builder.add_document(ix.get(i))
        out.append(str(root / name))
    return out


def bench_sampler(cfg) -> tuple[float, float]:
    """(keys/s, seconds per global step) of the train loader's batch sampler alone: no tokens read."""
    from nxdt.data.select import build_datamodule

    sampler = build_datamodule(build_spec(cfg), None).train_dataloader().batch_sampler
    start = time.perf_counter()
    n = sum(len(batch) for batch in sampler)
    elapsed = time.perf_counter() - start
    return n / elapsed, elapsed / len(sampler)


def bench_weight_update(repeats: int = 2000) -> float:
    """Seconds of one `updated_weights` call (2 domains)."""
    from nxdt.data.dynamic_selection import updated_weights

    w = [0.5, 0.5]
    start = time.perf_counter()
    for _ in range(repeats):
        w = updated_weights(w, [2.3, 2.1], [2.0, 2.0], 1.0, 1e-4)
    return (time.perf_counter() - start) / repeats


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

        # fms-fsdp shard folders: the same documents as arrow IPC files and as a parquet file
        shards = write_shards(prefix, root / "shards")
        rows.append(("arrow + parquet shard folders", bench_module(
            cfg_for(s, datasets=["arrow", "parquet"], weights=[3, 1], data_path=str(shards), logical_shards=8)),
            "samples/s"))

        # dynamic data selection over two domains (the corpus' halves); splits 900,50,50 so that each
        # half keeps held-out documents (the weight update's) even with few --chapters
        halves = split_prefix(prefix, root)
        dynamic = {"data_prefix": [1.0, halves[0], 1.0, halves[1]], "splits_string": "900,50,50",
                   "dynamic_data_selection": "sheared_llama", "dynamic_selection": {"reference_losses": [2.0, 2.0]}}
        rows.append(("dynamic selection (2 domains)", bench_module(cfg_for(s, **dynamic)), "samples/s"))
        rows.append(("  its sampler alone", bench_sampler(cfg_for(s, **dynamic))[0], "keys/s"))
        big_rate, big_step = bench_sampler(cfg_for(s, gbs=BIG_GBS, **dynamic))
        rows.append((f"  its sampler alone, gbs {BIG_GBS}", big_rate, "keys/s"))
        update = bench_weight_update()
        train = bench_training(args.train_steps)

    import torch

    from nxdt.hardware import machine_line

    print("\n" + machine_line())
    print(f"bundled corpus: {args.chapters} chapters; seq {SEQ}, global batch {GBS}; 1 process, num_workers=0")
    print(f"training (tiny demo model, 1 process): {train:,.1f} samples/s = {train * SEQ:,.0f} tokens/s\n")
    print(f"{'what':<30} {'rate':>14}   {'x training':>10}")
    for name, rate, unit in rows:
        need = train * SEQ if unit == "tokens/s" else train  # a key is one sample
        print(f"{name:<30} {rate:>10,.0f} {unit:<10} {rate / need:>8,.0f}x")
    print(f"\ndynamic selection, gbs {BIG_GBS}, dp 1: domain draw + pick {big_step * 1e3:,.2f} ms per global step "
          f"(training that step here: {BIG_GBS / train:,.1f} s)")
    print(f"dynamic selection weight update (updated_weights, 2 domains): {update * 1e6:,.1f} us per update "
          "(one every data.dynamic_selection.update_interval steps)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
