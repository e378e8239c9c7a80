"""The run's time estimate, printed once "when the first steps are timed" (LLaMA-MoE prints its
ETA at the start of a run): one line on rank 0 with the seconds per step measured, the time the
remaining steps and the whole fit will take, and the wall-clock finish.

    timing: 0.84 s/step over steps 2-6 -> 1:09:55 for the 4994 steps left, 1:10:04 for the whole run (ETA 14:32)

Rule: a fit's first optimizer step is warm-up (data workers, compile or graph trace, allocator
growth) and is not counted; the next TIMED_STEPS steps are, and the line is printed when the last
of them ends. The step times are ThroughputMonitor's (nxdt.observability.callbacks: from batch start
to batch end, so data loading between steps, validation and checkpoint saves are not in them).

Printed at most once per run: a fit resumed at step >= 1 + TIMED_STEPS does not print (the fit
before it got that far, so it printed, or its own resume did); a fit resumed earlier prints,
timed from its own first step. Not printed when max_steps comes before or with the last timed
step (nothing left to estimate).
"""

from __future__ import annotations

import time

from nxdt.observability.progress import format_duration

TIMED_STEPS = 5
"""Optimizer steps timed for the estimate, after the fit's first (its warm-up)."""


class FirstStepsTiming:
    """Collects one fit's step times; `add` returns the timing line once, after the timed steps."""

    def __init__(self, timed: int = TIMED_STEPS) -> None:
        self.timed = timed
        self.start: int | None = None  # optimizer steps done when the fit began (> 0: resumed)
        self.times: list[float] = []  # this fit's step times, its first (warm-up) step included
        self.done = False

    def add(self, steps_done: int, step_time: float, max_steps: int, now: float) -> str | None:
        """One optimizer step ended: `steps_done` counts it (trainer.global_step after the step),
        `now` is the wall clock (time.time()). The line when this step is the last timed one and
        steps remain, else None."""
        if self.done:
            return None
        if self.start is None:
            self.start = steps_done - 1
            if self.start >= 1 + self.timed:  # resumed past the window: printed before
                self.done = True
                return None
        self.times.append(step_time)
        if len(self.times) < 1 + self.timed:
            return None
        self.done = True
        left = max_steps - steps_done
        if max_steps <= 0 or left <= 0:  # the run ends here: nothing to estimate
            return None
        per_step = sum(self.times[1:]) / self.timed
        return timing_line(per_step, steps_done - self.timed + 1, steps_done, left, sum(self.times),
                           resumed_at=self.start, now=now)


def timing_line(per_step: float, first: int, last: int, left: int, spent: float, resumed_at: int,
                now: float) -> str:
    """`per_step` seconds measured over steps `first`-`last` (1-based); `left` steps remain;
    `spent`: this fit's step time so far (its warm-up step included); `resumed_at`: steps done
    when the fit began."""
    remaining = per_step * left
    whole = "the whole run" if resumed_at == 0 else f"this fit (steps {resumed_at + 1}-{last + left})"
    return (f"timing: {per_step:.3g} s/step over steps {first}-{last} -> {format_duration(remaining)} for the "
            f"{left} steps left, {format_duration(spent + remaining)} for {whole} (ETA {finish(now, remaining)})")


def finish(now: float, seconds: float) -> str:
    """The local wall-clock time `seconds` after `now`: '14:32' today, 'Tue 03 Jun 14:32' later."""
    end = time.localtime(now + seconds)
    same_day = time.strftime("%Y%m%d", end) == time.strftime("%Y%m%d", time.localtime(now))
    return time.strftime("%H:%M" if same_day else "%a %d %b %H:%M", end)
