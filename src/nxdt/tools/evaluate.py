"""`nxdt evaluate`: loss and perplexity of a checkpoint on the validation and test splits of its data.

usage: nxdt evaluate --checkpoint DIR [key=value | +key=value | ~key ...]
       nxdt evaluate --checkpoint HF_DIR --config-name NAME [key=value ...]   (a transformers model folder)
       torchrun --nproc_per_node N -m nxdt.cli evaluate --checkpoint DIR [key=value ...]

The config is the checkpoint's own config.yaml (every checkpoint of a training run holds the
resolved config) with the overrides on top, composed and validated as a training command line
(unknown keys, types, layout and batch arithmetic, files that must exist: one line, exit 2).
Override what differs here: data paths, the layout (checkpoints reshard on load: any dp, tp, pp,
cp, fsdp or zero1 layout of the same model), trainer.limit_val_batches / limit_test_batches (how
many global batches of each split; 0 skips a split).

The number of processes comes from the launch, not from the saved config: trainer.devices and
trainer.num_nodes default to torchrun's LOCAL_WORLD_SIZE and WORLD_SIZE / LOCAL_WORLD_SIZE (1 and
1 in a plain process); an override of either still wins. So does the layout, as `nxdt generate`'s:
in one process the model is whole (tensor, pipeline, context and expert parallel 1, no sequence
parallel; said in a note when the run was split), under torchrun it is the saved one (or your
overrides). `--checkpoint` may also be a run folder: its newest complete checkpoint is used.

Writes `<checkpoint>.eval.json` beside the checkpoint directory (never inside it) and prints a
table; see docs/evaluate.md. A transformers model folder (config.json, safetensors) has no
config.yaml: `--config-name NAME` gives the data and model keys, and it is evaluated as
`nxdt train --config-name NAME exp_manager.resume_from_checkpoint=HF_DIR model.weight_init_only=true
trainer.max_epochs=0` would (the result beside the folder, `<folder>.eval.json`).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from omegaconf import OmegaConf

from nxdt.config.env import apply_env
from nxdt.config.errors import ConfigError
from nxdt.config.load import global_rank, main_guard, quote_value
from nxdt.spec import load_config
from nxdt.tools.train import main as train_main
from nxdt.tools.train import startup_imports

USAGE = "usage: nxdt evaluate --checkpoint DIR [key=value ...] (a transformers folder: also --config-name NAME)"
CONFIG_OPTIONS = ("--config-path", "-cp", "--config-name", "-cn")
# a whole model in one process: (key under distributed_strategy, its one-process value)
ONE_PROCESS = (("tensor_model_parallel_size", 1), ("pipeline_model_parallel_size", 1),
               ("virtual_pipeline_model_parallel_size", 1), ("context_parallel_size", 1),
               ("expert_model_parallel_size", 1), ("sequence_parallel", False), ("schedule", None),
               ("hsdp_replicate_size", None))


def parse_args(argv: list[str]) -> tuple[Path, list[str], list[str]]:
    """(checkpoint directory, config overrides, --config-name / --config-path arguments) from the command
    line; ConfigError on anything else."""
    checkpoint: str | None = None
    overrides: list[str] = []
    config: list[str] = []
    i = 0
    while i < len(argv):
        arg = str(argv[i])
        if arg == "--checkpoint":
            if i + 1 >= len(argv):
                raise ConfigError(f"--checkpoint needs a directory ({USAGE})")
            i += 1
            checkpoint = str(argv[i])
        elif arg.startswith("--checkpoint="):
            checkpoint = arg.split("=", 1)[1]
        elif arg.split("=", 1)[0] in CONFIG_OPTIONS:
            config.append(arg)
            if "=" not in arg and i + 1 < len(argv):
                i += 1
                config.append(str(argv[i]))
        elif arg.startswith("-"):
            raise ConfigError(f"unknown option '{arg}' ({USAGE})")
        else:
            overrides.append(arg)
        i += 1
    if not checkpoint:
        raise ConfigError(f"--checkpoint DIR is required ({USAGE})")
    return Path(checkpoint).expanduser(), overrides, config


def evaluate_hf_folder(folder: Path, overrides: list[str], config: list[str]) -> int:
    """A transformers folder holds weights, not data: the config (--config-name) says what to evaluate
    on; it runs as a training command line's evaluate-only mode starting from the folder's weights."""
    if not any(a.split("=", 1)[0] in ("--config-name", "-cn") for a in config):
        raise ConfigError(f"--checkpoint {folder} is a transformers model folder (no config.yaml): add --config-name "
                          "NAME for the data and the model's keys (the weights come from the folder)")
    return train_main([*config, *launch_overrides(), *overrides,
                       f"exp_manager.resume_from_checkpoint={quote_value(str(folder.absolute()))}",
                       "model.weight_init_only=true", "trainer.max_epochs=0"])


def launch_overrides(environ=None) -> list[str]:
    """trainer.devices / num_nodes of this launch (torchrun's variables; 1 and 1 without torchrun)."""
    environ = os.environ if environ is None else environ
    world = int(environ.get("WORLD_SIZE") or 1)
    per_node = int(environ.get("LOCAL_WORLD_SIZE") or world)
    return [f"trainer.devices={per_node}", f"trainer.num_nodes={max(world // per_node, 1)}"]


def one_process_layout(checkpoint: Path, overrides: list[str], world: int) -> tuple[list[str], str | None]:
    """In one process, the overrides that make the saved layout whole (a key you override stays
    yours) and a note naming what changed; under torchrun, none (the saved layout, or yours)."""
    if world > 1:
        return [], None
    saved = OmegaConf.load(checkpoint / "config.yaml").get("distributed_strategy") or {}
    given = {o.lstrip("+~").split("=", 1)[0] for o in overrides}
    out, changed = [], []
    for key, value in ONE_PROCESS:
        full = f"distributed_strategy.{key}"
        if full in given:
            continue
        out.append(f"{full}={'null' if value is None else str(value).lower()}")
        before = saved.get(key)
        if before not in (None, value) and key not in ("schedule", "hsdp_replicate_size"):
            changed.append(f"{key} {before} -> {str(value).lower()}")
    note = ("evaluating in one process with the whole model (" + ", ".join(changed)
            + "; under torchrun the saved layout is used)") if changed else None
    return out, note


def load_checkpoint_config(checkpoint: Path, overrides: list[str], notes: list[str] | None = None):
    """The checkpoint's config.yaml with this launch's process count and `overrides`, validated."""
    if not checkpoint.is_dir():  # the commonest mistake, said before torch is imported
        raise ConfigError(f"checkpoint {checkpoint} does not exist or is not a directory")
    # the checkpoint first (incomplete, not nxdt's, truncated shards): that is what is wrong with a
    # directory that is not a whole checkpoint, whatever its config says. Imported here: torch only
    # after the checks above; not torch-xla, so the env vars the config sets (apply_env) still come first.
    from nxdt.checkpoint.checkpointer import CONFIG, validate_checkpoint
    from nxdt.checkpoint.lora_state import is_adapter_only

    validate_checkpoint(checkpoint)
    if not (checkpoint / CONFIG).is_file():
        raise ConfigError(f"checkpoint {checkpoint} has no {CONFIG} (a weights-only checkpoint, e.g. from nxdt "
                          "convert): evaluate a run's checkpoint, or give a training command line "
                          f"exp_manager.resume_from_checkpoint={checkpoint} model.weight_init_only=true "
                          "trainer.max_epochs=0 (evaluate only)")
    # the run's starting weights are read only as the base of an adapter-only LoRA checkpoint;
    # otherwise they need not exist any more (validation would check the path)
    start = [] if is_adapter_only(checkpoint) else ["exp_manager.resume_from_checkpoint=null",
                                                    "model.weight_init_only=false"]
    world = os.environ.get("WORLD_SIZE")
    layout, note = one_process_layout(checkpoint, overrides, int(world or 1))
    if note and notes is not None:
        notes.append(note)
    argv = ["--config-path", str(checkpoint.absolute()), "--config-name", Path(CONFIG).stem,
            *launch_overrides(), *start, *layout, *overrides]
    return load_config(argv, world_size=int(world) if world else None)


def _main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(str(a).split("=", 1)[0] == "--tasks" for a in argv):  # lm-evaluation-harness's benchmarks
        from nxdt.inference import harness  # reason: torch (and the optional lm-eval) only on this path

        return harness.main(argv)
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0
    checkpoint, overrides, config = parse_args(argv)
    from nxdt.checkpoint.locate import is_hf_folder, resolve_checkpoint  # torch (not torch-xla): before apply_env

    checkpoint, chosen = resolve_checkpoint(checkpoint)
    if is_hf_folder(checkpoint):
        return evaluate_hf_folder(checkpoint, overrides, config)
    if config:
        raise ConfigError(f"{config[0]}: the config is the checkpoint's config.yaml; give overrides key=value ({USAGE})")
    notes = [chosen] if chosen else []
    cfg = load_checkpoint_config(checkpoint, overrides, notes)
    if global_rank() == 0:
        for note in notes:
            print(f"note: {note}", file=sys.stderr, flush=True)
    apply_env(cfg)  # validation already named the keys that have no effect here
    with startup_imports():  # the run's modules (torch-xla among them) only after the env vars are set
        from nxdt.checkpoint.resume import evaluation_plan
        from nxdt.training.evaluate import evaluate

    evaluate(cfg, evaluation_plan(cfg, checkpoint=checkpoint))
    return 0


def main(argv: list[str] | None = None) -> int:
    """`nxdt evaluate`: bad input is one line (rank 0) and exit 2 on every rank (main_guard)."""
    return main_guard(_main)(argv)


if __name__ == "__main__":
    sys.exit(main())
