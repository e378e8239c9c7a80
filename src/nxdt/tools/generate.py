"""`nxdt generate`: text from a checkpoint of any training layout.

    nxdt generate --checkpoint CKPT --prompt "And God said" [--max-new-tokens 64] [--temperature 0.8]
                  [--top-k 50] [--top-p 1.0] [--seed 1234] [--stream]
    nxdt generate --checkpoint CKPT --prompt-file prompts.txt [--output out.jsonl]
    torchrun --nproc_per_node 2 -m nxdt.cli generate --checkpoint CKPT --prompt "..."   (tensor parallel)

The model, its tokenizer and its context length come from the checkpoint's config.yaml; LoRA
adapters are merged (nxdt.inference.load). A prompt file holds one prompt per line (or JSON lines
with a "prompt" key); its prompts are padded on the left and generated together. Temperature 0 is
greedy decoding. Under torchrun the model is split over the ranks with tensor parallelism (each
rank reads only its shards) and rank 0 prints.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

import torch

from nxdt.checkpoint.checkpointer import validate_checkpoint
from nxdt.checkpoint.locate import is_hf_folder, resolve_checkpoint
from nxdt.config.errors import ConfigError
from nxdt.device import accelerator_type
from nxdt.inference.generate import SamplingParams, generate
from nxdt.inference.load import load_for_inference, tensor_parallel_group
from nxdt.spec.exp import sampling_problem

DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "fp16": "float16"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nxdt generate", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, type=Path,
                   help="a checkpoint, a run folder (its newest complete checkpoint) or a transformers model folder")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="the text to continue")
    src.add_argument("--prompt-file", type=Path, help="one prompt per line, or JSON lines with a 'prompt' key")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate per prompt (default 64)")
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default 0.8)")
    p.add_argument("--top-k", type=int, default=50, help="sample among the k most likely tokens; 0 = all (default 50)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, in (0, 1] (default 1.0 = off)")
    p.add_argument("--seed", type=int, default=1234, help="sampling seed (default 1234)")
    p.add_argument("--stream", action="store_true", help="print the text as it is generated (one prompt)")
    p.add_argument("--output", type=Path, help="also write JSON lines {prompt, completion, tokens} here")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the tokenizer's end-of-sequence token")
    p.add_argument("--no-cache", action="store_true", help="recompute the whole sequence each step (slow; for checks)")
    p.add_argument("--tokenizer", type=Path, help="a tokenizer directory (default: the run's data.tokenizer)")
    p.add_argument("--base", type=Path, metavar="CKPT",
                   help="LoRA adapter-only checkpoint: the base weights (default: the run's resume_from_checkpoint)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="compute dtype (default float32)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: cuda if available, else cpu)")
    return p


def check_args(args: argparse.Namespace) -> None:
    problem = sampling_problem(args.max_new_tokens, args.temperature, args.top_k, args.top_p)
    if problem:  # "top_p must be ..." -> "--top-p must be ..."
        name, rule = problem.split(" ", 1)
        raise ConfigError(f"--{name.replace('_', '-')} {rule}")
    if args.output is not None and args.output.exists():
        raise ConfigError(f"--output {args.output} exists (nothing is overwritten)")


def read_prompts(args: argparse.Namespace) -> list[str]:
    if args.prompt is not None:
        if not args.prompt:
            raise ConfigError("--prompt is empty")
        return [args.prompt]
    path = args.prompt_file
    if not path.is_file():
        raise ConfigError(f"--prompt-file {path}: no such file")
    prompts = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            try:
                row = json.loads(line)
            except ValueError as err:
                raise ConfigError(f"--prompt-file {path}:{n}: not JSON ({err})") from None
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                raise ConfigError(f"--prompt-file {path}:{n}: a JSON line needs a string 'prompt'")
            line = row["prompt"]
        prompts.append(line)
    if not prompts:
        raise ConfigError(f"--prompt-file {path}: no prompts")
    return prompts


def encode(tokenizer, prompts: list[str], context: int, max_new: int, where: str) -> tuple[list[list[int]], int]:
    """Token ids of each prompt (the tokenizer's own special tokens, e.g. BOS, included) and the number
    of new tokens that fits the context."""
    ids = [tokenizer(p)["input_ids"] for p in prompts]
    longest = max(len(i) for i in ids)
    if min(len(i) for i in ids) == 0:
        raise ConfigError(f"{where}: a prompt encodes to no tokens")
    if longest >= context:
        n = max(range(len(ids)), key=lambda i: len(ids[i]))
        which = "the prompt" if len(ids) == 1 else f"prompt {n + 1}"
        raise ConfigError(f"{where}: {which} is {longest} tokens, longer than the model's context of {context} "
                          "tokens (leave room for at least one new token)")
    return ids, min(max_new, context - longest)


def main(argv: list[str] | None = None) -> int:
    # transformers' notice that its models will take `cache=` one day: nothing for the user to do
    warnings.filterwarnings("ignore", message=r".*`past_key_values` is deprecated", category=FutureWarning)
    args = build_parser().parse_args(argv)
    check_args(args)
    prompts = read_prompts(args)
    args.checkpoint, chosen = resolve_checkpoint(args.checkpoint)  # a run folder: its newest complete checkpoint
    if not is_hf_folder(args.checkpoint):
        validate_checkpoint(args.checkpoint)  # one line, before any process group starts
    rank, tp_mesh = tensor_parallel_group()
    if chosen and rank == 0:
        print(f"note: {chosen}", file=sys.stderr)
    device = args.device or accelerator_type() or "cpu"
    if tp_mesh is not None:
        device = tp_mesh.device_type if device == "cpu" or tp_mesh.device_type == "cpu" else device
    t0 = time.perf_counter()
    loaded = load_for_inference(args.checkpoint, device=device, dtype=getattr(torch, DTYPES[args.dtype]),
                                tokenizer_dir=args.tokenizer, base=args.base, tp_mesh=tp_mesh)
    tok = loaded.tokenizer
    where = "--prompt" if args.prompt is not None else f"--prompt-file {args.prompt_file}"
    ids, max_new = encode(tok, prompts, loaded.context_length, args.max_new_tokens, where)
    say = (lambda *a, **k: print(*a, **k)) if rank == 0 else (lambda *a, **k: None)
    for note in loaded.notes:
        say(f"note: {note}", file=sys.stderr)
    if max_new < args.max_new_tokens:
        say(f"note: {max_new} new tokens (not {args.max_new_tokens}): the context is {loaded.context_length} tokens",
            file=sys.stderr)
    say(f"loaded {args.checkpoint} in {time.perf_counter() - t0:.1f}s"
        + (f" (tensor parallel over {tp_mesh.size()} ranks)" if tp_mesh is not None else ""), file=sys.stderr)
    pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    params = SamplingParams(max_new_tokens=max_new, temperature=args.temperature, top_k=args.top_k or None,
                            top_p=args.top_p, seed=args.seed, vocab_size=loaded.vocab_size,
                            eos_token_id=None if args.ignore_eos else tok.eos_token_id)
    streamer = Streamer(tok, say) if args.stream and len(prompts) == 1 and rank == 0 else None
    if streamer is not None:
        say(prompts[0], end="", flush=True)
    t1 = time.perf_counter()
    outputs = generate(loaded.model, ids, params, pad_id=pad, use_cache=not args.no_cache,
                       on_step=streamer.step if streamer else None)
    seconds = time.perf_counter() - t1
    texts = [tok.decode(o, skip_special_tokens=True) for o in outputs]
    if streamer is not None:
        say(flush=True)
    else:
        for i, (prompt, text) in enumerate(zip(prompts, texts)):
            say(("" if len(prompts) == 1 else f"--- [{i + 1}]\n") + prompt + text, flush=True)
    new = sum(len(o) for o in outputs)
    say(f"{new} tokens in {seconds:.2f}s ({new / max(seconds, 1e-9):.1f} tokens/s)", file=sys.stderr)
    if args.output is not None and rank == 0:
        with open(args.output, "x", encoding="utf-8") as f:
            for prompt, text, o in zip(prompts, texts, outputs):
                f.write(json.dumps({"prompt": prompt, "completion": text, "tokens": o}) + "\n")
    return 0


class Streamer:
    """Prints the new text after each token. Decoding the whole completion each time (not token by
    token) keeps characters that span several byte-level tokens intact."""

    def __init__(self, tokenizer, say) -> None:
        self.tokenizer, self.say = tokenizer, say
        self.tokens: list[int] = []
        self.printed = ""

    def step(self, tokens) -> None:
        token = int(tokens[0])
        if token < 0:
            return
        self.tokens.append(token)
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # an incomplete character: wait for its next byte
            return
        self.say(text[len(self.printed):], end="", flush=True)
        self.printed = text


if __name__ == "__main__":
    sys.exit(main())
