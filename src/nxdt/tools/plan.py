"""`nxdt plan`: what a config will cost per rank, without training and without a process group.

    nxdt plan --config-path conf --config-name hf_llama3_70B_config [key=value ...] [--json]

The config is checked as `nxdt train` checks it before it starts (`check_as_training`: the same
functions; a plan that prints means the run will start), except the paths it names: the plan looks
only at the config.json it reads, and lists the keys of the others in a `not checked` line.

Parameters (exact, on the meta device), memory per rank and model FLOPs per token and per step:
what they count and how is nxdt.planner.estimate (docs/plan.md has every formula).

Model FLOPs per token (6 x the multiplied parameters + causal attention, nxdt.models.flops) and
per step (x tokens per step), the figures the run's `tflops` / `mfu` use. The estimate itself is
nxdt.planner.estimate; the run's start summary prints the same figures, the batch lines too:
global batch size, tokens per step (#tokens/batch), max_steps (set by trainer.max_tokens when
given) and the tokens the run trains (max_steps x tokens per step).

The peak: `trainer.peak_tflops` when set, else this machine's device (a GPU's published figure, or
the CPU's measured matmul peak in the preset's compute dtype, cached), and the step time it
allows (the step's model FLOPs per device at that peak: the bound at 100% MFU). A bf16/fp16
preset on a CPU that runs it slower than fp32 gets the run's one-line notice too.

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
from nxdt.device import use_xla
from nxdt.hardware import device_peak, local_device_type, low_precision_notice
from nxdt.models.param_count import ParameterCount, activated_lines
from nxdt.parallel import xla_spmd
from nxdt.observability.user_callbacks import build_user_callbacks
from nxdt.planner.estimate import batch_lines, flops_line, memory_line, peak_lines, plan, stage_lines
from nxdt.spec import build_spec, load_config
from nxdt.spec.parallel import pipeline_stage_starts
from nxdt.spec.paths import check_files
from nxdt.tools.train import REPO_CONF_DIR
from nxdt.training.evaluate import check_evaluable
from nxdt.training.trainer import check_run, check_run_parts

# the files the plan reads itself (the model's config.json), checked as a run checks them
PLAN_READS = ("model.model_config",)


def plan_peak(spec):
    """trainer.peak_tflops, else this machine's device peak (nxdt.hardware); None if unknown.
    `spec`: the run spec (nxdt.spec.RunSpec)."""
    t = spec.cfg.trainer
    device = local_device_type(t.accelerator)
    if device is None and not t.peak_tflops:
        return None
    return device_peak(device or "cpu", spec.precision.compute_dtype, t.peak_tflops, t.lnc)


def layers_per_stage(spec) -> list[int] | None:
    """Decoder layers of each pipeline stage (model.pipeline_cuts, else NxD's split); None without pp."""
    lay, cuts = spec.layout, spec.cfg.model.pipeline_cuts
    if lay.pp == 1 or spec.model.num_layers is None:
        return None
    starts = pipeline_stage_starts(int(spec.model.num_layers), lay.pp * lay.vpp, list(cuts) if cuts else None)
    return [b - a for a, b in zip(starts, starts[1:])]


def _layers_line(p: dict[str, Any]) -> list[str]:
    """'  layers/stage 15 x 2, 16 x 6': runs of equal stages, in stage order."""
    per = p.get("layers_per_stage")
    if not per:
        return []
    runs: list[list[int]] = []
    for n in per:
        if runs and runs[-1][0] == n:
            runs[-1][1] += 1
        else:
            runs.append([n, 1])
    return ["  layers/stage " + ", ".join(f"{n} x {k}" if k > 1 else f"{n}" for n, k in runs)]


def format_plan(p: dict[str, Any], peak=None) -> str:
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
    lines += [
        *stage_lines(p),
        *_layers_line(p),
        f"  sharding     {p['sharding']}   activation checkpointing: {p['activations_checkpoint'] or 'off'}",
        memory_line(mem),
        *xla_lines(p),
        flops_line(p),
        # the start summary's lines: global batch, tokens per step, max_steps and the tokens in all
        *batch_lines(p["global_batch_size"], p["micro_batch_size"], p["num_microbatches"], p["seq_length"],
                     p["max_steps"], p["max_tokens"]),
        *not_checked_lines(p.get("not_checked")),
        *peak_lines(p, peak, p["world_size"]),
    ]
    return "\n".join(lines)


def xla_lines(p: dict[str, Any]) -> list[str]:
    """Several XLA devices: one SPMD process drives them; the memory line is per device."""
    mesh = p.get("xla_spmd_mesh")
    if not mesh:
        return []
    return [f"  xla          one SPMD process per host over {p['world_size']} devices, mesh (dp, ep, tp) = "
            f"({', '.join(map(str, mesh))}): memory/rank above is per device (the plan's shardings)"]


def not_checked_lines(keys: list[str] | None) -> list[str]:
    """The keys whose paths the plan did not look at (`check_as_training`), in one line."""
    return [f"  not checked  the paths of {', '.join(keys)} (nxdt train checks them before it starts)"] if keys else []


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    as_json = "--json" in argv
    argv = [a for a in argv if a != "--json"]
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    spec, not_checked = check_as_training(argv)
    try:
        result = plan(spec)
    except (ValueError, FileNotFoundError) as err:
        raise ConfigError(str(err)) from None
    result["layers_per_stage"] = layers_per_stage(spec)
    if use_xla(spec.cfg) and xla_spmd.is_spmd(spec.layout):  # the same plan, as shardings (docs/xla.md)
        result["xla_spmd_mesh"] = list(xla_spmd.mesh_shape(spec.layout))
    peak = plan_peak(spec)
    if as_json:
        step = result["model_tflop_per_step"] / result["world_size"] / peak.tflops if peak and result[
            "model_tflop_per_step"] else None
        print(json.dumps({**result, "peak_tflops": peak.tflops if peak else None,
                          "peak_source": peak.source if peak else None, "step_time_s": step,
                          "not_checked": not_checked}))
        return 0
    print(format_plan({**result, "not_checked": not_checked}, peak))
    notice = _precision_notice(spec, peak)
    if notice:
        print(notice)
    return 0


def check_as_training(argv: list[str]):
    """The config of `argv` checked as the training entry checks it before anything starts (the
    same functions: validation with the values not supported yet, the pre-flight `check_run` (a
    custom data module's class and the LoRA targets included) and the user's callbacks; evaluate
    only: `check_evaluable` and `check_run_parts`), except the files, which it does not look at (but the ones the plan reads).
    Returns (the run spec, the keys whose files were not checked)."""
    cfg = load_config(argv, check_paths=False, default_config_dir=REPO_CONF_DIR, quiet=True)
    not_checked = check_files(cfg, look=PLAN_READS)  # a data source named; every problem at once
    exp = cfg.exp_manager
    if exp.resume_if_exists and (not exp.resume_ignore_no_checkpoint or cfg.trainer.max_epochs == 0):
        not_checked.append("exp_manager.resume_if_exists")  # a run refuses a log dir without a checkpoint
    spec = build_spec(cfg)  # the run spec, once
    if cfg.trainer.max_epochs == 0:  # evaluate only (nxdt.training.evaluate): its own checks
        check_evaluable(spec)
        check_run_parts(spec)
    else:
        check_run(spec)
        build_user_callbacks(cfg.trainer.callbacks)
    return spec, not_checked


def _precision_notice(spec, peak) -> str | None:
    """The run's notice for a bf16/fp16 preset on a CPU (or GPU) that runs it slower than fp32 (`spec`: the run spec)."""
    if peak is None or peak.measured is None:  # only where this machine's CPU is the device planned for
        return None
    return low_precision_notice("cpu", spec.precision.compute_dtype, spec.cfg.precision.type)


if __name__ == "__main__":
    sys.exit(main())
