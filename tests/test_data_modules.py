"""HF, dummy, custom and logical-shard data modules, and which module a config selects."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from nxdt.config.errors import ConfigError
from nxdt.spec import build_spec, config_from_dict
from nxdt.config.schema import AlignmentConfig, SFTConfig
from nxdt.data.hf_module import HFDataModule
from nxdt.data.select import build_datamodule, datamodule_kind

S = 16


def base_cfg(**data):
    return config_from_dict({
        "seed": 7, "model_source": "megatron", "model": {"vocab_size": None},
        "trainer": {"max_steps": 4, "val_check_interval": 2, "limit_val_batches": 1, "limit_test_batches": 1},
        "data": {"seq_length": S, "micro_batch_size": 2, "global_batch_size": 4, "num_workers": 0,
                 "splits_string": "980,10,10", **data},
    })


def fake_trainer(rank=0, size=1, consumed=0):
    return types.SimpleNamespace(strategy=types.SimpleNamespace(dp_rank=rank, dp_size=size),
                                 lightning_module=types.SimpleNamespace(consumed_samples=consumed))


# ----------------------------------------------------------------------------- HF


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    import datasets

    root = tmp_path_factory.mktemp("hf")
    rows = [list(range(100 * i, 100 * i + S + 1)) for i in range(10)]  # seq_length + 1 tokens per row
    datasets.Dataset.from_dict({"input_ids": rows}).save_to_disk(str(root / "train"))
    nxdt_style = [r[:S] for r in rows[:8]]  # NxDT's format: seq_length tokens, labels = input_ids
    datasets.DatasetDict({"validation": datasets.Dataset.from_dict(
        {"input_ids": nxdt_style, "labels": nxdt_style})}).save_to_disk(str(root / "val"))
    return root


def test_hf_module_batches_resume_and_dev_choose(hf_dirs):
    cfg = base_cfg(train_dir=str(hf_dirs / "train"), val_dir=str(hf_dirs / "val"))
    full = list(HFDataModule(cfg, fake_trainer()).train_dataloader())
    assert len(full) == 4 and full[0]["input_ids"].shape == (4, S)
    b = full[0]
    assert b["input_ids"][0].tolist() == list(range(S)) and b["labels"][0].tolist() == list(range(1, S + 1))
    assert b["loss_mask"].eq(1).all()
    # the dataset (10 rows) is shorter than 4 steps x 4: training goes round it, in order
    assert full[2]["input_ids"][2, 0] == 0
    # resume after 2 steps: the batches an uninterrupted run would have seen next (not sample 0)
    resumed = list(HFDataModule(cfg, fake_trainer(consumed=8)).train_dataloader())
    assert len(resumed) == 2
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(full[2:], resumed))
    # two dp ranks each take their half of every global batch
    halves = [list(HFDataModule(cfg, fake_trainer(r, 2)).train_dataloader()) for r in (0, 1)]
    assert torch.equal(torch.cat([halves[0][1]["input_ids"], halves[1][1]["input_ids"]]), full[1]["input_ids"])
    # dev_choose_samples keeps the first N rows
    cfg.data.dev_choose_samples = 3
    few = list(HFDataModule(cfg, None).train_dataloader())
    assert few[0]["input_ids"][3, 0] == 0  # row 3 is row 0 again
    # validation: a DatasetDict's validation split, NxDT rows of seq_length tokens (last position masked)
    val = list(HFDataModule(cfg, None).val_dataloader())
    assert len(val) == 0  # dev_choose_samples=3 < one global batch of 4: no whole batch
    cfg.data.dev_choose_samples = None
    val = list(HFDataModule(cfg, None).val_dataloader())
    assert len(val) == 2
    assert val[0]["loss_mask"][0].tolist() == [1.0] * (S - 1) + [0.0]
    assert val[0]["labels"][0, : S - 1].tolist() == list(range(1, S))
    assert HFDataModule(cfg, None).test_dataloader() == []


def test_hf_module_bad_input(tmp_path, hf_dirs):
    with pytest.raises(ConfigError, match="data.train_dir: .*nowhere: not a directory"):
        HFDataModule(base_cfg(train_dir=str(tmp_path / "nowhere")), None).setup()
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="data.train_dir: .*empty: not a datasets.save_to_disk directory"):
        HFDataModule(base_cfg(train_dir=str(tmp_path / "empty")), None).setup()
    import datasets

    datasets.Dataset.from_dict({"text": ["a"]}).save_to_disk(str(tmp_path / "text"))
    with pytest.raises(ConfigError, match="no 'input_ids' column"):
        HFDataModule(base_cfg(train_dir=str(tmp_path / "text")), None).setup()


# ----------------------------------------------------------------------------- dummy, custom, selection


def test_dummy_module_is_seeded_and_in_vocab():
    cfg = base_cfg(use_dummy_dataset=True)
    cfg.model.vocab_size = 50
    dm = build_datamodule(build_spec(cfg), None)
    assert type(dm).__name__ == "DummyDataModule" and dm.vocab_size == 50
    a = list(dm.train_dataloader())
    b = list(build_datamodule(build_spec(cfg), fake_trainer(consumed=4)).train_dataloader())
    assert len(a) == 4 and a[0]["input_ids"].shape == (4, S) and int(a[0]["input_ids"].max()) < 50
    assert torch.equal(a[1]["input_ids"], b[0]["input_ids"])  # resume continues the same stream
    assert torch.equal(a[0]["labels"][:, :-1], a[0]["input_ids"][:, 1:])
    assert len(list(dm.val_dataloader())) == 3  # (4 // 2 + 1) validations x 1 batch


CUSTOM = '''
import lightning.pytorch as pl
import torch

class Tiny(pl.LightningDataModule):
    def __init__(self, cfg, trainer):
        super().__init__()
        self.vocab_size = 11
        self.extra = cfg.data.custom["my_rows"]

    def train_dataloader(self):
        ids = torch.zeros(self.extra, 4, dtype=torch.long)
        return [{"input_ids": ids, "labels": ids, "loss_mask": torch.ones(self.extra, 4)}]

class NotAModule:
    def __init__(self, cfg, trainer):
        pass

class NoVocab(pl.LightningDataModule):
    def __init__(self, cfg, trainer):
        super().__init__()
'''


def test_custom_module_by_class_path(tmp_path, monkeypatch):
    (tmp_path / "my_data_pkg.py").write_text(CUSTOM)
    monkeypatch.chdir(tmp_path)  # the working directory is searched too
    cfg = base_cfg(data_module="my_data_pkg.Tiny", my_rows=3)
    dm = build_datamodule(build_spec(cfg), None)
    assert dm.vocab_size == 11 and dm.train_dataloader()[0]["input_ids"].shape == (3, 4)
    for path, message in [
        ("no_such_pkg.Mod", "data.data_module: cannot import module 'no_such_pkg' for 'no_such_pkg.Mod'"),
        ("my_data_pkg.Missing", "data.data_module: module 'my_data_pkg' .* has no class 'Missing'"),
        ("my_data_pkg.NotAModule", "is not a lightning.pytorch.LightningDataModule subclass"),
        ("my_data_pkg.NoVocab", "has no vocab_size attribute; set it in the module or set model.vocab_size"),
    ]:
        cfg.data.data_module = path
        with pytest.raises(ConfigError, match=message) as info:
            build_datamodule(build_spec(cfg), None)
        assert "\n" not in str(info.value)
    cfg.model.vocab_size = 99
    assert build_datamodule(build_spec(cfg), None).vocab_size == 99


def test_selection_order():
    cfg = base_cfg(data_prefix=[1.0, "x"], train_dir="t")
    assert datamodule_kind(cfg) == "megatron"  # a megatron model with data_prefix keeps Megatron data
    cfg.model_source = "hf"
    assert datamodule_kind(cfg) == "hf"
    cfg.data.datasets = ["x"]
    assert datamodule_kind(cfg) == "logical_shards"
    cfg.data.use_dummy_dataset = True
    assert datamodule_kind(cfg) == "dummy"
    cfg.model_alignment_strategy = AlignmentConfig(sft=SFTConfig(packing=True))
    assert datamodule_kind(cfg) == "sft"
    cfg.data.data_module = "a.B"
    assert datamodule_kind(cfg) == "custom"
    with pytest.raises(ConfigError, match="data: no data source"):
        datamodule_kind(base_cfg())
    with pytest.raises(ConfigError, match="data.packing: packing applies to SFT data only"):  # validation's rule
        config_from_dict({"model": {"num_layers": 2, "hidden_size": 8, "ffn_hidden_size": 16, "num_attention_heads": 2},
                          "data": {"use_dummy_dataset": True, "packing": True}}, world_size=1, check=True)


# ----------------------------------------------------------------------------- logical shards


def _indexed(tmp_path, name, num_docs, seed):
    from nxdt.data.indexed import IndexedDataset, IndexedDatasetBuilder

    rng = np.random.RandomState(seed)
    with IndexedDatasetBuilder(str(tmp_path / name), dtype=np.uint16) as b:
        for _ in range(num_docs):
            b.add_document(rng.randint(3, 1000, size=rng.randint(5, 40)))
    return IndexedDataset(str(tmp_path / name))


def test_logical_shards_resume_from_two_ranks_on_one(tmp_path):
    """2 ranks read 3 steps, save, 1 rank resumes: every sample of the epoch exactly once."""
    from nxdt.data.logical_shards import LogicalShardSampler, ShardedStreams, merge_tables

    parts = [(ix, np.arange(len(ix))) for ix in (_indexed(tmp_path, "a", 40, 1), _indexed(tmp_path, "b", 24, 2))]
    streams = ShardedStreams(parts, logical_shards=4, seq_length=8, seed=3)
    weights, gbs = [3.0, 1.0], 4
    epoch = {(d, k, j) for d in range(2) for k in range(4) for j in range(int(streams.samples_per_epoch[d, k]))}

    seen = []
    reports = []
    table0 = np.zeros((2, 4), dtype=np.int64)
    for rank in (0, 1):
        sampler = LogicalShardSampler(streams, table0, weights, gbs // 2, rank, 2, num_batches=10)
        batches = list(sampler)  # the loader prefetched all 10 ...
        seen += [key for batch in batches[:3] for key in batch]  # ... but only 3 steps were trained
        reports.append((rank, 2, sampler.consumed_after(3)))
    state = merge_tables(reports, 4)
    assert state.sum() == 3 * gbs

    # dataset b gets 1/4 of the reads: run until its epoch is through (a wraps into later epochs meanwhile)
    steps_left = int(4 * streams.samples_per_epoch[1].sum()) // gbs + 8
    one = LogicalShardSampler(streams, state, weights, gbs, 0, 1, num_batches=steps_left)
    for batch in one:
        seen += [key for key in batch]
    first_epoch = [key for key in seen if key[2] < streams.samples_per_epoch[key[0], key[1]]]
    assert len(first_epoch) == len(set(first_epoch)), "a sample was read twice"
    assert len(set(seen)) == len(seen)
    assert set(first_epoch) == epoch, f"skipped: {sorted(epoch - set(first_epoch))[:5]}"
    # the weights hold overall: about 3:1 between the datasets
    counts = np.bincount([d for d, _, _ in seen], minlength=2)
    assert abs(counts[0] / counts.sum() - 0.75) < 0.02


def test_logical_shard_samples_are_the_shard_stream(tmp_path):
    from nxdt.data.logical_shards import ShardedStreams

    ix = _indexed(tmp_path, "a", 12, 5)
    streams = ShardedStreams([(ix, np.arange(12))], logical_shards=3, seq_length=8, seed=0)
    for k in range(3):
        spe = int(streams.samples_per_epoch[0, k])
        order, _ = streams._epoch(0, k, 0)
        stream = np.concatenate([ix.get(int(d)) for d in order]).astype(np.int64)
        assert sorted(order.tolist()) == list(range(k, 12, 3))
        for j in range(spe):
            assert streams.tokens(0, k, j).tolist() == stream[j * 8 : j * 8 + 9].tolist()
        # epoch 1 is another order of the same documents
        assert streams.tokens(0, k, spe).shape == (9,)


def test_logical_shard_module_state_round_trip(tmp_path):
    _indexed(tmp_path, "a", 60, 1)
    _indexed(tmp_path, "b", 60, 2)
    cfg = base_cfg(datasets=[str(tmp_path / "a"), str(tmp_path / "b")], weights=[1, 1], logical_shards=4)
    cfg.data.splits_string = "90,5,5"
    two = [build_datamodule(build_spec(cfg), fake_trainer(r, 2)) for r in (0, 1)]
    firsts = [list(dm.train_dataloader())[:2] for dm in two]
    for dm in two:
        dm.trainer.lightning_module.consumed_samples = 8  # 2 steps of 4 trained
    states = [dm.state_dict() for dm in two]  # no process group here: each holds its own shards
    from nxdt.data.logical_shards import merge_tables

    merged = merge_tables([(r, 2, np.asarray(s["consumed"])) for r, s in enumerate(states)], 4)
    one = build_datamodule(build_spec(cfg), fake_trainer(0, 1, consumed=8))
    one.load_state_dict({**states[0], "consumed": merged.tolist()})
    nxt = list(one.train_dataloader())
    assert len(nxt) == 2  # max_steps 4, 2 done
    before = {tuple(x.tolist()) for b in firsts for batch in b for x in batch["input_ids"]}
    after = {tuple(x.tolist()) for batch in nxt for x in batch["input_ids"]}
    assert not before & after
    assert len(list(one.val_dataloader())) == 3  # validation from the splits_string ranges, Megatron style
    bad = build_datamodule(build_spec(cfg), fake_trainer(0, 1))
    bad.load_state_dict({**states[0], "logical_shards": 8})
    with pytest.raises(ConfigError, match="data.logical_shards: the checkpoint has 8 logical shards"):
        bad.train_dataloader()
    cfg.data.global_batch_size = 6
    with pytest.raises(ConfigError, match="data.logical_shards: 4 is not a multiple of the data-parallel size 3"):
        build_datamodule(build_spec(cfg), fake_trainer(0, 3)).train_dataloader()
