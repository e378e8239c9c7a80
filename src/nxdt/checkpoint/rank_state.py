"""What a checkpoint load restores beside the tensors, and how a resumed epoch continues.

Each rank's saved file (`rank_XXXXX.json`: trainer progress, RNG states, data-loader state, the
optimizer's non-tensor state) belongs to that rank's place in the saving layout. On load into the
same layout every rank takes its own; into another one the optimizer scalars are merged from all
files, every rank is re-seeded alike, and the data-loader state carries over only where the
data-parallel size is the same (a notice says so). `ResumedLoader` lets Lightning end the first
resumed epoch at the same batch as an uninterrupted run. `nxdt.checkpoint.checkpointer.load_checkpoint`
calls these.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nxdt.checkpoint.nxd_legacy_optim import converted_trainer_state
from nxdt.checkpoint.state import dp_rank_of, from_json, layout_of, notice, reseed_state
from nxdt.config.errors import ConfigError


def rank_file(rank: int) -> str:
    """The name of rank `rank`'s saved state file in a checkpoint directory."""
    return f"rank_{rank:05d}.json"


def own_rank_file(files: list[dict[str, Any]], strategy, same_layout: bool,
                   same_dp: bool) -> tuple[dict[str, Any], bool]:
    """This rank's saved state file (trainer, RNG, data state) and whether it is of our dp rank: in the
    same layout our own; otherwise one of our dp rank where the dp size is the same, else rank 0's."""
    if same_layout:
        return files[strategy.global_rank], same_dp
    dp_rank = dp_rank_of(strategy)
    own = next((f for f in files if same_dp and f.get("dp_rank") == dp_rank), files[0])
    return own, same_dp and own.get("dp_rank") == dp_rank


def restore_optimizer_scalars(state: dict[str, Any], scalars: dict[str, Any], files: list[dict[str, Any]],
                               path: Path, meta: dict[str, Any]) -> None:
    """The optimizer's non-tensor state (step counts, hyperparameters) from the rank files into `state`."""
    saved_scalars: dict[str, Any] = {}
    for f in files:  # pipeline stages and ZeRO-1 shards hold different keys: merge
        saved_scalars.update(from_json(f.get("scalars", {})))
    # converted from NxDT (`nxdt convert nxd-to-nxdt`): the hyperparameters are the config's
    for key in scalars if meta.get("converted_from") != "nxd" else ():
        if key not in saved_scalars:
            raise ConfigError(f"checkpoint {path}: optimizer key '{key}' not found in {rank_file(0)} "
                              "(saved with another optimizer?)")
        value = saved_scalars[key]
        state[key] = tuple(value) if isinstance(scalars[key], tuple) else value


def resume_trainer_state(trainer_state: dict[str, Any], strategy, cfg, path: Path, meta: dict[str, Any],
                          own: dict[str, Any], same_layout: bool, same_dp: bool) -> None:
    """A full resume's trainer state: NxDT's progress for a converted checkpoint, and the RNG and
    data-loader states where they carry over to this layout (a notice says what does not)."""
    if meta.get("converted_from") == "nxd":
        trainer_state.update(converted_trainer_state(strategy, meta, path))
    # RNG states belong to a rank's place in the layout. In another layout (even with the same
    # world size) rank r has another role, and ranks that must draw the same numbers (e.g.
    # tensor-parallel peers, which hold replicated activations) may hold different saved
    # states (say, two pipeline stages that consumed different amounts): taking them over
    # could desynchronise replicas. Every rank is re-seeded alike instead (reseed_state).
    seed, step = cfg.seed if cfg is not None else 0, int(meta.get("step", 0))
    trainer_state["pending_rng"] = own.get("rng") if same_layout else reseed_state(seed, step)
    if same_layout:
        return
    if not same_dp:
        _drop_data_state(trainer_state, strategy)
    if strategy.global_rank == 0:
        saved_layout, layout = meta.get("layout") or {}, layout_of(strategy.lightning_module)
        notice(f"checkpoint saved on {meta.get('world_size')} ranks ({_layout_text(saved_layout)}), loading "
               f"on {strategy.world_size} ({_layout_text(layout)}): tensors resharded; per-rank RNG states are not "
               f"restored (every rank re-seeded from seed {seed} and step {step}); "
               + ("data-loader state kept (same dp size)" if same_dp else
                  f"data-loader state does not carry over a change of dp size (dp={saved_layout.get('dp')}"
                  f" -> dp={layout.get('dp')}): data continues from consumed_samples"))


def _drop_data_state(trainer_state: dict[str, Any], strategy) -> None:
    """Per-rank data-loader state belongs to the old data-parallel layout: drop it (consumed_samples stays)."""
    dm = getattr(strategy.lightning_module.trainer, "datamodule", None)
    if dm is not None:
        state = trainer_state.pop(type(dm).__qualname__, None)
        # what does not depend on the layout stays: DPO's reference log-probs (the same on every rank)
        if isinstance(state, dict) and "reference_logps" in state:
            trainer_state[type(dm).__qualname__] = {"reference_logps": state["reference_logps"]}
    fit_loop = trainer_state.get("loops", {}).get("fit_loop", {}).get("state_dict", {})
    fit_loop.pop("combined_loader", None)


def _layout_text(layout: dict[str, int]) -> str:
    # ep is shown only where there is expert parallelism (it is 1 for every dense model)
    return " ".join(f"{k}={v}" for k, v in layout.items() if k != "ep" or v != 1) or "?"


# --------------------------------------------------------------------------- resuming mid-epoch
def batches_done_in_epoch(trainer_state: dict[str, Any]) -> int:
    """Batches of the current epoch that Lightning counts as done in a restored trainer state."""
    loops = trainer_state.get("loops", {}).get("fit_loop", {})
    progress = loops.get("epoch_loop.batch_progress", {}).get("current", {})
    return int(progress.get("ready", 0) or 0)


class ResumedLoader:
    """The training loader of a resumed run, as Lightning expects a resumable loader to look.

    Our samplers start at consumed_samples and have as many batches as remain, while Lightning
    restores its per-epoch batch count and ends the epoch when that count reaches the loader's
    length. This wrapper reports `skipped + remaining` for the first epoch (then the plain
    length) so the epoch ends at the same batch as in an uninterrupted run and validation
    intervals keep their place. The position itself lives in consumed_samples (and in the
    loader's own state_dict when it has one).
    """

    def __init__(self, loader, skipped: int) -> None:
        self.loader = loader
        self.skipped = int(skipped)

    def __len__(self) -> int:
        return len(self.loader) + self.skipped

    def __iter__(self):
        yield from self.loader
        self.skipped = 0

    def __getattr__(self, name: str):
        return getattr(self.__dict__["loader"], name)

    def state_dict(self) -> dict[str, Any]:
        inner = getattr(self.loader, "state_dict", None)
        return inner() if callable(inner) else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        inner = getattr(self.loader, "load_state_dict", None)
        if callable(inner) and state_dict:
            inner(state_dict)
