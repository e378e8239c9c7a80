"""The chunked output layer + cross entropy (issue 19, `model.fusions.cross_entropy_chunk_size`):
equal to `F.cross_entropy` on the full logits (values and gradients within 1e-6), never saving
the whole logits for backward, the same training curve as the full loss, and its bad input.
The FSDP + activation-checkpointing layout with it is in tests/test_parallel_layouts.py
(`fsdp_dp2_ac_chunk2`; with tensor parallelism `tp2_dp2_zero1`, and with sequence parallel
`tp2_sp_selective_ac`: each against one process without it). In-process, a few seconds."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import REPO, TINY_OVERRIDES, read_scalars, train_in_process

from nxdt.config.errors import ConfigError
from nxdt.config.load import load_config
from nxdt.models.chunked_loss import chunked_cross_entropy

CONF = str(REPO / "conf")


def _problem(tokens: int = 37, hidden: int = 64, vocab: int = 1000):
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(2, tokens, hidden, generator=gen, requires_grad=True)
    head = torch.nn.Linear(hidden, vocab, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, hidden, generator=gen) * 0.1)
    labels = torch.randint(0, vocab, (2, tokens), generator=gen)
    return h, head, labels


@pytest.mark.parametrize("chunk", [1, 16, 74, 1000])  # one token, uneven chunks, exactly all, more than all
def test_equal_to_cross_entropy_on_the_full_logits_values_and_gradients(chunk):
    h, head, labels = _problem()
    full = F.cross_entropy(head(h).float().flatten(0, 1), labels.flatten(), reduction="none").view(labels.shape)
    weights = torch.rand(labels.shape, generator=torch.Generator().manual_seed(1))  # a loss mask-like weighting
    (full * weights).sum().backward()
    want = h.grad.clone(), head.weight.grad.clone()
    h.grad, head.weight.grad = None, None
    got = chunked_cross_entropy(h, head, labels, chunk)
    (got * weights).sum().backward()
    assert got.shape == labels.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, full, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(h.grad, want[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(head.weight.grad, want[1], rtol=1e-6, atol=1e-6)


def test_backward_keeps_no_whole_logits():
    """What autograd saves for backward: the full path keeps the [tokens, vocab] logits (and more);
    the chunked one keeps the hidden states and one chunk at a time is recomputed."""
    def saved_bytes(fn) -> int:
        total = 0

        def pack(t):
            nonlocal total
            total += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn().sum().backward()
        return total

    h, head, labels = _problem(tokens=256, vocab=4000)
    logits_bytes = 2 * 256 * 4000 * 4
    full = saved_bytes(lambda: F.cross_entropy(head(h).float().flatten(0, 1), labels.flatten(), reduction="none"))
    chunked = saved_bytes(lambda: chunked_cross_entropy(h, head, labels, 64))
    assert full >= logits_bytes
    assert chunked < logits_bytes / 20, (chunked, logits_bytes)
    print(f"saved for backward: full {full / 2**20:.1f} MiB, chunked {chunked / 2**20:.2f} MiB")


def test_a_run_with_it_logs_the_full_losses_curve(kjv_prefix, tmp_path):
    """Five steps with 16-token chunks (each micro-batch of 2 x 32 tokens in four chunks) against the
    full logits: the same loss at every step within 1e-6 (matmul rounding by row block)."""
    def losses(name, *extra):
        result = train_in_process(["--config-name", "tiny_llama_cpu", *TINY_OVERRIDES, "trainer.devices=1",
                                   "trainer.max_steps=5", "model.optim.lr=1e-2", "model.optim.sched.warmup_steps=1",
                                   f"data.data_prefix=[1.0,{kjv_prefix}]", f"exp_manager.explicit_log_dir={tmp_path / name}",
                                   *extra])
        assert result.rc == 0, result.err[-3000:]
        return [v for _, v in sorted(read_scalars(tmp_path / name)["reduced_train_loss"].items())]

    full, chunked = losses("full"), losses("chunked", "model.fusions.cross_entropy_chunk_size=16")
    assert len(full) == 5 and full[-1] < full[0]
    assert chunked == pytest.approx(full, rel=1e-6)


@pytest.mark.parametrize(("overrides", "says"), [
    (["model.fusions.cross_entropy_chunk_size=0"], "model.fusions.cross_entropy_chunk_size"),
    (["model.fusions.cross_entropy_chunk_size=-4"], "model.fusions.cross_entropy_chunk_size"),
    (["model.fusions.cross_entropy_chunk_size=512", "distributed_strategy.pipeline_model_parallel_size=2",
      "trainer.devices=2"], "model.fusions.cross_entropy_chunk_size with distributed_strategy.pipeline_model_parallel_size"),
])
def test_bad_chunk_sizes_and_layouts_are_one_line(overrides, says):
    with pytest.raises(ConfigError) as err:
        load_config(["--config-path", CONF, "--config-name", "tiny_llama_cpu", *overrides], check_paths=False, quiet=True)
    assert says in str(err.value) and "\n" not in str(err.value), str(err.value)
