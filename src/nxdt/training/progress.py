"""The progress bar of a training run, counted in optimizer steps."""

from __future__ import annotations

from lightning.pytorch.callbacks import RichProgressBar


class StepProgressBar(RichProgressBar):
    """Rich progress bar counted in optimizer steps (Lightning's shows 'Epoch 0/-2' for step-bounded runs)."""

    def _get_train_description(self, current_epoch: int) -> str:
        return "train (steps)"

    def get_metrics(self, trainer, pl_module):
        metrics = super().get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)
        pretty = {}
        for key, value in metrics.items():
            if key == "throughput":
                pretty["tok/s"] = f"{float(value):,.0f}"
            elif key == "reduced_train_loss":
                pretty["loss"] = f"{float(value):.4f}"
            else:
                pretty[key] = value
        return pretty
