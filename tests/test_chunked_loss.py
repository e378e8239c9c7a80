"""The chunked output layer + cross entropy (issue 19, `model.fusions.cross_entropy_chunk_size`):
equal to `F.cross_entropy` on the full logits (values and gradients within 1e-6) both fused (the
gradients computed in forward, backward running no matmul under the training loss's mean) and
recomputed (any other weighting, or a head it cannot fuse); rows whose label is ignored (prompt,
padding) skipping the output layer; bf16 under autocast and with bf16
weights; never saving the whole logits for backward; the same training curve as the full loss, and
its bad input. The FSDP + activation-checkpointing layout with it is in tests/test_parallel_layouts.py
(`fsdp_dp2_ac_chunk2`; with tensor parallelism `tp2_dp2_zero1`, and with sequence parallel
`tp2_sp_selective_ac`: each against one process without it). In-process, a few seconds."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import REPO, TINY_OVERRIDES, read_scalars, train_in_process

from nxdt.config.errors import ConfigError
from nxdt.spec import load_config
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


def _mm_calls_in(fn) -> int:
    """How many matmuls `fn` runs (aten mm / addmm / bmm)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_,
                                       torch.ops.aten.bmm):
                Count.calls += 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return Count.calls


# one token, uneven chunks, exactly all, more than all; the weighting of the per-token losses:
# - "mean": the training loss's (the same weight on every scored token, some labels ignored): the
#   fused head's gradients come from its forward, backward runs no matmul
# - "mask-like": any other weighting: backward recomputes each chunk with its weights
@pytest.mark.parametrize("weighting", ["mean", "mask-like"])
@pytest.mark.parametrize("chunk", [1, 16, 74, 1000])
def test_equal_to_cross_entropy_on_the_full_logits_values_and_gradients(chunk, weighting):
    h, head, labels = _problem()
    if weighting == "mean":
        labels[0, :5] = -100  # e.g. a prompt, or tokens the loss mask leaves out
        weights = (labels != -100).float() / 3.0
    else:
        weights = torch.rand(labels.shape, generator=torch.Generator().manual_seed(1))
    full = F.cross_entropy(head(h).float().flatten(0, 1), labels.flatten(), reduction="none").view(labels.shape)
    (full * weights).sum().backward()
    want = h.grad.clone(), head.weight.grad.clone()
    h.grad, head.weight.grad = None, None
    got = chunked_cross_entropy(h, head, labels, chunk)
    backward_matmuls = _mm_calls_in(lambda: (got * weights).sum().backward())
    assert got.shape == labels.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, full, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(h.grad, want[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(head.weight.grad, want[1], rtol=1e-6, atol=1e-6)
    chunks = -(-labels.numel() // chunk)
    assert backward_matmuls == (0 if weighting == "mean" else 3 * chunks), backward_matmuls


def _logit_rows_in(fn, vocab: int) -> int:
    """How many rows of logits ([n, vocab] matmul outputs) `fn` computes."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Rows(TorchDispatchMode):
        rows = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm) and out.shape[-1] == vocab:
                Rows.rows += out.shape[0]
            return out

    with Rows():
        fn()
    return Rows.rows


@pytest.mark.parametrize("fuse", [True, False])
def test_rows_whose_label_is_ignored_skip_the_output_layer(fuse):
    """Prompt and padding rows (label -100) are not projected: the forward computes logits for the
    scored rows only (27 of 74 here), and the losses (0 on the others) and gradients are the full path's."""
    h, head, labels = _problem()
    labels[0, :30] = -100
    labels[1, 20:] = -100
    scored = int((labels != -100).sum())
    full = F.cross_entropy(head(h).float().flatten(0, 1), labels.flatten(), reduction="none").view(labels.shape)
    full.sum().backward()
    want = h.grad.clone(), head.weight.grad.clone()
    h.grad, head.weight.grad = None, None
    out = {}
    assert _logit_rows_in(lambda: out.update(got=chunked_cross_entropy(h, head, labels, 16, fuse=fuse)), 1000) == scored
    out["got"].sum().backward()
    torch.testing.assert_close(out["got"], full, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(h.grad, want[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(head.weight.grad, want[1], rtol=1e-6, atol=1e-6)
    assert float(h.grad[0, :30].abs().sum()) == 0.0


@pytest.mark.parametrize("preset", ["autocast", "bf16 weights"])
def test_fused_head_in_bf16_matches_the_module_call(preset):
    """Under autocast (an fp32 weight, bf16 matmuls) and with bf16 weights (mixed_precision's copies),
    the fused head computes what `head(h)` would, in the same dtypes: the losses and gradients of the
    full bf16 logits, to bf16's rounding of the products; the gradients come back in the operands' dtypes."""
    h, head, labels = _problem(tokens=24, vocab=300)
    if preset == "bf16 weights":
        head = head.to(torch.bfloat16)
        h = h.detach().to(torch.bfloat16).requires_grad_()
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=preset == "autocast")
    with autocast:
        full = F.cross_entropy(head(h).float().flatten(0, 1), labels.flatten(), reduction="none").view(labels.shape)
    full.mean().backward()
    want = h.grad.clone(), head.weight.grad.clone()
    h.grad, head.weight.grad = None, None
    with autocast:
        got = chunked_cross_entropy(h, head, labels, 16)
    got.mean().backward()
    assert h.grad.dtype == h.dtype and head.weight.grad.dtype == head.weight.dtype
    torch.testing.assert_close(got, full, rtol=0, atol=1e-5)  # the same bf16 logits, softmax in fp32
    # gradients: the fused head rounds softmax - onehot to bf16 for its matmuls, as autograd does
    # with the logits' gradient, and sums the weight's in fp32 (autograd: one bf16 matmul)
    torch.testing.assert_close(h.grad.float(), want[0].float(), rtol=2e-2, atol=2e-4)
    torch.testing.assert_close(head.weight.grad.float(), want[1].float(), rtol=2e-2, atol=2e-4)


@pytest.mark.parametrize("bias", [False, True])  # the fused head; a head with bias recomputes its chunks
def test_backward_keeps_no_whole_logits(bias):
    """What autograd saves for backward beyond the hidden states and the head's weight (which exist
    anyway): the full path keeps the [tokens, vocab] logits (and more); the fused bias-free head keeps
    the hidden states' gradient and the weight's (fp32), the recomputing one nothing but a chunk's ids."""
    def saved_bytes(fn, exclude) -> int:
        total = 0
        kept = {t.untyped_storage().data_ptr() for t in exclude}

        def pack(t):
            nonlocal total
            if t.untyped_storage().data_ptr() not in kept:
                total += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn().sum().backward()
        return total

    h, head, labels = _problem(tokens=256, vocab=4000)
    if bias:
        head.bias = torch.nn.Parameter(torch.zeros(4000))
    exclude = [h, *head.parameters()]
    logits_bytes = 2 * 256 * 4000 * 4
    full = saved_bytes(lambda: F.cross_entropy(head(h).float().flatten(0, 1), labels.flatten(), reduction="none"),
                       exclude)
    chunked = saved_bytes(lambda: chunked_cross_entropy(h, head, labels, 64), exclude)
    grads = 0 if bias else h.numel() * 4 + head.weight.numel() * 4  # the fused head's gradients, from forward
    assert full >= logits_bytes
    assert chunked < logits_bytes / 20 + grads, (chunked, logits_bytes)
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
    (["model.fusions.cross_entropy_chunk_size=512", "+model_alignment_strategy.orpo.beta=0.1"],
     "model.fusions.cross_entropy_chunk_size with ORPO"),
    (["model.fusions.cross_entropy_chunk_size=512", "+model_alignment_strategy.dpo.kl_beta=0.1",
      "distributed_strategy.tensor_model_parallel_size=2"], "model.fusions.cross_entropy_chunk_size with DPO and"),
])
def test_bad_chunk_sizes_and_layouts_are_one_line(overrides, says):
    with pytest.raises(ConfigError) as err:
        load_config(["--config-path", CONF, "--config-name", "tiny_llama_cpu", *overrides], check_paths=False, quiet=True)
    assert says in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_memory_benchmark_measures_the_fused_head_below_the_whole_logits(capsys, monkeypatch):
    """benchmarks/memory.py --logits on a small head (in-process): the peak column it prints is lower
    for both chunked ways than for the whole logits, and the fused head's largest logits tensor is
    one chunk's (128 of 512 tokens)."""
    import argparse
    import sys

    monkeypatch.setenv("NXDT_CPU_PEAK_CACHE", "")  # no probe results written from a test
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import memory
    finally:
        sys.path.pop(0)
    memory.logits_memory(argparse.Namespace(vocab=3000, hidden=48, tokens=512, chunk=128))
    rows = {}
    for line in capsys.readouterr().out.splitlines():
        if line.startswith(("full logits", "chunks of 128")):
            name, cols = line[:28].strip(), line[28:].split()
            rows[name] = (float(cols[0].replace(",", "")), float(cols[2].replace(",", "")))  # MiB, MiB
    full, fused, recomputed = rows["full logits"], rows["chunks of 128, fused"], rows["chunks of 128, recomputed"]
    assert full[0] == pytest.approx(512 * 3000 * 4 / 2**20, abs=0.05)
    assert fused[0] == pytest.approx(full[0] / 4, abs=0.05)
    assert fused[1] < full[1] and recomputed[1] < full[1], rows
