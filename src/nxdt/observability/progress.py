"""The progress bar of a training run, counted in optimizer steps, with a rate and an ETA that
stay right for slow steps (Rich's own speed needs two updates within 30 s, so a 7B step of a
minute showed `0.00it/s`) and after a resume (the steps done before it are not counted in)."""

from __future__ import annotations

from lightning.pytorch.callbacks import RichProgressBar
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

    def render(self, task) -> Text:
        rate = self.rate(task)
        if rate is None:
            return Text("-- step/s  ETA --", style=self.style)
        speed = f"{rate:.2f} step/s" if rate >= 1 else f"{1 / rate:.1f} s/step"
        left = f"  ETA {format_duration((task.total - task.completed) / rate)}" if task.total else ""
        return Text(speed + left, style=self.style)


class StepProgressBar(RichProgressBar):
    """Rich progress bar counted in optimizer steps (Lightning's shows 'Epoch 0/-2' for step-bounded runs)."""

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
