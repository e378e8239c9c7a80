"""Pipeline parallel: stage splitting and the one-line errors for bad pipeline input.

The end-to-end parity of every pipeline layout (1F1B, interleaved, ZBV, uneven cuts, tp x pp,
fp16) with one process is in tests/test_parallel_layouts.py, beside the other layouts.
"""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_OVERRIDES, run_cli_here

from nxdt.config.errors import ConfigError
from nxdt.spec import config_from_dict
from nxdt.spec.parallel import pipeline_stage_starts
from nxdt.spec import build_spec


# --------------------------------------------------------------------------- in-process units
def test_even_split_and_nxd_cuts():
    assert pipeline_stage_starts(8, 4) == [0, 2, 4, 6, 8]
    # a cut names the last layer of a stage (NxD's create_partition: 32 layers, pp 4 -> 7, 15, 23)
    assert pipeline_stage_starts(32, 4, ["model.layers.7", "model.layers.15", "model.layers.23"]) == [0, 8, 16, 24, 32]
    assert pipeline_stage_starts(4, 2, ["model.layers.0"]) == [0, 1, 4]
    # uneven: as NxD's create_partitions, the extra layers on the later stages
    assert pipeline_stage_starts(4, 3) == [0, 1, 2, 4]
    with pytest.raises(ConfigError, match=r"model.num_layers \(2\) is fewer than the 3 pipeline stages"):
        pipeline_stage_starts(2, 3)
    with pytest.raises(ConfigError, match=r"no module 'model.layers.9'.*model.layers.0 \.\.\. model.layers.2"):
        pipeline_stage_starts(4, 2, ["model.layers.9"])
    with pytest.raises(ConfigError, match=r"has 2 entries; 2 pipeline stages .* need 1"):
        pipeline_stage_starts(4, 2, ["model.layers.0", "model.layers.1"])
    with pytest.raises(ConfigError, match="increasing"):
        pipeline_stage_starts(8, 3, ["model.layers.4", "model.layers.2"])


@pytest.mark.parametrize("source", ["megatron", "hf"])
def test_plan_gives_each_stage_the_styles_of_its_own_layers(source):
    """tp2 x pp2 + sequence parallel: each stage's plan names its layers by their index in the whole
    model (what a pruned stage holds), the sequence-parallel edges at the stage boundary, and the
    ranks' stages; a stage part finds its own stage in the plan."""
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, PrepareModuleOutput

    from nxdt.models import build_model
    from nxdt.parallel.pipeline import prune_to_stage
    from nxdt.parallel.plan import make_plan
    from nxdt.spec.layout import Layout

    ds = {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2, "sequence_parallel": True}
    if source == "megatron":
        model_keys = {"num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "ffn_hidden_size": 176}
    else:
        model_keys = {"model_config": "model_configs/tiny_llama", "num_layers": 4, "hidden_size": 64}
    cfg = config_from_dict({"model_source": source, "model": model_keys, "distributed_strategy": ds})
    model = build_model(cfg, 512, device="meta")
    plan = make_plan(model, build_spec(cfg, layout=Layout(tp=2, pp=2)))
    assert plan.stage_starts == (0, 2, 4) and plan.rank_stages == ((0,), (1,)) and plan.schedule == "1F1B"
    first, last = (stage.tensor_parallel for stage in plan.stages)
    assert "model.embed_tokens" in first and "lm_head" not in first and "model.norm" not in first
    assert isinstance(last["model.layers.2.self_attn.q_proj"], ColwiseParallel) and "lm_head" in last
    assert not any(path.startswith(("model.layers.0", "model.layers.1")) for path in last)
    assert isinstance(first["model.layers.1"], PrepareModuleOutput)  # whole hidden states to the next stage
    assert isinstance(last["model.layers.2"], PrepareModuleInput)  # ... taken whole by its first block
    part = prune_to_stage(model, range(2, 4), False, True)
    assert plan.stage_for(part) is plan.stages[1]
    assert set(last) <= {name for name, _ in part.named_modules()}
    assert plan.stage_of("model.layers.3.mlp.up_proj.weight") == 1 and plan.stage_of("lm_head.weight") == 1
    assert plan.stage_of("model.embed_tokens.weight") == 0


# Block types (nxdt.models.llama.LlamaDecoderLayer) with the position embeddings that go with them:
# post_ln's final norm is an Identity; learned positions are an embedding of stage 0; none has none.
BLOCKS = {
    "pre_ln": {},
    "post_ln": {"transformer_block_type": "post_ln", "position_embedding_type": "learned_absolute"},
    "normformer": {"transformer_block_type": "normformer", "normalization": "layernorm",
                   "position_embedding_type": "none"},
    "gpt_j_tied": {"transformer_block_type": "gpt_j"},
    "neox": {"transformer_block_type": "gpt_j", "gpt_j_tied": False, "normalization": "layernorm",
             "activation": "gelu", "has_bias": True, "rotary_percentage": 0.25, "num_kv_heads": 4},
}


@pytest.mark.parametrize("source, block", [*(("megatron", b) for b in BLOCKS), ("hf", "pre_ln")])
def test_stages_chained_equal_the_whole_model_and_keep_names(source, block):
    """Pruned stages run one after another give the whole model's logits, with its parameter names,
    for every block type."""
    from nxdt.models import build_model, logits_of
    from nxdt.parallel.pipeline import prune_to_stage

    torch.manual_seed(0)
    if source == "megatron":
        cfg = config_from_dict({"model_source": "megatron", "model": {
            "num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "num_kv_heads": 2, "ffn_hidden_size": 176,
            **BLOCKS[block]}})
    else:
        cfg = config_from_dict({"model_source": "hf", "model": {"model_config": "model_configs/tiny_llama",
                                                                "num_layers": 4, "hidden_size": 64}})
    model = build_model(cfg, 512)
    ids = torch.randint(0, 500, (2, 12))
    pos = torch.arange(12)[None].expand(2, 12)
    expected = logits_of(model(input_ids=ids, position_ids=pos))

    ranges = [range(0, 1), range(1, 3), range(3, 4)]
    parts = [prune_to_stage(model, r, i == 0, i == 2) for i, r in enumerate(ranges)]
    x = ids
    for part in parts:
        x = part(x, position_ids=pos)
    torch.testing.assert_close(x, expected, rtol=0, atol=0)

    whole = dict(model.named_parameters())
    names = [n for part in parts for n, _ in part.named_parameters()]
    assert sorted(names) == sorted(whole), "stages must hold every parameter once, under its original name"
    assert any(n.startswith("model.layers.2.") for n, _ in parts[1].named_parameters())
    assert {n.split(".")[0] + "." + n.split(".")[1] for n, _ in parts[0].named_parameters()} >= {"model.embed_tokens"}
    assert any(n.startswith("lm_head") for n, _ in parts[2].named_parameters())
    assert not any(n.startswith(("lm_head", "model.norm")) for n, _ in parts[0].named_parameters())
    if block == "post_ln":  # the Identity final norm belongs to the last stage; learned positions to the first
        assert parts[0].model.norm is None and type(parts[2].model.norm).__name__ == "Identity"
        assert [n for n, _ in parts[0].named_parameters() if "embed_positions" in n] == ["model.embed_positions.weight"]
        assert not any("embed_positions" in n for part in parts[1:] for n, _ in part.named_parameters())


# --------------------------------------------------------------------------- bad input (torch-free, cheap: in this process)
def _bad(kjv_prefix, tmp_path, *extra):
    proc = run_cli_here(["--config-name", "tiny_llama_cpu", *TINY_OVERRIDES, "trainer.devices=2",
                         f"data.data_prefix=[1.0,{kjv_prefix}]", f"exp_manager.explicit_log_dir={tmp_path}", *extra])
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    return proc.returncode, lines


def test_bad_pipeline_input_is_one_clear_line(kjv_prefix, tmp_path):
    pp2 = "distributed_strategy.pipeline_model_parallel_size=2"
    rc, lines = _bad(kjv_prefix, tmp_path, pp2, "model.num_layers=1")
    assert rc == 2 and len(lines) == 1, lines
    assert "model.num_layers (1) is fewer than the 2 pipeline stages" in lines[0]

    rc, lines = _bad(kjv_prefix, tmp_path, pp2, "distributed_strategy.virtual_pipeline_model_parallel_size=2",
                     "model.num_layers=3")
    assert rc == 2 and len(lines) == 1 and "fewer than the 4 pipeline stages" in lines[0], lines

    rc, lines = _bad(kjv_prefix, tmp_path, pp2, "model.pipeline_cuts=[model.layers.7]")
    assert rc == 2 and len(lines) == 1, lines
    assert "no module 'model.layers.7'" in lines[0] and "model.layers.0 ... model.layers.0" in lines[0]

    rc, lines = _bad(kjv_prefix, tmp_path, pp2, "distributed_strategy.schedule=OneFOneB")
    assert rc == 2 and len(lines) == 1 and "Interleaved1F1B" in lines[0] and "ZBVZeroBubble" in lines[0], lines

    # 1F1B needs at least pp microbatches: gbs 8 / (mbs 8 x dp 1) = 1 < 2
    rc, lines = _bad(kjv_prefix, tmp_path, pp2, "data.micro_batch_size=8")
    assert rc == 2 and len(lines) == 1 and "needs at least 2 microbatches" in lines[0], lines
