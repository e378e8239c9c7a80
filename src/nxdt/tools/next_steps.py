"""What a finished run prints last: where its checkpoint is and the commands that resume it,
sample from it, evaluate it, report on it and open TensorBoard, ready to paste."""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

# overrides that the resume command replaces
_REPLACED = ("exp_manager.resume_from_checkpoint=", "trainer.max_steps=", "hydra.run.dir=")


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


def format_next_steps(checkpoint: Path | None, log_dir: Path, argv: list[str], max_steps: int,
                      environ=None, preempted: bool = False, prompt: str = BUNDLED_PROMPT) -> str:
    """The closing lines of a run (rank 0). A finished run's resume command trains as many steps
    again; a preempted run's continues to its own max_steps. `prompt`: the sample command's (a run
    on other data than the bundled corpus gets PROMPT, to fill in)."""
    lines = []
    if checkpoint is not None:
        args = [a for a in argv if not a.startswith(_REPLACED)]
        resume = [*launch_prefix(environ), *map(shlex.quote, args),
                  shlex.quote(f"exp_manager.resume_from_checkpoint={shown(checkpoint)}"),
                  f"trainer.max_steps={max_steps if preempted else 2 * max_steps}"]
        nxdt = _tool("nxdt")
        lines += [
            f"checkpoint   {shown(checkpoint)}",
            f"{'continue' if preempted else 'resume':<12} {' '.join(resume)}",
            f"sample       {nxdt} generate --checkpoint {shlex.quote(shown(checkpoint))} --prompt {shlex.quote(prompt)} --stream",
            f"evaluate     {nxdt} evaluate --checkpoint {shlex.quote(shown(checkpoint))}",
        ]
    lines += [
        f"report       {_tool('nxdt')} report {shlex.quote(shown(log_dir))}",
        f"tensorboard  {_tool('tensorboard')} --logdir {shlex.quote(shown(log_dir))}",
    ]
    return "\n".join(lines)
