"""The progress bar of a training run, counted in optimizer steps, with a rate and an ETA that
stay right for slow steps (Rich's own speed needs two updates within 30 s, so a 7B step of a
minute showed `0.00it/s`) and after a resume.

After a resume the bar counts the run, not the launch: its total is the run's max_steps and its
position the run's step (`trainer.global_step`), so a run resumed at step 59 of 100 shows 59/100,
then 60/100. Lightning's own bar counted this launch's batches against the loader's length and
the restored batch index (`62/59 ... ETA -1:59:56`). The rate is measured over this launch's
steps only (the steps done before it took no time here), so the ETA is the steps left at the
rate of this launch. A run bounded by epochs only (max_steps -1) keeps Lightning's count.

Where stdout is not a terminal (a Slurm `.out`, `nohup`, CI, `make demo > demo.log`), or with
`trainer.enable_progress_bar=false`, there is no bar (Rich's bar in a file printed once, at the
end, wrapped): `ProgressLines` prints one plain line instead every `trainer.log_every_n_steps`
steps, the steps whose scalars the loggers write, and at the run's last step:

    step 20/300  loss 6.1234  lr 3.00e-04  tok/s 1,234  MFU 12.3%  1.22 s/step  ETA 0:05:42
"""

from __future__ import annotations

import sys
import time

from lightning.pytorch.callbacks import Callback, RichProgressBar
from rich.progress import ProgressColumn, TimeElapsedColumn
from rich.text import Text


def format_duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}"


class StepRateColumn(ProgressColumn):
    """`1.52 step/s` or `12.3 s/step`, and the time left, from this bar's own steps and clock."""

    def __init__(self, style=None) -> None:
        super().__init__()
        self.style = style
        self._first: dict = {}  # task id -> (completed, elapsed) when first seen with a step done

    def rate(self, task) -> float | None:
        """Steps per second since the first step this bar saw finish (the first step, with its
        warm-up, data start and compile, is the baseline rather than counted)."""
        if task.elapsed is None or task.completed < 1:
            return None
        first = self._first.setdefault(task.id, (task.completed, task.elapsed))
        steps, seconds = task.completed - first[0], task.elapsed - first[1]
        return steps / seconds if steps > 0 and seconds > 0 else None

    def rate_baseline_reset(self, task) -> None:
        """Forget the baseline of a task that was restarted (Rich's reset: elapsed back to 0)."""
        first = self._first.get(task.id)
        if first is not None and task.elapsed is not None and (task.elapsed < first[1] or task.completed < first[0]):
            del self._first[task.id]

    def render(self, task) -> Text:
        self.rate_baseline_reset(task)
        rate = self.rate(task)
        if rate is None:
            return Text("-- step/s  ETA --", style=self.style)
        speed = f"{rate:.2f} step/s" if rate >= 1 else f"{1 / rate:.1f} s/step"
        left = f"  ETA {format_duration((task.total - task.completed) / rate)}" if task.total else ""
        return Text(speed + left, style=self.style)


def bar_total(trainer) -> int | float:
    """The bar's total: the run's max_steps; Lightning's batch count for a run bounded by epochs only."""
    return trainer.max_steps if trainer.max_steps is not None and trainer.max_steps > 0 else trainer.num_training_batches


def bar_position(trainer, batch_idx: int) -> int:
    """The bar's position after batch `batch_idx` of this epoch: the run's optimizer steps done
    (one batch is one step); batch_idx + 1 for a run bounded by epochs only."""
    return trainer.global_step if trainer.max_steps is not None and trainer.max_steps > 0 else batch_idx + 1


class StepProgressBar(RichProgressBar):
    """Rich progress bar counted in optimizer steps (Lightning's shows 'Epoch 0/-2' for step-bounded runs)."""

    @property
    def total_train_batches(self) -> int | float:
        return bar_total(self.trainer)

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        if self.train_progress_bar_id is not None and bar_total(trainer) == trainer.max_steps:
            return  # one bar for the whole run: a new epoch does not restart it
        super().on_train_epoch_start(trainer, pl_module)
        self._update(self.train_progress_bar_id, bar_position(trainer, -1))  # a resumed run starts where it was

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not self.is_disabled and self.train_progress_bar_id is None:
            self._initialize_train_progress_bar_id()  # a mid-epoch resume (as Lightning's)
        self._update(self.train_progress_bar_id, bar_position(trainer, batch_idx))
        self._update_metrics(trainer, pl_module)
        self.refresh()

    def _get_train_description(self, current_epoch: int) -> str:
        return "train (steps)"

    def configure_columns(self, trainer) -> list:
        columns = super().configure_columns(trainer)
        # Lightning's last two columns are elapsed • remaining and batches/s, both from Rich's
        # 30 s speed window: elapsed, then our rate and ETA instead
        return [*columns[:-2], TimeElapsedColumn(), StepRateColumn(style=self.theme.processing_speed)]

    def get_metrics(self, trainer, pl_module):
        metrics = super().get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)
        pretty = {}
        for key, value in metrics.items():
            if key == "throughput":
                pretty["tok/s"] = f"{float(value):,.0f}"
            elif key == "reduced_train_loss":
                pretty["loss"] = f"{float(value):.4f}"
            elif key == "mfu":
                pretty["MFU"] = f"{float(value):.1f}%"
            else:
                pretty[key] = value
        return pretty


def shows_bar(cfg) -> bool:
    """The Rich bar only where a person watches a terminal; `ProgressLines` elsewhere."""
    return bool(cfg.trainer.enable_progress_bar) and sys.stdout.isatty()


class ProgressLines(Callback):
    """One plain line on rank 0 every `trainer.log_every_n_steps` optimizer steps (and at the last):
    step/max_steps, loss, lr, tokens/s, MFU, step time and ETA, flushed at once (`tail -f` sees it).
    The rate and ETA are this launch's, from its steps after its first (as the bar's)."""

    def __init__(self) -> None:
        self._first: tuple[int, float] | None = None  # (steps done, clock) when this launch's first step ended

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step, now = bar_position(trainer, batch_idx), time.perf_counter()
        if self._first is None:
            self._first = (step, now)
        every = trainer.log_every_n_steps
        last = trainer.max_steps is not None and 0 < trainer.max_steps <= step
        if not trainer.is_global_zero or not (last or (every > 0 and step % every == 0)):
            return
        print(self.line(trainer, step, now), flush=True)

    def line(self, trainer, step: int, now: float) -> str:
        total = bar_total(trainer)
        metrics = trainer.progress_bar_metrics
        parts = [f"step {step}/{total}" if total and total != float("inf") else f"step {step}"]
        for key, label, fmt in (("reduced_train_loss", "loss", "{:.4f}"), ("lr", "lr", "{:.2e}"),
                                ("throughput", "tok/s", "{:,.0f}"), ("mfu", "MFU", "{:.1f}%")):
            value = metrics.get(key, trainer.callback_metrics.get(key))
            if value is not None:
                parts.append(f"{label} {fmt.format(float(value))}")
        steps, seconds = step - self._first[0], now - self._first[1]
        if steps > 0 and seconds > 0:
            rate = steps / seconds
            parts.append(f"{rate:.2f} step/s" if rate >= 1 else f"{1 / rate:.2f} s/step")
            if total and total != float("inf"):
                parts.append(f"ETA {format_duration(max(total - step, 0) / rate)}")
        return "  ".join(parts)
