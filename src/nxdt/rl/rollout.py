"""Rollouts, colocated: a step's prompts sampled num_generations times by nxdt's generator on the
policy being trained, in the layout it trains in, then scored and turned into training rows.

The step's completions are numbered j = 0 .. N-1 (N = prompts × G; completion j answers prompt
j // G, sample j % G). Data-parallel rank r samples j in [r L, (r + 1) L), L = N / dp, each row
with its own torch.Generator seeded from (seed, step, prompt row, sample) (`sample_seed`), every
prompt left-padded to the width of the step's longest: a completion depends neither on the layout
nor on the number of ranks. All ranks decode every step to max_completion_length (a sharded model's
ranks forward in step). Rewards are computed where the completions are, gathered over the
data-parallel ranks (groups may span ranks), and the advantages computed on the whole batch, as
TRL does. Under tensor parallelism every tp rank runs the same loop on its shards (the logits
gathered for sampling, the same draws on each) and the log-probs take the softmax across the
vocabulary shards (`loss_parallel`).

A training row is   prompt | completion   right-padded to the step's longest (`row_width`: the same
on every rank and layout, at most data.seq_length); position t predicts
token t + 1, and `mask` is 1 where that token is a completion token (EOS included; 0 for a
truncated completion with mask_truncated_completions). Log-probs are those of
logits / temperature, as TRL scores them; the generator's own (`gen_logps`, same positions) equal a
training forward's (fp32: within 1e-6; tests/test_grpo.py).

The reference (beta > 0): with LoRA the base with the adapters off (no second model); without,
`ReferenceWeights` keeps a copy of the starting parameters (this rank's shards) and swaps it in
for the reference forward.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule

from nxdt.inference.generate import SamplingParams, generate
from nxdt.models import logits_of
from nxdt.parallel.tensor_parallel import is_vocab_parallel, loss_parallel
from nxdt.rl.grpo_loss import group_advantages, total_rewards
from nxdt.rl.rewards import RewardFn, call_rewards

Gather = Callable[[torch.Tensor], torch.Tensor]  # [L, ...] on each dp rank -> [N, ...] in rank order


def sample_seed(seed: int, step: int, row: int, sample: int) -> int:
    """The generator seed of one completion: a fixed mix of its coordinates (63 bits)."""
    x = (int(seed) & 0xFFFFFFFF) * 0x9E3779B1
    for part in (step, row, sample):
        x = ((x ^ (int(part) + 0x7F4A7C15)) * 0xBF58476D1CE4E5B9) & 0x7FFFFFFFFFFFFFFF
    return x


def token_logps(logits: torch.Tensor, labels: torch.Tensor, temperature: float) -> torch.Tensor:
    """[B, S] fp32 log p(label) of logits [B, S, V] / temperature (the generator's formula).
    Vocabulary-sharded logits (tensor parallel): the softmax across the shards, under
    `loss_parallel()` (here and around the backward); a plain tensor comes back."""
    scaled = logits.float() / temperature
    if is_vocab_parallel(scaled):
        per_token = -F.cross_entropy(scaled.flatten(0, 1), labels.flatten(), reduction="none")
        return per_token.full_tensor().view(labels.shape)
    return scaled.log_softmax(-1).gather(-1, labels[..., None])[..., 0]


def token_entropy(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """[B, S] entropy of softmax(logits / temperature), no gradient (sharded logits gathered)."""
    with torch.no_grad():
        full = getattr(logits, "full_tensor", None)
        logp = ((full() if full is not None else logits).float() / temperature).log_softmax(-1)
        return -(logp.exp() * logp).sum(-1)


@dataclass
class Rollout:
    """This rank's share of one step's completions, ready to train on (see the module docstring)."""

    input_ids: torch.Tensor  # [L, S]
    labels: torch.Tensor  # [L, S]
    mask: torch.Tensor  # [L, S] float
    gen_logps: torch.Tensor  # [L, S] the generator's log-probs at the completion positions (0 elsewhere)
    advantages: torch.Tensor  # [L]
    rewards: torch.Tensor  # [N, F] of the whole step (NaN: no opinion)
    total: torch.Tensor  # [N]
    lengths: torch.Tensor  # [N] completion tokens
    truncated: torch.Tensor  # [N] bool: no EOS within max_completion_length
    tokens_per_rank: float  # completion tokens counted by the loss over the step / dp ranks (dapo)
    prompts: list = field(default_factory=list)  # this rank's L prompts and completions, for the log
    completions: list = field(default_factory=list)
    old_logps: torch.Tensor | None = None
    ref_logps: torch.Tensor | None = None
    seconds: float = 0.0
    generated_tokens: int = 0


def rollout_state(r: Rollout) -> dict:
    """A Rollout as checkpoint state (CPU tensors, floats, lists: nxdt.checkpoint's per-rank JSON)."""
    return {f.name: (v.detach().cpu() if isinstance(v, torch.Tensor) else v)
            for f in fields(Rollout) for v in [getattr(r, f.name)]}


def rollout_from_state(state: dict, device) -> Rollout:
    """`rollout_state`'s inverse, its tensors on `device` (the per-rank rows) or the CPU (the step's stats)."""
    local = {"input_ids", "labels", "mask", "gen_logps", "advantages", "old_logps", "ref_logps"}
    return Rollout(**{k: (v.to(device) if k in local and isinstance(v, torch.Tensor) else v)
                      for k, v in state.items()})


@dataclass
class RolloutOptions:
    num_generations: int
    max_completion_length: int
    temperature: float
    top_p: float
    top_k: int
    seq_length: int
    scale_rewards: str
    mask_truncated: bool
    reward_weights: list[float]
    eos_token_id: int | list[int] | None
    pad_id: int
    vocab_size: int | None
    seed: int
    tp: int = 1  # tensor-parallel ranks: logits vocabulary-sharded (log-probs under loss_parallel)
    length_multiple: int = 1  # sequence parallel: forwards of whole multiples of tp (recomputed, no cache)
    compile_decode: bool = False  # the decode step torch.compile'd over a static cache (nxdt.inference.generate)


def row_width(prompt_lengths: list[int], lengths: torch.Tensor, opts: RolloutOptions) -> int:
    """The columns of the step's training rows: its longest prompt + completion - 1 (every rank and
    layout computes it from the whole step), a multiple of length_multiple, at most data.seq_length.
    The padding beyond it would cost forward/backward time and change no real position's log-prob."""
    longest = max(p + int(n) for p, n in zip(prompt_lengths, lengths.tolist())) - 1
    multiple = max(opts.length_multiple, 1)
    return min(-(-longest // multiple) * multiple, opts.seq_length)


def _training_rows(prompt_ids: list[list[int]], completions: list[list[int]], gen_logps: list[list[float]],
                   truncated: list[bool], opts: RolloutOptions, device, width: int) -> tuple[torch.Tensor, ...]:
    n, s = len(prompt_ids), width
    input_ids = torch.full((n, s), opts.pad_id, dtype=torch.long)
    labels = torch.full((n, s), opts.pad_id, dtype=torch.long)
    mask = torch.zeros(n, s)
    logps = torch.zeros(n, s)
    for i, (p, c, lp) in enumerate(zip(prompt_ids, completions, gen_logps)):
        seq = torch.tensor(p + c, dtype=torch.long)
        if len(seq) - 1 > s:
            raise ValueError(f"prompt ({len(p)}) + completion ({len(c)}) tokens exceed data.seq_length + 1 ({s + 1})")
        input_ids[i, : len(seq) - 1] = seq[:-1]
        labels[i, : len(seq) - 1] = seq[1:]
        start = len(p) - 1
        logps[i, start:start + len(c)] = torch.tensor(lp, dtype=torch.float32)
        if not (opts.mask_truncated and truncated[i]):
            mask[i, start:start + len(c)] = 1.0
    return input_ids.to(device), labels.to(device), mask.to(device), logps.to(device)


def rollout(model: nn.Module, rows: list, step: int, opts: RolloutOptions, reward_funcs: list[RewardFn], *,
            tokenizer, dp_rank: int = 0, dp_size: int = 1, gather: Gather | None = None,
            autocast: Callable[[], contextlib.AbstractContextManager] | None = None,
            row_ids: list[int] | None = None) -> Rollout:
    """Sample, score and lay out this rank's share of the step's completions. `rows`: the step's
    prompts (nxdt.data.prompts.PromptRow, the same list on every rank), `row_ids` their dataset
    rows (the seeds; default 0..P-1); `gather` joins [L, ...] tensors of the dp ranks."""
    g = opts.num_generations
    n = len(rows) * g
    if n % dp_size:
        raise ValueError(f"{n} completions do not split over {dp_size} data-parallel ranks")
    local = n // dp_size
    mine = range(dp_rank * local, (dp_rank + 1) * local)
    row_ids = list(range(len(rows))) if row_ids is None else list(row_ids)
    prompt_ids = [rows[j // g].ids for j in mine]
    generators = [torch.Generator().manual_seed(sample_seed(opts.seed, step, row_ids[j // g], j % g)) for j in mine]
    params = SamplingParams(max_new_tokens=opts.max_completion_length, temperature=opts.temperature,
                            top_k=opts.top_k or None, top_p=opts.top_p, eos_token_id=opts.eos_token_id,
                            vocab_size=opts.vocab_size)
    start = time.perf_counter()
    gen_logps: list[list[float]] = []
    was_training = model.training
    model.eval()
    try:
        with autocast() if autocast is not None else contextlib.nullcontext():
            completions = generate(model, prompt_ids, params, pad_id=opts.pad_id, generators=generators,
                                   logps=gen_logps, all_steps=True, length_multiple=opts.length_multiple,
                                   prompt_width=max(len(r.ids) for r in rows), compile_decode=opts.compile_decode)
    finally:
        model.train(was_training)
    seconds = time.perf_counter() - start
    eos = opts.eos_token_id
    eos_set = set([eos] if isinstance(eos, int) else list(eos or []))
    truncated = [not (c and c[-1] in eos_set) for c in completions]
    texts = [tokenizer.decode(c, skip_special_tokens=True) for c in completions]
    prompts = [rows[j // g].prompt for j in mine]
    columns: dict[str, list] = {}
    for key in rows[0].columns:
        columns[key] = [rows[j // g].columns.get(key) for j in mine]
    per_func = torch.tensor(call_rewards(reward_funcs, prompts, texts, completions, columns),
                            dtype=torch.float32).T.reshape(local, len(reward_funcs))
    lengths = torch.tensor([len(c) for c in completions], dtype=torch.float32)
    trunc = torch.tensor(truncated, dtype=torch.float32)
    local_stats = torch.cat([per_func, lengths[:, None], trunc[:, None]], dim=1)
    everything = gather(local_stats) if gather is not None and dp_size > 1 else local_stats
    per_func_all = everything[:, : len(reward_funcs)]
    total = total_rewards(per_func_all, torch.tensor(opts.reward_weights, dtype=torch.float32))
    advantages = group_advantages(total, g, opts.scale_rewards)
    device = next(model.parameters()).device
    width = row_width([len(rows[j // g].ids) for j in range(n)], everything[:, -2], opts)
    input_ids, labels, mask, logps = _training_rows(prompt_ids, completions, gen_logps, truncated, opts, device,
                                                    width)
    counted = everything[:, -2] * (1 - everything[:, -1]) if opts.mask_truncated else everything[:, -2]
    return Rollout(input_ids, labels, mask, logps, advantages[mine.start:mine.stop].to(device), per_func_all,
                   total, everything[:, -2], everything[:, -1].bool(), float(counted.sum()) / dp_size,
                   prompts=prompts, completions=texts, seconds=seconds, generated_tokens=int(lengths.sum()))


def loss_parallel_if(tp: int) -> contextlib.AbstractContextManager:
    """`loss_parallel()` under tensor parallelism (tp > 1), else nothing."""
    return loss_parallel() if tp > 1 else contextlib.nullcontext()


@torch.no_grad()
def forward_logps(model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor, temperature: float, *,
                  micro_batch_size: int, autocast: Callable[[], contextlib.AbstractContextManager] | None = None,
                  tp: int = 1) -> torch.Tensor:
    """[L, S] log-probs of `labels` under `model` (no gradient), `micro_batch_size` rows a forward:
    the old policy's (num_iterations > 1) or the reference's (inside its context)."""
    out = []
    for ids, lab in zip(input_ids.split(micro_batch_size), labels.split(micro_batch_size)):
        with autocast() if autocast is not None else contextlib.nullcontext():
            logits = logits_of(model(input_ids=ids, position_ids=None))
        with loss_parallel_if(tp):
            out.append(token_logps(logits, lab, temperature))
    return torch.cat(out)


def _local(p: torch.Tensor) -> torch.Tensor:
    """A parameter's own storage: a DTensor's local shard, else the tensor."""
    to_local = getattr(p, "to_local", None)
    return (to_local() if to_local is not None else p).detach()


def _reshard(model: nn.Module) -> None:
    """FSDP2 (and its replicate) modules dropped back to their shards: a root module stays gathered
    after its forward, and its next forward would use those copies instead of the shards written here."""
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def _sharded_parameters(model: nn.Module) -> list[torch.Tensor]:
    """This rank's parameter storage (resharded first: an unsharded module's parameters are copies)."""
    _reshard(model)
    return [_local(p) for p in model.parameters()]


class ReferenceWeights:
    """The starting parameters kept aside (this rank's shards), swapped in for the reference forward:
    GRPO's reference without LoRA. `with ref.swapped(model): ...`."""

    def __init__(self, model: nn.Module):
        self.saved = [p.clone() for p in _sharded_parameters(model)]

    @contextlib.contextmanager
    def swapped(self, model: nn.Module):
        params = _sharded_parameters(model)
        with torch.no_grad():
            current = [p.detach().clone() for p in params]
            for p, ref in zip(params, self.saved):
                p.copy_(ref)
        try:
            yield model
        finally:
            _reshard(model)  # the reference's gathered copies gone: the next forward gathers these
            with torch.no_grad():
                for p, cur in zip(params, current):
                    p.copy_(cur)
