"""A key/value cache for incremental decoding with the native model (plain PyTorch).

Generating token t+1 needs the keys and values of tokens 0..t in every layer; recomputing them for
the whole sequence at each step costs O(length) forward passes per token. The cache keeps them:
the prompt is run once ("prefill"), then each step runs only the new token and attends to the
cached keys ("decode").

    cache = KVCache(max_length=prompt_len + new_tokens, valid=prompt_mask)  # prompt_mask: [B, P] bool
    logits = model(prompt_ids, position_ids, kv_cache=cache)                   # prefill
    logits = model(next_ids[:, None], next_positions[:, None], kv_cache=cache) # one decode step

Buffers are allocated on the first write of each layer, [B, KV heads, max_length, head_dim] in the
keys' dtype and device: the number of heads is read from the tensors, so a tensor-parallel rank
(which computes only its own heads) caches only those, with no change here. Writes go into the
preallocated buffers (no torch.cat per step, which would copy the whole cache every token).

Batches of prompts of different lengths are padded on the left, so every row's next token lands in
the same column. `valid` says which columns hold real tokens; pad keys are never attended to. A pad
query (whose output is never used) attends to itself only, so no softmax row is empty (an empty row
is NaN, and a NaN value in a pad column would leak into real rows as 0 * NaN through the matmul).

`StaticKVCache` keeps every tensor shape of a decode step fixed (the whole buffer attended to, the
columns not written yet masked, the write column a tensor), so `torch.compile` traces the step once
(nxdt.inference.generate's `compile_decode`).
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(self, max_length: int, valid: torch.Tensor | None = None, batch_size: int | None = None) -> None:
        """`valid`: [B, P] bool of the prompt (True = real token, False = left padding), or None for
        unpadded prompts of `batch_size` rows. Columns past the prompt are generated tokens: valid."""
        if valid is None:
            if batch_size is None:
                raise ValueError("KVCache needs `valid` or `batch_size`")
            valid = torch.ones(batch_size, 0, dtype=torch.bool)
        if valid.shape[1] > max_length:
            raise ValueError(f"prompt length {valid.shape[1]} exceeds the cache's max_length {max_length}")
        self.max_length = int(max_length)
        self.padded = bool((~valid).any())
        self._valid = torch.ones(valid.shape[0], max_length, dtype=torch.bool, device=valid.device)
        self._valid[:, : valid.shape[1]] = valid
        self.length = 0  # columns written so far (the same for every layer once a forward has finished)
        self._keys: dict[int, torch.Tensor] = {}
        self._values: dict[int, torch.Tensor] = {}
        # a decode step's mask is the same for every layer: made once a step (see attention_mask)
        self._decode_valid = self._valid[:, None, None, :] if self.padded else None

    @property
    def batch_size(self) -> int:
        return self._valid.shape[0]

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this forward's k, v [B, KV, S, D] of layer `layer_idx` after the cached columns; returns
        all keys and values so far, [B, KV, length + S, D]."""
        start, end = self.length, self.length + k.shape[2]
        if end > self.max_length:
            raise ValueError(f"KV cache full: {end} tokens > max_length {self.max_length}")
        if layer_idx not in self._keys:
            b, heads, _, d = k.shape
            self._keys[layer_idx] = k.new_empty(b, heads, self.max_length, d)
            self._values[layer_idx] = v.new_empty(b, heads, self.max_length, v.shape[-1])
        keys, values = self._keys[layer_idx], self._values[layer_idx]
        keys[:, :, start:end] = k
        values[:, :, start:end] = v
        return keys[:, :, :end], values[:, :, :end]

    def attention_mask(self, query_length: int, device: torch.device,
                       sliding_window: int | None = None) -> torch.Tensor | None:
        """Boolean mask [B|1, 1, Q, length + Q] (True = may attend) for the next `query_length` tokens;
        None when plain causal attention is exactly right (no padding, no window cutting anything):
        an unpadded prefill of an empty cache (SDPA's square `is_causal`) or an unpadded single-token
        decode step, which sees every key (CoreAttention then runs SDPA with no mask and
        `is_causal=False`; building, and applying, an all-True mask every step would only cost time)."""
        start, end = self.length, self.length + query_length
        window_cuts = sliding_window is not None and sliding_window < end
        if not self.padded and not window_cuts and (start == 0 or query_length == 1):
            return None
        if query_length == 1 and not window_cuts:
            # one new (real) token after the cached ones: it may see every valid column, itself
            # included (what the general rule below gives, in one slice instead of ten operations)
            return self._decode_valid[..., :end].to(device)
        q = torch.arange(start, end, device=device)[:, None]
        k = torch.arange(end, device=device)[None, :]
        mask = k <= q
        if sliding_window is not None:
            mask = mask & (k > q - sliding_window)
        mask = mask[None, None]
        if self.padded:
            mask = mask & self._valid[:, None, None, :end].to(device)
            mask = mask | (k == q)[None, None]  # pad queries attend to themselves only (see module doc)
        return mask

    def advance(self, n: int) -> None:
        """Mark `n` more columns written: called by the model after all its layers ran."""
        self.length += int(n)

    def truncate(self, length: int) -> None:
        """Forget the columns from `length` on (e.g. to re-run a prompt's last token)."""
        self.length = min(self.length, int(length))


class StaticKVCache(KVCache):
    """A KVCache whose decode steps (one token a row) have fixed shapes: each layer's buffers are
    allocated whole and zeroed (a masked column must hold no NaN: see the module doc), a step writes
    its column at `position` (a tensor, set by the caller before the step, not a Python int that a
    compiled step would specialise on) and attends to all max_length columns, those past `position`
    masked. The prefill (several tokens) is the plain KVCache's; the caller then calls
    `start_decoding()` and, before each step, `position.fill_(column)`; `advance` counts nothing
    during decoding (the caller knows the column)."""

    def __init__(self, max_length: int, valid: torch.Tensor | None = None, batch_size: int | None = None) -> None:
        super().__init__(max_length, valid, batch_size)
        self.decoding = False
        self.position = torch.zeros(1, dtype=torch.long, device=self._valid.device)
        self._columns = torch.arange(self.max_length, device=self._valid.device)

    def start_decoding(self) -> None:
        self.decoding = True

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if layer_idx not in self._keys:
            b, heads, _, d = k.shape
            self._keys[layer_idx] = k.new_zeros(b, heads, self.max_length, d)
            self._values[layer_idx] = v.new_zeros(b, heads, self.max_length, v.shape[-1])
        if not self.decoding:
            return super().update(layer_idx, k, v)
        keys, values = self._keys[layer_idx], self._values[layer_idx]
        keys.index_copy_(2, self.position, k)
        values.index_copy_(2, self.position, v)
        return keys, values

    def attention_mask(self, query_length: int, device: torch.device,
                       sliding_window: int | None = None) -> torch.Tensor | None:
        if not self.decoding:
            return super().attention_mask(query_length, device, sliding_window)
        seen = self._columns <= self.position
        if sliding_window is not None:
            seen = seen & (self._columns > self.position - sliding_window)
        return (self._valid & seen)[:, None, None, :].to(device)

    def advance(self, n: int) -> None:
        if not self.decoding:
            super().advance(n)
