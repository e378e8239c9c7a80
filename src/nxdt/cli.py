"""The `nxdt` console script: one sub-command per tool.

Each sub-command lives in its own module and exposes `main(argv) -> int`; this file only dispatches,
so `nxdt --help` stays fast (nothing heavy is imported until a sub-command runs).
"""

from __future__ import annotations

import difflib
import importlib
import sys
import time

# name -> (module, one-line help)
COMMANDS = {
    "train": ("nxdt.tools.train", "train from an NxDT-shaped YAML (same arguments as examples/train.py)"),
    "preprocess": ("nxdt.tools.preprocess", "tokenize jsonl/json/text into Megatron .bin/.idx files"),
    "convert": ("nxdt.tools.convert", "hf-to-nxdt / nxdt-to-hf / nxd-to-nxdt: convert checkpoints (safetensors, DCP, NxDT's)"),
    "moe-split": ("nxdt.tools.moe_split", "experts from a dense Llama checkpoint (LLaMA-MoE's expert split)"),
    "plan": ("nxdt.tools.plan", "parameters, memory per rank and tokens per step of a config, without training"),
    "import-config": ("nxdt.tools.import_config", "an nxdt YAML from GPT-NeoX config files (neox FILE.yml ... --output)"),
    "preference-data": ("nxdt.tools.preference_data", "DPO/ORPO rows (prompt, chosen, rejected) from the KJV"),
    "evaluate": ("nxdt.tools.evaluate", "loss and perplexity of a checkpoint on the validation and test splits"),
    "generate": ("nxdt.tools.generate", "text from a checkpoint of any layout (KV cache, sampling, tensor parallel)"),
    "report": ("nxdt.tools.report", "plots and a summary of runs; with several, the largest gap (--assert-equal TOL)"),
}


def _usage() -> str:
    lines = ["usage: nxdt <command> [args...]", "", "commands:"]
    lines += [f"  {name:<16} {help_}" for name, (_, help_) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        close = difflib.get_close_matches(name, COMMANDS, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        print(f"error: unknown command '{name}'{hint}\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    # the dispatcher stays light: nxdt.config (omegaconf, Hydra) only once a command is chosen
    from nxdt.config.errors import ConfigError
    from nxdt.config.load import RANK_ZERO_GRACE_S, error_text, full_error_requested, is_rank_zero

    try:
        return int(module.main(rest) or 0)
    except ConfigError as err:
        if full_error_requested():
            raise
        if is_rank_zero():  # under torchrun (`-m nxdt.cli`), every rank finds it: rank 0 says it
            print(f"error: {error_text(err)}", file=sys.stderr, flush=True)
        else:  # torchrun stops every rank when one exits: give rank 0 a moment to say why
            time.sleep(RANK_ZERO_GRACE_S)
        return 2


if __name__ == "__main__":
    sys.exit(main())
