"""Dynamic data selection (`data.dynamic_data_selection`): the weight update, the schedule of
weights over steps, and the domains of every global batch.

Two updates, every `data.dynamic_selection.update_interval` steps, from each domain's held-out loss
(Sheared-LLaMA's dynamic batch loading, arXiv 2310.06694; LLaMA-MoE's smoe/data/dynamic_selection.py):

    sheared_llama        LLaMA-MoE's update_weight_sheared_llama, the signed difference: a domain below
                         its reference loses weight
                             alpha_i = softmax_i(log weights_i + eta * (loss_i - reference_i))
    sheared_llama_paper  the paper's rule (LLaMA-MoE's update_weight_sheared_llama_paper), the excess
                         clipped at 0: only the domains above their reference gain
                             alpha_i = weights_i * exp(eta * max(loss_i - reference_i, 0)) / sum_j (...)

then, for both, weights_i = (1 - c) * alpha_i + c / K (c = smoothing, K domains; LLaMA-MoE smooths its
sheared_llama with 1e-4 and not its _paper one: smoothing 0 there).

Which domain each sample of global step s comes from is drawn, for the whole global batch, from
the weights in force at step s with a generator seeded by (seed, s): counter-based, so the draw
of a step depends on nothing but the seed, the step and the schedule, and every data-parallel
rank takes its slice of the same draw. The schedule (`WeightSchedule`) is the list of
(first step, weights) entries; it goes into the checkpoint with the data position.

A new entry takes effect `lookahead` steps after the step whose end computed it: the loader has
already drawn the batches it prefetched (Lightning fetches one ahead; DataLoader workers
`prefetch_factor` each), and those must keep the weights they were drawn with, in an
uninterrupted run and in one resumed from that step alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from nxdt.config.errors import ConfigError


RULES = ("sheared_llama", "sheared_llama_paper")


def updated_weights(weights, losses, reference, eta: float, smoothing: float,
                    rule: str = "sheared_llama") -> np.ndarray:
    """The next weights by `rule` (module docstring), float64, summing to 1."""
    w = np.asarray(weights, dtype=np.float64)
    diff = np.asarray(losses, dtype=np.float64) - np.asarray(reference, dtype=np.float64)
    if rule == "sheared_llama":
        logits = np.log(w) + eta * diff
        alpha = np.exp(logits - logits.max())  # softmax, shifted: the same weights, no overflow
    elif rule == "sheared_llama_paper":
        alpha = w * np.exp(eta * np.maximum(diff, 0.0))
    else:
        raise ValueError(f"dynamic selection rule must be one of {RULES}, got {rule!r}")
    alpha /= alpha.sum()
    out = (1.0 - smoothing) * alpha + smoothing / len(w)
    return out / out.sum()


def draw_domains(seed: int, step: int, weights, count: int) -> np.ndarray:
    """The domain of each of the `count` samples of global step `step` (int64[count])."""
    cumulative = np.cumsum(np.asarray(weights, dtype=np.float64))
    u = np.random.default_rng([int(seed) % 2**32, int(step), 0x5E1EC7]).random(count) * cumulative[-1]
    return np.minimum(np.searchsorted(cumulative, u, side="right"), len(cumulative) - 1).astype(np.int64)


class WeightSchedule:
    """(first step, weights) entries, the first at step 0 with the blend's weights."""

    def __init__(self, initial) -> None:
        w = np.asarray(initial, dtype=np.float64)
        self.entries: list[tuple[int, np.ndarray]] = [(0, w / w.sum())]

    def weights_at(self, step: int) -> np.ndarray:
        current = self.entries[0][1]
        for first, weights in self.entries:
            if first > step:
                break
            current = weights
        return current

    @property
    def latest(self) -> np.ndarray:
        return self.entries[-1][1]

    def add(self, first_step: int, weights) -> None:
        if first_step <= self.entries[-1][0]:
            raise ValueError(f"schedule entries must start later than step {self.entries[-1][0]}, got {first_step}")
        self.entries.append((int(first_step), np.asarray(weights, dtype=np.float64)))

    def state(self) -> list[list]:
        return [[first, w.tolist()] for first, w in self.entries]

    @classmethod
    def from_state(cls, state) -> "WeightSchedule":
        schedule = cls(state[0][1])
        schedule.entries = [(int(first), np.asarray(w, dtype=np.float64)) for first, w in state]
        return schedule


@dataclass
class DomainDraw:
    """Each global step's domains, drawn from the weights in force at that step; a data-parallel
    rank takes its slice of the global batch (nxdt.data.logical_shards.LogicalShardSampler)."""

    schedule: WeightSchedule
    seed: int
    global_batch_size: int

    def domains(self, step: int) -> np.ndarray:
        return draw_domains(self.seed, step, self.schedule.weights_at(step), self.global_batch_size)


class DomainSelection:
    """The state of one run's dynamic selection: settings (`data.dynamic_selection`), the reference
    losses, the weight schedule and the last held-out losses. Checkpointed by the data module."""

    def __init__(self, names: list[str], reference: list[float], settings, weights, seed: int,
                 global_batch_size: int, rule: str = "sheared_llama") -> None:
        self.names, self.reference, self.rule = list(names), np.asarray(reference, dtype=np.float64), rule
        self.eta, self.smoothing = float(settings.eta), float(settings.smoothing)
        self.update_interval, self.eval_batches = int(settings.update_interval), int(settings.eval_batches)
        self.schedule = WeightSchedule(weights)
        self.draw = DomainDraw(self.schedule, int(seed), int(global_batch_size))
        self.losses: np.ndarray | None = None  # the last update's held-out loss per domain

    def due(self, steps_done: int) -> bool:
        """An update follows the step that makes `steps_done` a multiple of the interval."""
        return steps_done > 0 and steps_done % self.update_interval == 0

    def update(self, losses, first_step: int) -> np.ndarray:
        """New weights from the domains' held-out `losses`, in force from global step `first_step`."""
        self.losses = np.asarray(losses, dtype=np.float64)
        weights = updated_weights(self.schedule.latest, self.losses, self.reference, self.eta, self.smoothing,
                                  self.rule)
        self.schedule.add(first_step, weights)
        return weights

    def state(self) -> dict:
        return {"domains": list(self.names), "seed": self.draw.seed, "schedule": self.schedule.state(),
                "losses": None if self.losses is None else self.losses.tolist()}

    def load(self, state: dict) -> None:
        if list(state["domains"]) != self.names:
            raise ConfigError(f"data.dynamic_data_selection: the checkpoint's domains {list(state['domains'])} "
                              f"differ from this run's {self.names}")
        self.schedule.entries = WeightSchedule.from_state(state["schedule"]).entries
        self.draw.seed = int(state["seed"])
        self.losses = None if state.get("losses") is None else np.asarray(state["losses"], dtype=np.float64)
