"""What a finished run prints last: where its checkpoint is and the commands that resume it,
sample from it, evaluate it, report on it and open TensorBoard, ready to paste.

The resume (`continue` after a stop signal) command is the run's own command line with the
checkpoint to start from:
- a run that started from scratch or resumed a checkpoint: `exp_manager.resume_from_checkpoint=CKPT`
  (a full resume: weights, optimizer, data position, RNG);
- a fine-tune (started from `resume_from_checkpoint=BASE model.weight_init_only=true`: LoRA, SFT,
  DPO / ORPO from a pre-trained model): its own command again, in its log dir, with
  `exp_manager.resume_if_exists=true`, which resumes the run's newest checkpoint (the one printed)
  in full, a LoRA adapter-only one on the base it started from, a DPO one with its reference
  log-probs and optimizer from the checkpoint (nxdt.checkpoint.resume). Replacing BASE by CKPT
  with weight_init_only would restart at step 0 from CKPT's weights (and refuse an adapter-only CKPT).
The `evaluate` line is printed only where `nxdt evaluate --checkpoint` accepts the checkpoint:
not for DPO / ORPO (evaluate reports language-model cross entropy), not for an adapter-only
checkpoint without a base, not when the run has no validation or test batches.
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

from nxdt.config.load import quote_value

# overrides that the resume command replaces
_REPLACED = ("exp_manager.resume_from_checkpoint=", "trainer.max_steps=", "hydra.run.dir=")
# ... and those that a fine-tune's continue command replaces (it keeps resume_from_checkpoint: the base)
_REPLACED_FINE_TUNE = ("exp_manager.resume_if_exists=", "exp_manager.explicit_log_dir=", "trainer.max_steps=",
                       "hydra.run.dir=")


def shown(path: str | os.PathLike) -> str:
    """A path as a user would type it: relative to the working directory when it is inside it."""
    path = Path(path)
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except (ValueError, OSError):
        return str(path)


def _tool(name: str) -> str:
    """`nxdt` / `torchrun` / `tensorboard` of this Python's environment (e.g. .venv/bin/nxdt)."""
    candidate = Path(sys.executable).parent / name
    return shown(candidate) if candidate.exists() else name


def launch_prefix(environ=None) -> list[str]:
    """How this run was launched: the script, under torchrun with this node's process count."""
    environ = os.environ if environ is None else environ
    script = sys.argv[0] if sys.argv and sys.argv[0].endswith(".py") else None
    if script is not None and Path(script).parts[-2:] == ("nxdt", "cli.py"):  # `python -m nxdt.cli train`
        script = None
    world = int(environ.get("WORLD_SIZE", "1") or 1)
    if world <= 1:
        return [shown(sys.executable), shown(script)] if script else [_tool("nxdt"), "train"]
    nnodes = world // max(int(environ.get("LOCAL_WORLD_SIZE", world) or world), 1)
    nodes = [] if nnodes <= 1 else [f"--nnodes {nnodes}", "..."]
    if script is None:  # nxdt train as the launcher (nxdt.tools.launch): its workers run nxdt.cli
        return [_tool("nxdt"), "train", *(["--standalone"] if nnodes <= 1 else nodes),
                f"--nproc-per-node {environ.get('LOCAL_WORLD_SIZE', world)}"]
    torchrun = [_tool("torchrun"), *(["--standalone"] if nnodes <= 1 else nodes),
                f"--nproc_per_node {environ.get('LOCAL_WORLD_SIZE', world)}"]
    return [*torchrun, shown(script)]


# the sample prompt of a run on the bundled corpus (KJV); other data gets a word to replace
BUNDLED_PROMPT = "And God said"


def closing_options(cfg, checkpoint: Path | None) -> dict[str, bool]:
    """`format_next_steps`' `fine_tune` and `evaluable` for the run of `cfg` and its `checkpoint`."""
    from nxdt.checkpoint.lora_state import is_adapter_only  # torch: called at a run's end only (train.py's order)
    from nxdt.spec.alignment import alignment_of  # the same: the spec imports after the env vars

    exp, t = cfg.exp_manager, cfg.trainer
    adapters = checkpoint is not None and is_adapter_only(checkpoint)
    evaluable = (alignment_of(cfg).preference is None and not (t.limit_val_batches == 0 and t.limit_test_batches == 0)
                 and (not adapters or bool(exp.resume_from_checkpoint)))
    return {"fine_tune": bool(cfg.model.weight_init_only and exp.resume_from_checkpoint), "evaluable": evaluable}


def override_value(value: str) -> str:
    """`value` as Hydra's override grammar reads it back: quoted where it holds a comma, a bracket,
    a quote or a space (Hydra's run dirs do: `lr=1e-2,seed=3`)."""
    return quote_value(value) if any(c in value for c in ",[]{}()'\" \\") or value != value.strip() else value


def resume_args(checkpoint: Path, log_dir: Path, argv: list[str], max_steps: int, fine_tune: bool) -> list[str]:
    """The overrides of the command that continues the run from `checkpoint` (see the module docstring)."""
    if fine_tune:
        return [*(a for a in argv if not a.startswith(_REPLACED_FINE_TUNE)),
                f"exp_manager.explicit_log_dir={override_value(shown(log_dir))}", "exp_manager.resume_if_exists=true",
                f"trainer.max_steps={max_steps}"]
    return [*(a for a in argv if not a.startswith(_REPLACED)),
            f"exp_manager.resume_from_checkpoint={shown(checkpoint)}", f"trainer.max_steps={max_steps}"]


def format_next_steps(checkpoint: Path | None, log_dir: Path, argv: list[str], max_steps: int,
                      environ=None, preempted: bool = False, fine_tune: bool = False, evaluable: bool = True,
                      prompt: str = BUNDLED_PROMPT) -> str:
    """The closing lines of a run (rank 0). A finished run's resume command trains as many steps
    again; a preempted run's continues to its own max_steps. `fine_tune`, `evaluable`: see
    `closing_options`; `prompt`: the sample command's (a run on other data than the bundled corpus
    gets PROMPT, to fill in)."""
    lines = []
    if checkpoint is not None:
        args = resume_args(checkpoint, log_dir, argv, max_steps if preempted else 2 * max_steps, fine_tune)
        resume = [*launch_prefix(environ), *map(shlex.quote, args)]
        nxdt = _tool("nxdt")
        lines += [
            f"checkpoint   {shown(checkpoint)}",
            f"{'continue' if preempted else 'resume':<12} {' '.join(resume)}",
            f"sample       {nxdt} generate --checkpoint {shlex.quote(shown(checkpoint))} --prompt {shlex.quote(prompt)} --stream",
            *([f"evaluate     {nxdt} evaluate --checkpoint {shlex.quote(shown(checkpoint))}"] if evaluable else []),
        ]
    lines += [
        f"report       {_tool('nxdt')} report {shlex.quote(shown(log_dir))}",
        f"tensorboard  {_tool('tensorboard')} --logdir {shlex.quote(shown(log_dir))}",
    ]
    return "\n".join(lines)
