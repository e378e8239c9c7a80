"""nxdt's model behind lm-evaluation-harness's LM interface (`lm_eval.api.model.TemplateLM`).

    lm = NxdtLM(load_for_inference(ckpt), batch_size=8)
    lm_eval.simple_evaluate(model=lm, tasks=["hellaswag"])

The harness asks three things, answered here the way its own transformers model (`HFLM`) answers
them, so a checkpoint scores what its `nxdt convert nxdt-to-hf` export scores there:
- `loglikelihood`: per (context, continuation) the continuation's summed log-probability and whether
  greedy decoding would produce it (the harness tokenizes; `_loglikelihood_tokens` scores batches of
  right-padded rows, the longest first);
- `loglikelihood_rolling`: a whole document in windows of the model's context, each token predicted
  once (the harness's own window split);
- `generate_until`: greedy decoding with nxdt's generation loop (KV cache, left-padded batches), up to
  max_gen_toks new tokens, cut at the first stop string; a batch stops once every row has one.

Only this module imports lm_eval (the optional extra `nxdt[eval]`); nxdt.inference.harness imports
it when `nxdt evaluate --tasks` runs. Under tensor parallelism every rank runs every request (the
logits come back whole on each rank), so to the harness each rank is a one-process model.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from nxdt.config.errors import ConfigError
from nxdt.inference.generate import SamplingParams, generate
from nxdt.inference.load import InferenceModel
from nxdt.models.builder import logits_of

DEFAULT_MAX_GEN_TOKS = 256  # HFLM's


class _AllStopped(Exception):
    """Every row of a generate_until batch holds a stop string: the loop ends early."""


class NxdtLM(TemplateLM):
    backend = "causal"

    def __init__(self, loaded: InferenceModel, batch_size: int = 8, max_gen_toks: int = DEFAULT_MAX_GEN_TOKS) -> None:
        super().__init__()
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.batch_size = max(1, int(batch_size))
        self.max_gen_toks = int(max_gen_toks)
        self._device = next(self.model.parameters()).device
        tok = self.tokenizer
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)

    # ------------------------------------------------------------------ tokens
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        """The token a document without context is scored after: BOS, else EOS (as HFLM)."""
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self.loaded.context_length

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tokenizer, "name_or_path", "nxdt")).replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        """The tokenizer's own special tokens unless told; none added to a string that starts with the
        prefix token's text already (HFLM's rule)."""
        options = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        if add_special_tokens is None and string.startswith(self.tokenizer.decode(self.prefix_token_id)):
            options = {"add_special_tokens": False}
        return self.tokenizer.encode(string, **options)

    def tok_decode(self, tokens: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    # ------------------------------------------------------------------ scoring
    @torch.no_grad()
    def _forward(self, rows: list[list[int]]) -> torch.Tensor:
        """Log-probabilities [B, T, V] (fp32) of right-padded rows: causal attention keeps each row's
        real tokens blind to the padding after them."""
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, :len(r)] = torch.tensor(r, dtype=torch.long)
        logits = logits_of(self.model(input_ids=ids.to(self._device)))
        full = getattr(logits, "full_tensor", None)  # tensor parallel: a vocabulary-sharded DTensor
        logits = full() if full is not None else logits
        return F.log_softmax(logits.float(), dim=-1)

    def _loglikelihood_tokens(self, requests: list[tuple[Any, list[int], list[int]]], disable_tqdm: bool = False,
                              **kwargs: Any) -> list[tuple[float, bool]]:
        """(summed log-prob, is-greedy) of each continuation; a row longer than the context loses
        tokens on the left, as in HFLM."""
        order = sorted(range(len(requests)), key=lambda i: -len(requests[i][1]) - len(requests[i][2]))
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        for start in range(0, len(order), self.batch_size):
            batch = order[start:start + self.batch_size]
            rows = [(requests[i][1] + requests[i][2])[-(self.max_length + 1):][:-1] for i in batch]
            logprobs = self._forward(rows)
            for i, row, lp in zip(batch, rows, logprobs):
                key, _, cont = requests[i]
                scored = lp[len(row) - len(cont):len(row)]
                want = torch.tensor(cont, dtype=torch.long, device=scored.device)
                greedy = bool((scored.argmax(-1) == want).all())
                answer = (float(scored.gather(1, want[:, None]).sum()), greedy)
                results[i] = answer
                if key is not None:
                    self.cache_hook.add_partial("loglikelihood", key, answer)
        return results  # type: ignore[return-value]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owner = [], []
        for n, (string,) in enumerate(req.args for req in requests):
            split = get_rolling_token_windows(token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                                              max_seq_len=self.max_length, context_len=1)
            for context, cont in map(make_disjoint_window, split):
                windows.append((None, context, cont))
                owner.append(n)
        totals = [0.0] * len(requests)
        for n, (logprob, _) in zip(owner, self._loglikelihood_tokens(windows)):
            totals[n] += logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # ------------------------------------------------------------------ generation
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations, cut at the first stop string (the harness adds the EOS text to them)."""
        groups: dict[str, list[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault(json.dumps(req.args[1], sort_keys=True, default=str), []).append(i)
        out: list[str] = [""] * len(requests)
        eos_text = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        for members in groups.values():
            kwargs = normalize_gen_kwargs(requests[members[0]].args[1], self.max_gen_toks)
            if kwargs.get("do_sample"):
                raise ConfigError("a task asks for sampled generation (do_sample: true): nxdt's harness model "
                                  "decodes greedily")
            until = handle_stop_sequences(kwargs.get("until"), eos=eos_text)
            max_new = int(kwargs["max_gen_toks"])
            if max_new >= self.max_length:
                raise ConfigError(f"a task asks for {max_new} new tokens: the model's context is {self.max_length}")
            # an empty context starts from the prefix token (BOS, else EOS), as a scored one does
            prompts = {i: self.tok_encode(requests[i].args[0])[-(self.max_length - max_new):] or [self.prefix_token_id]
                       for i in members}
            members = sorted(members, key=lambda i: -len(prompts[i]))
            for start in range(0, len(members), self.batch_size):
                batch = members[start:start + self.batch_size]
                for i, text in zip(batch, self._greedy([prompts[i] for i in batch], max_new, until)):
                    out[i] = postprocess_generated_text(text, until, None)
                    self.cache_hook.add_partial("generate_until", requests[i].args, out[i])
        return out

    def _greedy(self, prompts: list[list[int]], max_new: int, until: list[str]) -> list[str]:
        """The decoded new text of each prompt; stops early once every row's text holds a stop string."""
        tokens: list[list[int]] = [[] for _ in prompts]
        stopped = [False] * len(prompts)

        def on_step(step: torch.Tensor) -> None:
            for row, t in enumerate(step.tolist()):
                if t < 0:  # the row ended with EOS
                    stopped[row] = True
                    continue
                tokens[row].append(t)
                text = self.tok_decode(tokens[row], skip_special_tokens=False)
                stopped[row] = stopped[row] or any(s and s in text for s in until)
            if all(stopped):
                raise _AllStopped

        params = SamplingParams(max_new_tokens=max_new, eos_token_id=self.eot_token_id,
                                vocab_size=self.loaded.vocab_size)
        try:
            generate(self.model, prompts, params, pad_id=self.pad_id, on_step=on_step)
        except _AllStopped:
            pass
        return [self.tok_decode(t) for t in tokens]
