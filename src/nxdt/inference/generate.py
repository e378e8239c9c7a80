"""The generation loop: prompts in, token ids out, for either model source.

    outputs = generate(model, [[1, 5, 9], [1, 7]], SamplingParams(max_new_tokens=32))

Prompts of different lengths are padded on the left and decoded together (every row's next token
lands in the same column). With the KV cache (default) the prompt runs once and each step runs the
new token only; `use_cache=False` recomputes the whole sequence at every step (the baseline the
cache is measured and tested against). Sampling follows transformers' order: temperature, then
top-k, then top-p; temperature 0 is greedy (argmax). `compile_decode=True` runs the decode step
torch.compile'd over a static cache (fixed shapes); off by default: on a CPU it gains 0-13% after a
compile of seconds (docs/performance.md).

A model sharded with tensor parallelism (nxdt.parallel) runs this same loop on every rank: its
logits come back as a vocabulary-sharded DTensor, gathered here, so every rank samples the same
token from the same seeded generator.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from nxdt.models.adapter import adapter_of
from nxdt.models.kv_cache import StaticKVCache
from nxdt.spec.exp import sampling_problem


@dataclass
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 0.0
    """0 = greedy; otherwise logits are divided by it before sampling."""
    top_k: int | None = None
    """Keep the k most likely tokens (None or 0: all)."""
    top_p: float | None = None
    """Keep the smallest set of tokens whose probabilities sum to at least top_p, in (0, 1] (None: all)."""
    seed: int | None = None
    eos_token_id: int | list[int] | None = None
    """A row stops after emitting one of these (its later columns are padding)."""
    vocab_size: int | None = None
    """Tokens at or above it are never sampled (the rows Megatron-style vocabulary padding added)."""

    def __post_init__(self) -> None:
        problem = sampling_problem(self.max_new_tokens, self.temperature, self.top_k, self.top_p)
        if problem:
            raise ValueError(problem)


# --------------------------------------------------------------------------- sampling
def filter_logits(logits: torch.Tensor, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """Logits [B, V] with the tokens outside top-k / top-p set to -inf (transformers' warpers' rules)."""
    if top_k:
        k = min(int(top_k), logits.shape[-1])
        kth = torch.topk(logits, k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=False, dim=-1)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop = cumulative <= 1 - top_p  # the low tail whose mass is at most 1 - top_p
        drop[..., -1:] = False  # the most likely token always stays
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


def next_tokens(logits: torch.Tensor, params: SamplingParams,
                generator: torch.Generator | list[torch.Generator] | None,
                uniforms: torch.Tensor | None = None) -> torch.Tensor:
    """[B] token ids from the last position's logits [B, V] (fp32). `generator`: one for the batch,
    or one per row (each row's draws then depend on its own generator only); `uniforms` [B] float64:
    the per-row generators' draws for this step, already made (`generate` draws a row's whole
    sequence at once: the same numbers as one draw a step)."""
    logits = logits.float()
    if params.vocab_size is not None and params.vocab_size < logits.shape[-1]:
        logits[:, params.vocab_size:] = float("-inf")
    if params.temperature == 0:
        return logits.argmax(-1)
    logits = filter_logits(logits / params.temperature, params.top_k, params.top_p)
    probs = logits.softmax(-1).cpu()
    # sample on CPU: the same stream of draws on every device kind and every tensor-parallel rank
    if uniforms is not None or isinstance(generator, (list, tuple)):
        # one uniform draw per row from its own generator, then the inverse CDF of the whole batch at
        # once: the smallest token whose cumulative probability exceeds u x total (never a token of
        # probability 0). torch.multinomial row by row cost 140 us a row at a vocabulary of 8,192.
        u = uniforms if uniforms is not None else torch.cat(
            [torch.rand(1, generator=g, dtype=torch.float64) for g in generator])
        cdf = probs.double().cumsum(-1)
        drawn = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
        return drawn.clamp(max=probs.shape[-1] - 1).to(logits.device)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1).to(logits.device)


def sampled_logps(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """[B] fp32 log-probabilities of `tokens` under logits [B, V] / temperature (before top-k / top-p,
    as TRL scores a sample): what a training forward of the same sequence gives."""
    scaled = logits.float() / (temperature if temperature > 0 else 1.0)
    return scaled.log_softmax(-1).gather(-1, tokens[:, None].to(scaled.device))[:, 0]


def _full(logits: torch.Tensor) -> torch.Tensor:
    """Plain logits: a tensor-parallel model's are a vocabulary-sharded DTensor."""
    full = getattr(logits, "full_tensor", None)
    return full() if full is not None else logits


# --------------------------------------------------------------------------- the loop
def left_pad(prompts: list[list[int]], pad_id: int, device: torch.device | str,
             width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [B, P], valid [B, P]) with each prompt right-aligned (P: the longest prompt, or `width`)."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    width = max(max(len(p) for p in prompts), width or 0)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    valid = torch.zeros(len(prompts), width, dtype=torch.bool)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p, dtype=torch.long)
        valid[row, width - len(p):] = True
    return ids.to(device), valid.to(device)


@torch.no_grad()
def generate(model: nn.Module, prompts: list[list[int]], params: SamplingParams, *, pad_id: int = 0,
             use_cache: bool = True, on_step: Callable[[torch.Tensor], None] | None = None,
             length_multiple: int = 1, generators: list[torch.Generator] | None = None,
             logps: list[list[float]] | None = None, all_steps: bool = False,
             prompt_width: int | None = None, compile_decode: bool = False) -> list[list[int]]:
    """The new tokens of each prompt (up to max_new_tokens; a row ends after an EOS token, which is
    kept). `on_step(tokens [B])` is called after each step (for streaming); finished rows give -1.

    For online RL (nxdt.rl.rollout): `generators`, one per row, replace `params.seed` (each row's
    samples then depend on its own seed, not on the rows beside it; each row's max_new_tokens
    uniforms are drawn at the start, the numbers one draw a step would give); `logps`, an empty
    list, receives per row the log-probability of each returned token (`sampled_logps`);
    `all_steps` runs all max_new_tokens forwards even when every row has ended (ranks of a sharded
    model forward in step); `prompt_width` left-pads every prompt to at least that many columns.

    `compile_decode`: the decode step (one token a row) runs `torch.compile`d over a
    `StaticKVCache` of fixed shapes (its length rounded up to a multiple of STATIC_BUCKET, so
    calls of nearby lengths share one compiled graph). Only for the native model unsharded (a
    transformers model or a tensor-parallel one decodes eagerly). The first call of each shape
    compiles (seconds to a minute on a CPU); docs/performance.md says when it pays.

    `length_multiple` > 1: every forward runs a sequence whose length is a multiple of it (a model
    with sequence parallelism splits the sequence over its tensor-parallel ranks). The whole sequence
    is then recomputed each step, padded on the right: causal attention keeps the real tokens blind to
    those pads, so their logits are unchanged."""
    device = next(model.parameters()).device
    ids, valid = left_pad(prompts, pad_id, device, prompt_width)
    batch = ids.shape[0]
    positions = (valid.long().cumsum(-1) - 1).clamp(min=0)
    generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
    uniforms = None
    if generators is not None:
        if len(generators) != len(prompts):
            raise ValueError(f"generate: {len(generators)} generators for {len(prompts)} prompts")
        generator = list(generators)
        if params.temperature > 0:
            uniforms = torch.stack([torch.rand(params.max_new_tokens, generator=g, dtype=torch.float64)
                                    for g in generator])
    steps = _steps(model, ids, valid, positions, params.max_new_tokens, pad_id, use_cache and length_multiple <= 1,
                   length_multiple, compile_decode)
    token_logps = []
    eos = params.eos_token_id
    eos = torch.tensor([eos] if isinstance(eos, int) else list(eos or []), dtype=torch.long, device=device)
    out = torch.full((batch, params.max_new_tokens), pad_id, dtype=torch.long, device=device)
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    token = None
    for step in range(params.max_new_tokens):
        last = steps.first() if step == 0 else steps.next(token)
        # next_tokens masks the padded vocabulary rows in place (fp32 logits): the log-probs are the
        # unmasked ones, as a training forward computes them
        token = next_tokens(last.clone() if logps is not None else last, params, generator,
                            None if uniforms is None else uniforms[:, step])
        if logps is not None:
            token_logps.append(sampled_logps(last, token, params.temperature))
        token = token.masked_fill(done, pad_id)
        out[:, step] = token
        if on_step is not None:
            on_step(token.masked_fill(done, -1))
        done = done | torch.isin(token, eos)
        if not all_steps and bool(done.all()):
            out = out[:, : step + 1]
            break
    results = []
    eos_ids = set(eos.tolist())
    for row in range(batch):
        tokens = out[row].tolist()
        hit = next((i for i, t in enumerate(tokens) if t in eos_ids), None)
        results.append(tokens[: hit + 1] if hit is not None else tokens)
    if logps is not None:
        table = torch.stack(token_logps, dim=1).cpu() if token_logps else torch.zeros(batch, 0)
        logps.extend(table[row, : len(results[row])].tolist() for row in range(batch))
    return results


# --------------------------------------------------------------------------- the forwards of a step
STATIC_BUCKET = 64
"""compile_decode: the static cache's length is rounded up to a multiple of this many columns."""


def _steps(model: nn.Module, ids, valid, positions, new_tokens: int, pad_id: int, use_cache: bool,
           multiple: int, compile_decode: bool):
    """The forwards of one generation: `first()` the prompt's, `next(token [B])` each step's, each
    giving the last position's logits [B, V]."""
    decoder = adapter_of(model).generation_decoder(model)  # native: nxdt's KVCache; hf: its DynamicCache
    total = ids.shape[1] + new_tokens
    if not use_cache:
        return _Recompute(decoder, ids, valid, positions, pad_id, multiple)
    if compile_decode and adapter_of(model).name == "native" and not any(
            isinstance(p, DTensor) for p in model.parameters()):
        return _CompiledCached(model, ids, valid, positions, -(-total // STATIC_BUCKET) * STATIC_BUCKET)
    return _Cached(decoder, ids, positions, decoder.start(valid, total))


class _Cached:
    """The KV cache: the prompt runs once, then each step the new token only."""

    def __init__(self, decoder, ids: torch.Tensor, positions: torch.Tensor, state) -> None:
        self.decoder, self.ids, self.positions, self.state = decoder, ids, positions, state
        self.position = positions[:, -1:]  # [B, 1] the position of the last token fed

    def first(self) -> torch.Tensor:
        return _full(self.decoder(self.ids, self.positions, self.state))[:, -1]

    def next(self, token: torch.Tensor) -> torch.Tensor:
        self.position = self.position + 1
        return _full(self.decoder(token[:, None], self.position, self.state))[:, -1]


def _decode_step(model: nn.Module, ids: torch.Tensor, positions: torch.Tensor, cache: StaticKVCache) -> torch.Tensor:
    return model(ids, positions, kv_cache=cache)[:, -1]


_COMPILED: list = []  # the torch.compile'd _decode_step, made on first use (one per process)


def compiled_decode_step() -> Callable:
    """`_decode_step` under torch.compile (static shapes; one graph per batch size, cache length and
    padding, compiled on its first call)."""
    if not _COMPILED:
        _COMPILED.append(torch.compile(_decode_step, dynamic=False))
    return _COMPILED[0]


class _CompiledCached(_Cached):
    """compile_decode: the prompt eagerly into a StaticKVCache, then each step compiled."""

    def __init__(self, model: nn.Module, ids: torch.Tensor, valid: torch.Tensor, positions: torch.Tensor,
                 length: int) -> None:
        super().__init__(None, ids, positions, StaticKVCache(length, valid))
        self.model, self.column = model, ids.shape[1]

    def first(self) -> torch.Tensor:
        logits = self.model(self.ids, self.positions, kv_cache=self.state)[:, -1]
        self.state.start_decoding()
        return logits

    def next(self, token: torch.Tensor) -> torch.Tensor:
        self.position = self.position + 1
        self.state.position.fill_(self.column)
        self.column += 1
        return compiled_decode_step()(self.model, token[:, None], self.position, self.state)


class _Recompute:
    """No cache: the whole sequence recomputed each step (right-padded to a multiple of `multiple`)."""

    def __init__(self, decoder, ids: torch.Tensor, valid: torch.Tensor, positions: torch.Tensor, pad_id: int,
                 multiple: int) -> None:
        self.decoder, self.seq, self.valid, self.positions = decoder, ids, valid, positions
        self.pad_id, self.multiple = pad_id, multiple

    def first(self) -> torch.Tensor:
        logits = _recompute(self.decoder, self.seq, self.valid, self.positions, self.pad_id, self.multiple)
        return _full(logits)[:, self.seq.shape[1] - 1]

    def next(self, token: torch.Tensor) -> torch.Tensor:
        self.seq = torch.cat([self.seq, token[:, None]], dim=1)
        self.valid = torch.cat([self.valid, torch.ones_like(token, dtype=torch.bool)[:, None]], dim=1)
        self.positions = torch.cat([self.positions, self.positions[:, -1:] + 1], dim=1)
        return self.first()


def _recompute(decoder, ids: torch.Tensor, valid: torch.Tensor, positions: torch.Tensor, pad_id: int,
               multiple: int) -> torch.Tensor:
    """Logits of the whole sequence, right-padded to a multiple of `multiple` columns."""
    extra = (-ids.shape[1]) % max(1, multiple)
    if extra:
        ids = torch.cat([ids, ids.new_full((ids.shape[0], extra), pad_id)], dim=1)
        valid = torch.cat([valid, valid.new_zeros(valid.shape[0], extra)], dim=1)
        steps = torch.arange(1, extra + 1, device=positions.device)
        positions = torch.cat([positions, positions[:, -1:] + steps], dim=1)
    return decoder(ids, positions, decoder.start(valid, ids.shape[1]))
