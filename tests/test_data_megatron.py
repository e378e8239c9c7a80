"""GPT samples, splits, blending, batch samplers and the Megatron data module."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from nxdt.spec.data import parse_data_prefix, parse_datasets
from nxdt.config.errors import ConfigError
from nxdt.spec import config_from_dict
from nxdt.data.gpt_dataset import (
    BlendedDataset,
    GPTDataset,
    build_blending_indices,
    get_train_valid_test_split_,
)
from nxdt.data.indexed import IndexedDataset, IndexedDatasetBuilder
from nxdt.data.megatron_module import MegatronDataModule
from nxdt.data.samplers import MegatronPretrainingBatchSampler, MegatronPretrainingRandomBatchSampler

EOD = 1


def make_indexed(path, num_docs=23, seed=0, offset=10) -> IndexedDataset:
    """Documents of 0-17 random tokens followed by EOD; token values unique per document."""
    rng = np.random.RandomState(seed)
    builder = IndexedDatasetBuilder(str(path), np.uint16)
    for d in range(num_docs):
        n = int(rng.randint(0, 18))
        builder.add_document(list(offset + 100 * d + np.arange(n)) + [EOD])
    builder.finalize()
    return IndexedDataset(str(path))


@pytest.fixture
def indexed(tmp_path):
    return make_indexed(tmp_path / "docs")


# ----------------------------------------------------------------------------- splits / prefixes


def test_splits_string_ranges():
    assert get_train_valid_test_split_("980,10,10", 1000) == [0, 980, 990, 1000]
    assert get_train_valid_test_split_("980,10,10", 1189) == [0, 1165, 1177, 1189]
    assert get_train_valid_test_split_("1,1,1", 10) == [0, 4, 7, 10]  # rounding drift moved onto the splits
    assert get_train_valid_test_split_("98/1/1", 100) == [0, 98, 99, 100]
    assert get_train_valid_test_split_("1", 7) == [0, 7, 7, 7]
    assert get_train_valid_test_split_("100,0,0", 5) == [0, 5, 5, 5]
    with pytest.raises(ConfigError, match="data.splits_string"):
        get_train_valid_test_split_("a,b", 10)


def test_parse_data_prefix():
    assert parse_data_prefix("/d/x").blend == ((1.0, "/d/x"),)
    assert parse_data_prefix(["/d/x"]).blend == ((1.0, "/d/x"),)
    assert parse_data_prefix([0.3, "/a", 0.7, "/b"]).blend == ((0.3, "/a"), (0.7, "/b"))
    assert parse_data_prefix(OmegaConf.create({"p": [1, "/a", "2", "/b"]}).p).blend == ((1.0, "/a"), (2.0, "/b"))
    split = parse_data_prefix(OmegaConf.create({"train": [1, "/a"], "validation": ["/v"], "test": "/t"}))
    assert split.split_blends == {"train": ((1.0, "/a"),), "validation": ((1.0, "/v"),), "test": ((1.0, "/t"),)}
    assert split.paths == ["/a", "/v", "/t"] and split.pairs("test") == ((1.0, "/t"),)
    # the data side's split aliases are accepted by the one parser (validation included)
    assert parse_data_prefix({"train": "/a", "val": "/v"}).pairs("validation") == ((1.0, "/v"),)
    assert parse_data_prefix({"train": "/a", "valid": "/v"}).pairs("validation") == ((1.0, "/v"),)
    for bad in ([0.5, "/a", 0.5], ["/a", "/b"], ["x", "/a"], [], {"training": ["/a"]}, None, [0, "/a"],
                {"validation": "/v"}, [float("nan"), "/a"]):
        with pytest.raises(ConfigError, match="data.data_prefix"):
            parse_data_prefix(bad)


def test_parse_datasets():
    assert parse_datasets(["/a", "/b"], None).blend == ((1.0, "/a"), (1.0, "/b"))
    assert parse_datasets(["/a", "/b"], [3, 1]).pairs("train") == ((3.0, "/a"), (1.0, "/b"))
    with pytest.raises(ConfigError, match="data.weights has 1 entries but data.datasets has 2"):
        parse_datasets(["/a", "/b"], [1])
    with pytest.raises(ConfigError, match="must be non-negative with a positive sum"):
        parse_datasets(["/a"], [-1])
    with pytest.raises(ConfigError, match="data.datasets: give at least one dataset"):
        parse_datasets([], None)


# ----------------------------------------------------------------------------- GPT dataset


def _stream(indexed, doc_idx):
    return np.concatenate([indexed[int(d)] for d in doc_idx]).astype(np.int64)


def test_gpt_samples_follow_shuffled_document_stream(indexed):
    S, docs = 16, np.arange(3, 20)
    ds = GPTDataset(indexed, docs, num_samples=40, seq_length=S, seed=7, eod_id=EOD)
    per_epoch = len(docs)
    epochs = len(ds.doc_idx) // per_epoch
    assert len(ds.doc_idx) == epochs * per_epoch
    for e in range(epochs):  # every epoch is a permutation of the split's documents
        assert sorted(ds.doc_idx[e * per_epoch:(e + 1) * per_epoch].tolist()) == docs.tolist()
    assert ds.doc_idx[:per_epoch].tolist() != docs.tolist()  # shuffled
    tokens_per_epoch = int(indexed.sizes[docs].sum())
    assert (epochs - 1) * tokens_per_epoch < 40 * S + 1 <= epochs * tokens_per_epoch  # just enough epochs
    stream = _stream(indexed, ds.doc_idx)
    assert ds.num_built_samples == (len(stream) - 1) // S >= 40
    for j in range(ds.num_built_samples):
        assert ds.raw_sample(j).tolist() == stream[j * S:j * S + S + 1].tolist()
    assert sorted(ds.shuffle_idx.tolist()) == list(range(ds.num_built_samples))
    assert len(ds) == 40
    for i in range(len(ds)):
        item, raw = ds[i], ds.raw_sample(int(ds.shuffle_idx[i]))
        assert item["input_ids"].tolist() == raw[:-1].tolist()
        assert item["labels"].tolist() == raw[1:].tolist()
        assert item["input_ids"].dtype == torch.long and item["loss_mask"].dtype == torch.float32
        assert item["loss_mask"].tolist() == [1.0] * S
        assert item["position_ids"].tolist() == list(range(S))
    with pytest.raises(IndexError):
        ds[40]
    again = GPTDataset(indexed, docs, num_samples=40, seq_length=S, seed=7, eod_id=EOD)
    assert np.array_equal(again.shuffle_idx, ds.shuffle_idx) and np.array_equal(again.doc_idx, ds.doc_idx)
    other = GPTDataset(indexed, docs, num_samples=40, seq_length=S, seed=8, eod_id=EOD)
    assert not np.array_equal(other.doc_idx, ds.doc_idx)


def _megatron_masks(tokens, eod, reset_position_ids, eod_mask_loss):
    """Megatron's _get_ltor_masks_and_position_ids, written as its loop."""
    S = len(tokens)
    loss_mask = np.ones(S, np.float32)
    if eod_mask_loss:
        loss_mask[tokens == eod] = 0.0
    position_ids = np.arange(S)
    if reset_position_ids:
        prev = 0
        for i in np.nonzero(tokens == eod)[0]:
            position_ids[i + 1:] -= i + 1 - prev
            prev = i + 1
    return loss_mask, position_ids


@pytest.mark.parametrize("extra", [True, False])
def test_empty_documents_in_the_stream(tmp_path, extra):
    builder = IndexedDatasetBuilder(str(tmp_path / "z"), np.int32)
    for doc in ([], [10, 11, 12], [], [], [20, 21], [30, 31, 32, 33, 34], []):
        builder.add_document(doc)
    builder.finalize()
    indexed = IndexedDataset(str(tmp_path / "z"))
    S = 3
    ds = GPTDataset(indexed, np.arange(7), 9, S, seed=2, add_extra_token=extra)
    stream = _stream(indexed, ds.doc_idx)
    for j in range(ds.num_built_samples):
        assert ds.raw_sample(j).tolist() == stream[j * S:j * S + S + int(extra)].tolist()


def test_loss_mask_and_position_reset_match_megatron(indexed):
    ds = GPTDataset(indexed, np.arange(23), num_samples=30, seq_length=24, seed=1, eod_id=EOD,
                    eod_mask_loss=True, reset_position_ids=True)
    seen_eod = 0
    for i in range(len(ds)):
        item = ds[i]
        tokens = item["input_ids"].numpy()
        seen_eod += int((tokens == EOD).sum())
        loss_mask, position_ids = _megatron_masks(tokens, EOD, True, True)
        assert item["loss_mask"].tolist() == loss_mask.tolist()
        assert item["position_ids"].tolist() == position_ids.tolist()
    assert seen_eod > 10


def test_no_extra_token_mode(indexed):
    S = 8
    ds = GPTDataset(indexed, np.arange(23), num_samples=12, seq_length=S, seed=3, eod_id=EOD, add_extra_token=False)
    stream = _stream(indexed, ds.doc_idx)
    assert ds.num_built_samples == len(stream) // S
    for j in range(ds.num_built_samples):
        assert ds.raw_sample(j).tolist() == stream[j * S:(j + 1) * S].tolist()
    item = ds[0]
    assert item["labels"][:-1].tolist() == item["input_ids"][1:].tolist()
    assert item["loss_mask"][-1] == 0.0 and item["loss_mask"][:-1].sum() == S - 1


def test_index_mapping_cache(indexed, tmp_path):
    cache = tmp_path / "cache"
    a = GPTDataset(indexed, np.arange(10), 25, 16, 5, eod_id=EOD, index_mapping_dir=str(cache))
    files = sorted(p.name for p in cache.iterdir())
    assert len(files) == 3 and not any(f.endswith(".tmp") for f in files)
    b = GPTDataset(indexed, np.arange(10), 25, 16, 5, eod_id=EOD, index_mapping_dir=str(cache))
    assert isinstance(b.shuffle_idx, np.memmap)  # loaded, not rebuilt
    assert all(a[i]["input_ids"].tolist() == b[i]["input_ids"].tolist() for i in range(25))
    GPTDataset(indexed, np.arange(10), 26, 16, 5, eod_id=EOD, index_mapping_dir=str(cache))
    assert len(list(cache.iterdir())) == 6  # other parameters, other files


def test_empty_split_raises(indexed):
    with pytest.raises(ConfigError, match="no tokens"):
        GPTDataset(indexed, np.arange(0), 5, 16, 1, eod_id=EOD, name="validation")


# ----------------------------------------------------------------------------- blending


def test_blending_follows_megatron_rule():
    # Worked by hand with x = max(i, 1), error_d = w_d * x - taken_d, ties to the lower index:
    # i=0 x=1 (.3,.7)->1 | i=1 x=1 (.3,-.3)->0 | i=2 x=2 (-.4,.4)->1 | i=3 x=3 (-.1,.1)->1
    # i=4 x=4 (.2,-.2)->0 | i=5 (-.5,.5)->1 | i=6 (-.2,.2)->1 | i=7 (.1,-.1)->0 | i=8 (-.6,.6)->1
    # i=9 (-.3,.3)->1
    index, sample = build_blending_indices([0.3, 0.7], 10)
    assert index.tolist() == [1, 0, 1, 1, 0, 1, 1, 0, 1, 1]
    assert sample.tolist() == [0, 0, 1, 2, 1, 3, 4, 2, 5, 6]
    # Unnormalised weights are normalised; a tie goes to the lowest index.
    index, sample = build_blending_indices([1, 1], 4)
    assert index.tolist() == [0, 1, 0, 1] and sample.tolist() == [0, 0, 1, 1]
    index, _ = build_blending_indices([2, 1, 1], 8)
    assert index.tolist() == [0, 1, 2, 0, 0, 1, 2, 0]


def test_blended_dataset_maps_samples():
    a, b = [("a", i) for i in range(5)], [("b", i) for i in range(9)]
    ds = BlendedDataset([a, b], [0.3, 0.7], 10)
    assert [ds[i] for i in range(10)] == [("b", 0), ("a", 0), ("b", 1), ("b", 2), ("a", 1), ("b", 3), ("b", 4),
                                         ("a", 2), ("b", 5), ("b", 6)]
    with pytest.raises(ValueError, match="needs 3 samples from dataset 0"):
        BlendedDataset([a[:2], b], [0.3, 0.7], 10)


# ----------------------------------------------------------------------------- samplers


@pytest.mark.parametrize("cls", [MegatronPretrainingBatchSampler, MegatronPretrainingRandomBatchSampler])
def test_two_dp_ranks_cover_each_global_batch_once(cls):
    total, gbs, dp = 100, 8, 2
    full = list(cls(total, 0, gbs, gbs, 0, 1))
    ranks = [list(cls(total, 0, gbs // dp, gbs, r, dp)) for r in range(dp)]
    assert len(full) == len(ranks[0]) == len(ranks[1]) == total // gbs == len(cls(total, 0, gbs // dp, gbs, 1, dp))
    for step, global_batch in enumerate(full):
        assert ranks[0][step] + ranks[1][step] == global_batch  # rank r takes the r-th contiguous slice
        assert len(set(global_batch)) == gbs
    seen = [i for batch in full for i in batch]
    assert len(seen) == len(set(seen)) == (total // gbs) * gbs
    if cls is MegatronPretrainingBatchSampler:
        assert full[0] == list(range(8)) and full[1] == list(range(8, 16))


@pytest.mark.parametrize("cls", [MegatronPretrainingBatchSampler, MegatronPretrainingRandomBatchSampler])
def test_resume_from_consumed_samples(cls):
    total, gbs, dp = 96, 8, 2
    for rank in range(dp):
        uninterrupted = list(cls(total, 0, gbs // dp, gbs, rank, dp))
        for k in (0, 1, 5, 11):
            resumed = cls(total, k * gbs, gbs // dp, gbs, rank, dp)
            assert len(resumed) == len(uninterrupted) - k
            assert list(resumed) == uninterrupted[k:]


def test_random_sampler_epochs_continue():
    s = MegatronPretrainingRandomBatchSampler(20, 0, 4, 4, 0, 1, seed=3)
    epoch0, epoch1 = list(s), list(s)
    assert sorted(i for b in epoch0 for i in b) == list(range(20))
    assert sorted(i for b in epoch1 for i in b) == list(range(20)) and epoch0 != epoch1
    resumed = MegatronPretrainingRandomBatchSampler(20, 28, 4, 4, 0, 1, seed=3)  # epoch 1, batch 2
    assert list(resumed) == epoch1[2:]


def test_sequential_sampler_partial_last_batch():
    s = MegatronPretrainingBatchSampler(10, 0, 2, 4, 1, 2, drop_last=False)
    assert list(s) == [[2, 3], [6, 7]] and len(s) == 2
    s = MegatronPretrainingBatchSampler(11, 0, 2, 4, 1, 2, drop_last=False)
    assert list(s) == [[2, 3], [6, 7], [10]] and len(s) == 3
    assert list(MegatronPretrainingBatchSampler(11, 0, 2, 4, 1, 2)) == [[2, 3], [6, 7]]
    with pytest.raises(ValueError):
        MegatronPretrainingBatchSampler(10, 0, 3, 4, 0, 2)


# ----------------------------------------------------------------------------- data module


def _cfg(prefix, **data):
    base = {
        "data_prefix": prefix, "seq_length": 16, "micro_batch_size": 2, "global_batch_size": 8,
        "splits_string": "80,10,10", "tokenizer": {"library": "huggingface", "type": None},
        "eod_mask_loss": True, "reset_position_ids": True, "num_workers": 0,
    }
    base.update(data)
    return config_from_dict({
        "seed": 1234, "data": base,
        "trainer": {"max_steps": 6, "val_check_interval": 3, "limit_val_batches": 2, "limit_test_batches": 1.0},
    })


def _trainer(rank, size, consumed=0):
    return SimpleNamespace(strategy=SimpleNamespace(dp_rank=rank, dp_size=size),
                           lightning_module=SimpleNamespace(consumed_samples=consumed))


@pytest.fixture
def corpus(tmp_path):
    return make_indexed(tmp_path / "corpus", num_docs=60, seed=4)


def test_data_module_batches_without_trainer(corpus):
    dm = MegatronDataModule(_cfg([corpus.prefix]), None)
    assert dm.vocab_size == 8192 and dm.eod_id == EOD
    dm.setup("fit")
    assert {k: len(v) for k, v in dm.datasets.items()} == {"train": 48, "validation": 48, "test": 8}
    loader = dm.train_dataloader()
    batches = list(loader)
    assert len(loader) == len(batches) == 6
    b = batches[0]
    assert set(b) == {"input_ids", "labels", "loss_mask", "position_ids"}
    for key in ("input_ids", "labels", "position_ids"):
        assert b[key].shape == (8, 16) and b[key].dtype == torch.long
    assert b["loss_mask"].shape == (8, 16) and b["loss_mask"].dtype == torch.float32
    assert torch.equal(b["input_ids"][:, 1:], b["labels"][:, :-1])
    assert torch.equal(b["input_ids"][3], dm.datasets["train"][3]["input_ids"])
    assert len(dm.val_dataloader()) == 6 and len(dm.test_dataloader()) == 1
    assert next(iter(dm.val_dataloader()))["input_ids"].shape == (8, 16)
    # train documents are the first 80% (48 of 60), never the validation ones
    assert set(dm.datasets["train"].doc_idx.tolist()) == set(range(48))
    assert set(dm.datasets["validation"].doc_idx.tolist()) == set(range(48, 54))


def test_data_module_dp_split_and_resume(corpus):
    cfg = _cfg([corpus.prefix])
    single = list(MegatronDataModule(cfg, None).train_dataloader())
    per_rank = []
    for rank in range(2):
        dm = MegatronDataModule(cfg, _trainer(rank, 2))
        per_rank.append(list(dm.train_dataloader()))
    for step, full in enumerate(single):
        assert per_rank[0][step]["input_ids"].shape == (4, 16)
        assert torch.equal(torch.cat([per_rank[0][step]["input_ids"], per_rank[1][step]["input_ids"]]),
                           full["input_ids"])
    resumed = list(MegatronDataModule(cfg, _trainer(0, 1, consumed=4 * 8)).train_dataloader())
    assert len(resumed) == 2
    assert all(torch.equal(r["input_ids"], f["input_ids"]) for r, f in zip(resumed, single[4:]))


def test_data_module_blend_and_split_dict(tmp_path, corpus):
    other = make_indexed(tmp_path / "other", num_docs=40, seed=9, offset=60)  # ids end in 60-77, the corpus's in 10-27
    dm = MegatronDataModule(_cfg([0.25, corpus.prefix, 0.75, other.prefix]), None)
    dm.setup()
    train = dm.datasets["train"]
    assert isinstance(train, BlendedDataset) and len(train) == 48
    assert np.bincount(train.dataset_index).tolist() == [12, 36]
    from_other = [i for i in range(48) if train.dataset_index[i] == 1]
    assert all(int((train[i]["input_ids"] % 100).max()) >= 60 for i in from_other[:5])

    dm = MegatronDataModule(_cfg({"train": [corpus.prefix], "validation": [other.prefix]}), None)
    dm.setup()
    assert dm.datasets["test"] is None and dm.test_dataloader() == []
    assert set(dm.datasets["validation"].doc_idx.tolist()) == set(range(40))  # whole dataset, no split


def test_data_module_errors(corpus):
    with pytest.raises(ConfigError, match="data.data_prefix"):
        MegatronDataModule(_cfg([0.5, corpus.prefix, 0.5]), None).setup()
    with pytest.raises(ConfigError, match="not found"):
        MegatronDataModule(_cfg(["/nonexistent/prefix"]), None).setup()
    with pytest.raises(ConfigError, match="data.dataloader_type"):
        MegatronDataModule(_cfg([corpus.prefix], dataloader_type="bogus"), None)
    with pytest.raises(ConfigError, match="data.tokenizer.type"):
        MegatronDataModule(_cfg([corpus.prefix], tokenizer={"type": "/nonexistent/tok"}), None)


def test_data_module_cyclic_with_worker(corpus):
    cfg = _cfg([corpus.prefix], dataloader_type="cyclic", num_workers=1)
    batches = list(MegatronDataModule(cfg, None).train_dataloader())
    assert len(batches) == 6 and batches[0]["input_ids"].shape == (8, 16)
    ids = torch.cat([b["input_ids"] for b in batches])
    assert len({tuple(row.tolist()) for row in ids}) == 48  # a permutation: no sample twice


def test_index_mapping_cached_next_to_data_by_default(corpus, tmp_path):
    dm = MegatronDataModule(_cfg([corpus.prefix]), None)
    dm.setup()
    assert len([p for p in tmp_path.iterdir() if p.name.endswith("_idx.npy")]) == 9  # 3 splits x 3 arrays


def test_indexed_dataset_pickles_by_path(corpus):
    import pickle

    clone = pickle.loads(pickle.dumps(corpus))
    assert len(pickle.dumps(corpus)) < 500
    assert [clone[i].tolist() for i in range(len(clone))] == [corpus[i].tolist() for i in range(len(corpus))]


# ----------------------------------------------------------------------------- document masking, cache by rank 0


def test_reset_attention_mask_blocks_attention_across_documents(corpus):
    """Either Megatron switch restarts positions after each eod; the native model then masks attention."""
    from nxdt.models.llama import build_attention_mask

    for flags in ({"reset_attention_mask": True, "reset_position_ids": False},
                  {"reset_attention_mask": False, "reset_position_ids": True}):
        dm = MegatronDataModule(_cfg([corpus.prefix], eod_mask_loss=False, **flags), None)
        batch = next(iter(dm.train_dataloader()))
        row = next(i for i in range(8) if (batch["input_ids"][i, :-1] == EOD).any())
        ids, pos = batch["input_ids"][row], batch["position_ids"][row]
        cut = int((ids[:-1] == EOD).nonzero()[0]) + 1
        assert pos[cut] == 0 and pos[cut - 1] != 0 or cut == 1
        mask = build_attention_mask(16, ids.device, pos[None])
        assert mask is not None and not mask[0, 0, cut, cut - 1] and mask[0, 0, cut - 1, 0]
    plain = MegatronDataModule(_cfg([corpus.prefix], eod_mask_loss=False, reset_position_ids=False), None)
    assert next(iter(plain.train_dataloader()))["position_ids"].eq(torch.arange(16)).all()


def _cache_worker(rank, prefix, cache_dir, rendezvous, out):
    import os as _os

    import torch.distributed as dist

    # a file rendezvous, not a port: a free port picked here could be taken by the other pytest
    # worker's launches before rank 0 listens on it (EADDRINUSE, seen once in CI)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2)
    try:
        from nxdt.data.gpt_dataset import GPTDataset
        from nxdt.data.indexed import IndexedDataset

        ix = IndexedDataset(prefix)
        ds = GPTDataset(ix, np.arange(len(ix)), 40, 16, 5, eod_id=EOD, index_mapping_dir=cache_dir)
        np.save(f"{out}_{rank}.npy", np.asarray(ds.shuffle_idx))
        # what rank 1 found on disk right after the barrier: the files rank 0 wrote
        np.save(f"{out}_{rank}_files.npy", np.asarray(sorted(_os.listdir(cache_dir))))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_index_mapping_built_by_rank_0_others_wait(corpus, tmp_path):
    import os

    import torch.multiprocessing as mp

    cache = tmp_path / "cache"
    cache.mkdir()
    mp.spawn(_cache_worker, args=(corpus.prefix, str(cache), str(tmp_path / "rendezvous"), str(tmp_path / "r")),
             nprocs=2, join=True)
    a, b = np.load(tmp_path / "r_0.npy"), np.load(tmp_path / "r_1.npy")
    assert np.array_equal(a, b)
    files = sorted(os.listdir(cache))
    assert len(files) == 3 and all(f.endswith("_idx.npy") for f in files)  # written once, no temporaries left
    assert np.load(tmp_path / "r_1_files.npy").tolist() == files
