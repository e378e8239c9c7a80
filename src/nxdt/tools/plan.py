"""`nxdt plan`: what a config will cost per rank, without training and without a process group.

    nxdt plan --config-path conf --config-name hf_llama3_70B_config [key=value ...] [--json]

Parameters (exact, on the meta device), memory per rank and model FLOPs per token and per step:
what they count and how is nxdt.training.estimate (docs/plan.md has every formula).

Model FLOPs per token (6 x the multiplied parameters + causal attention, nxdt.models.flops) and
per step (x tokens per step), the figures the run's `tflops` / `mfu` use. The estimate itself is
nxdt.training.estimate; the run's start summary prints the same figures, the batch lines too:
global batch size, tokens per step (#tokens/batch), max_steps (set by trainer.max_tokens when
given) and the tokens the run trains (max_steps x tokens per step).

Vocabulary of a megatron-source model: `model.vocab_size` when set; else the tokenizer's size
when it is on this machine; else a known size by tokenizer kind (GPT2BPETokenizer 50,257;
otherwise the Llama-2 SentencePiece tokenizer, 32,000), reported as assumed. Either way the
builder pads it as training would (make_vocab_size_divisible_by x tp).
"""

from __future__ import annotations

import json
import sys
from typing import Any

from nxdt.config.errors import ConfigError
from nxdt.training.estimate import batch_lines, flops_line, memory_line, plan


def format_plan(p: dict[str, Any]) -> str:
    from nxdt.models.param_count import ParameterCount, activated_lines

    lay, mem = p["layout"], p["memory_per_rank_bytes"]
    counts = ParameterCount(total=p["parameters"], activated=p["parameters_activated"], **p["parameter_breakdown"])
    lines = [
        f"plan for '{p['config']}'  model_source={p['model_source']}  precision={p['precision']}",
        f"  layout       world={p['world_size']}  dp={lay['dp']} (replicate {lay['dp_replicate']} x shard "
        f"{lay['dp_shard']})  tp={lay['tp']}  pp={lay['pp']}  vpp={lay['vpp']}  cp={lay['cp']}"
        + (f"  ep={lay['ep']}" if lay["ep"] > 1 else ""),
        f"  parameters   {p['parameters']:,} total  {p['parameters_per_rank']:,} on the fullest rank"
        f"  (vocab {p['vocab_size']:,}, {p['vocab_source']})",
        *activated_lines(counts),
    ]
    if lay["pp"] > 1:
        lines.append(f"  stages       {p['pipeline_schedule']}: " + ", ".join(f"{n:,}" for n in p["parameters_per_stage"]))
    lines += [
        f"  sharding     {p['sharding']}   activation checkpointing: {p['activations_checkpoint'] or 'off'}",
        memory_line(mem),
        flops_line(p),
        # the start summary's lines: global batch, tokens per step, max_steps and the tokens in all
        *batch_lines(p["global_batch_size"], p["micro_batch_size"], p["num_microbatches"], p["seq_length"],
                     p["max_steps"], p["max_tokens"]),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from nxdt.config.load import load_config
    from nxdt.training.run import REPO_CONF_DIR

    argv = list(sys.argv[1:] if argv is None else argv)
    as_json = "--json" in argv
    argv = [a for a in argv if a != "--json"]
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    cfg = load_config(argv, check_paths=False, check_supported=False, default_config_dir=REPO_CONF_DIR, quiet=True)
    try:
        result = plan(cfg)
    except (ValueError, FileNotFoundError) as err:
        raise ConfigError(str(err)) from None
    print(json.dumps(result) if as_json else format_plan(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
