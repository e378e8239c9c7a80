"""Which checkpoint a run starts from, and what is restored just before its first step.

`exp_manager.resume_from_checkpoint` (an explicit path: it must be whole), else with
`resume_if_exists` the newest complete checkpoint in the run's checkpoint dir (incomplete ones are
skipped with a warning, never deleted); `model.weight_init_only` loads weights only. A
fine-tuning run (weight_init_only with resume_from_checkpoint = the pre-trained model) that has
checkpoints of its own resumes from those under `resume_if_exists`, as NeMo does: a restart after
a crash continues the run instead of starting it over. When that checkpoint holds LoRA adapters
only, the frozen base is loaded from resume_from_checkpoint first (`ResumePlan.base`). The load
itself is `nxdt.checkpoint.checkpointer.load_checkpoint`, called by the strategy (full resume) or
by `ResumeHelper` (weights only).

A rerun never destroys an earlier run's work. A launch that would start over (no
resume_if_exists, or a fine-tuning start from resume_from_checkpoint + weight_init_only) in a log
dir that holds a complete checkpoint is refused before anything is written (`refuse_rerun`: one
line naming the checkpoint and the two ways on, exit 2): NxDT's configs all set
`resume_if_exists: True`, so its users expect a rerun of the same command to continue, never to
restart and prune. Each run has an id (`ResumeHelper.run_id`, in every checkpoint's callback
state; a resumed run takes its checkpoint's), and retention prunes only checkpoints of this run
(`ResumeHelper.owns`), never another run's that share the directory.

`setup_checkpointing(cfg, dirs)` is the one entry the run calls, before anything is written.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning.pytorch.callbacks import Callback

from nxdt.checkpoint.callbacks import NxdtCheckpoint, check_checkpoint_params
from nxdt.checkpoint.checkpointer import load_checkpoint, validate_checkpoint
from nxdt.checkpoint.locate import check_start_weights, is_hf_folder, load_hf_folder, load_start_weights
from nxdt.checkpoint.lora_state import is_adapter_only
from nxdt.checkpoint.rank_state import rank_file
from nxdt.checkpoint.retention import complete_checkpoints
from nxdt.checkpoint.state import read_json, set_rng_state
from nxdt.config.errors import ConfigError
from nxdt.config.load import global_rank as _global_rank

if TYPE_CHECKING:
    from nxdt.exp.exp_manager import ExpDirs


@dataclass
class ResumePlan:
    path: Path | None = None  # checkpoint to resume (or to take weights from)
    weights_only: bool = False  # model.weight_init_only: load weights, start training fresh
    base: Path | None = None  # the base model's weights, loaded too when `path` holds LoRA adapters only

    @property
    def full_resume(self) -> Path | None:
        """What Lightning's `fit(ckpt_path=...)` loads (weights-only starts are ResumeHelper's)."""
        return None if self.weights_only else self.path


def setup_checkpointing(cfg, dirs) -> tuple[ResumePlan, ResumeHelper, NxdtCheckpoint | None]:
    """Check the checkpoint keys, choose the checkpoint to start from, build the two callbacks:
    the resume helper and the checkpoint callback (None without exp_manager.create_checkpoint_callback).
    Raises ConfigError (nothing written yet) when the resume asked for cannot happen."""
    check_checkpoint_params(cfg.exp_manager.checkpoint_callback_params)
    plan = find_resume_checkpoint(cfg, dirs)
    exp = cfg.exp_manager
    helper = ResumeHelper(plan)
    checkpointing = None
    if exp.create_checkpoint_callback:
        params = exp.checkpoint_callback_params
        checkpointing = NxdtCheckpoint(
            dirpath=dirs.checkpoint_dir, filename=params.filename, save_top_k=params.save_top_k,
            save_last=params.save_last, every_n_train_steps=params.every_n_train_steps,
            monitor=params.monitor, mode=params.mode, on_error=exp.on_checkpoint_error)
        checkpointing.owns = helper.owns  # retention prunes this run's checkpoints only
    return plan, helper, checkpointing


def check_weight_init(cfg) -> None:
    """model.weight_init_only names no weights without exp_manager.resume_from_checkpoint (reads no file)."""
    if cfg.model.weight_init_only and not cfg.exp_manager.resume_from_checkpoint:
        raise ConfigError("model.weight_init_only: needs exp_manager.resume_from_checkpoint (the weights to load)")


def find_resume_checkpoint(cfg, dirs: ExpDirs, training: bool = True) -> ResumePlan:
    """The checkpoint to load (and how) from resume_from_checkpoint / resume_if_exists. `training`:
    a launch that would start over where a complete checkpoint is refused (an evaluation writes none)."""
    exp = cfg.exp_manager
    weights_only = cfg.model.weight_init_only
    check_weight_init(cfg)
    if exp.resume_from_checkpoint:
        path = Path(exp.resume_from_checkpoint).absolute()
        check_start_weights(path, weights_only)  # an explicit path must be good (or a transformers folder)
        own = complete_checkpoints(dirs.checkpoint_dir, warn=False) if weights_only else []
        if own and not exp.resume_if_exists:
            if training:  # a fine-tuning start would restart the run there
                refuse_rerun(own[-1][1], dirs)
            own = []  # an evaluation takes the start, as resume_if_exists=false says
        if own:  # a fine-tuning run restarted: continue it (its own newest checkpoint)
            if _global_rank() == 0:
                print(f"note: resuming this run's checkpoint {own[-1][1].name}; the starting weights "
                      f"{path} are not reloaded" + (" (except the LoRA base)" if is_adapter_only(own[-1][1]) else ""),
                      flush=True)
            return ResumePlan(own[-1][1], False, base=path if is_adapter_only(own[-1][1]) else None)
        return ResumePlan(path, weights_only)
    if not exp.resume_if_exists:
        earlier = complete_checkpoints(dirs.checkpoint_dir, warn=False) if training else []
        if earlier:
            refuse_rerun(earlier[-1][1], dirs)
        return ResumePlan()
    found = complete_checkpoints(dirs.checkpoint_dir)
    if found:
        return ResumePlan(found[-1][1], False)
    if exp.resume_ignore_no_checkpoint:
        if _global_rank() == 0:
            print(f"note: no complete checkpoint in {dirs.checkpoint_dir}; starting from scratch", flush=True)
        return ResumePlan()
    raise ConfigError(
        f"exp_manager.resume_if_exists: no complete checkpoint in {dirs.checkpoint_dir} "
        "(set exp_manager.resume_ignore_no_checkpoint: true to start from scratch)"
    )


def refuse_rerun(newest: Path, dirs: ExpDirs) -> None:
    """A launch that would start over where an earlier run left a complete checkpoint: ConfigError."""
    raise ConfigError(
        f"exp_manager: log dir {dirs.log_dir} holds a complete checkpoint of an earlier run ({newest.name}); "
        "starting over there would lose it: continue that run with exp_manager.resume_if_exists=true, or start "
        "a new one in a new folder (exp_manager.explicit_log_dir=NEW_DIR)")


def run_id_of(checkpoint: Path) -> str | None:
    """The id of the run that wrote `checkpoint` (ResumeHelper's state in rank 0's file); None if unknown."""
    try:
        state = read_json(checkpoint / rank_file(0), "rank 0's state")
        return state["trainer"]["callbacks"][ResumeHelper.__qualname__]["run"]
    except (ConfigError, KeyError, TypeError):
        return None


def evaluation_plan(cfg, dirs: ExpDirs | None = None, checkpoint: Path | None = None) -> ResumePlan:
    """The weights an evaluation loads (nxdt.training.evaluate), checked before anything starts.

    `checkpoint` (`nxdt evaluate --checkpoint DIR`): that checkpoint's model as a resume would load
    it; when it holds LoRA adapters only, the base comes from `exp_manager.resume_from_checkpoint`
    (its config.yaml names the base the run started from), as for a resume. Without it (a training
    run with trainer.max_epochs=0, evaluate only): the checkpoint the run would start from
    (`find_resume_checkpoint`), and none is an error: evaluating freshly initialised weights is
    never what was meant."""
    exp = cfg.exp_manager
    if checkpoint is not None:
        plan = ResumePlan(Path(checkpoint).absolute(), False)
        validate_checkpoint(plan.path)
        if is_adapter_only(plan.path):
            if not exp.resume_from_checkpoint:
                raise ConfigError(f"checkpoint {plan.path} holds LoRA adapters only: set "
                                  "exp_manager.resume_from_checkpoint to the base model's checkpoint (the run's "
                                  "config.yaml does not name one)")
            plan.base = Path(exp.resume_from_checkpoint).absolute()
            validate_checkpoint(plan.base)
        return plan
    what = "trainer.max_epochs=0 (evaluate only)"
    # neither resume key set is refused by validation (nxdt.config.validate)
    if not exp.resume_from_checkpoint and not complete_checkpoints(dirs.checkpoint_dir, warn=False):
        raise ConfigError(f"{what}: exp_manager.resume_if_exists: no complete checkpoint in {dirs.checkpoint_dir} "
                          "to evaluate")
    plan = find_resume_checkpoint(cfg, dirs, training=False)
    if plan.path is None:
        raise ConfigError(f"{what}: no weights to evaluate: set exp_manager.resume_from_checkpoint=CHECKPOINT")
    if not plan.weights_only and plan.base is None and is_adapter_only(plan.path):
        raise ConfigError(f"{what}: checkpoint {plan.path} holds LoRA adapters only: start from the base model "
                          "(exp_manager.resume_from_checkpoint=BASE model.weight_init_only=true) and let "
                          "exp_manager.resume_if_exists pick up the adapters, or use nxdt evaluate --checkpoint")
    return plan


def load_plan_weights(strategy, plan: ResumePlan, cfg) -> None:
    """Load the model of `plan` (nothing else): the LoRA base first when the checkpoint lacks it,
    then the checkpoint, weights-only (a fine-tuning start: fresh adapters) or as saved."""
    if is_hf_folder(plan.path):  # a transformers folder: its weights (find_resume_checkpoint allowed it)
        load_hf_folder(strategy, plan.path)
        return
    if plan.base is not None:
        load_checkpoint(strategy, plan.base, cfg, weights_only=True, frozen_only=True)
    load_checkpoint(strategy, plan.path, cfg, weights_only=plan.weights_only, model_only=not plan.weights_only)


class ResumeHelper(Callback):
    """Weights-only start (model.weight_init_only) and the saved RNG states, applied just before
    the first training step after a resume."""

    def __init__(self, plan: ResumePlan) -> None:
        self.plan = plan
        self._rng: dict | None = None
        self.run_id = uuid.uuid4().hex  # rank 0's for every rank (setup); a resume takes its checkpoint's

    def setup(self, trainer, pl_module, stage: str) -> None:
        self.run_id = trainer.strategy.broadcast(self.run_id)

    def state_dict(self) -> dict[str, Any]:
        return {"run": self.run_id}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.run_id = state_dict.get("run") or self.run_id

    def owns(self, checkpoint: Path) -> bool:
        """`checkpoint` was written by this run (or a launch it resumed): retention may prune it."""
        return run_id_of(checkpoint) == self.run_id

    def on_fit_start(self, trainer, pl_module) -> None:
        if self.plan.path is not None and self.plan.weights_only:
            load_start_weights(trainer.strategy, self.plan.path, pl_module.cfg)
            if trainer.is_global_zero:
                print(f"loaded weights from {self.plan.path}", flush=True)
        if self.plan.base is not None:  # the frozen LoRA base under an adapter-only resume
            load_checkpoint(trainer.strategy, self.plan.base, pl_module.cfg, weights_only=True, frozen_only=True)
            if trainer.is_global_zero:
                print(f"loaded the LoRA base weights from {self.plan.base}", flush=True)

    def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict[str, Any]) -> None:
        self._rng = checkpoint.pop("pending_rng", None)
        if trainer.is_global_zero:
            print(f"resuming from {self.plan.path} (step {checkpoint.get('global_step')}, "
                  f"consumed_samples {checkpoint.get('consumed_samples')})", flush=True)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._rng is not None:
            set_rng_state(self._rng)
            self._rng = None
