"""The training side of `data.dynamic_data_selection`: measure each domain's held-out loss every
`update_interval` steps and hand it to the data module, which moves the weights
(nxdt.data.dynamic_selection has the formula; nxdt.data.logical_shards draws the batches).

The held-out loss is the validation loss of the domain's fixed held-out batches, computed the way
validation computes it (`NxdtLightningModule._eval_loss`: every layout, reduced over dp x cp), so
every rank gets the same numbers and the same new weights. Logged per domain:
`data/weight/<domain>` (the weights the step was drawn with) every step, `data/loss/<domain>` at
each update.

The callback runs before the checkpoint callback, so a checkpoint written at an update step holds
the new weights.
"""

from __future__ import annotations

import torch
from lightning.pytorch.callbacks import Callback


class DynamicDataSelection(Callback):
    """Updates the blend's weights of a data module that has a `selection` (see the module doc)."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        datamodule = trainer.datamodule
        selection = getattr(datamodule, "selection", None)
        if selection is None:
            return
        steps_done = trainer.global_step
        weights = selection.schedule.weights_at(steps_done - 1)  # the step just trained
        for name, w in zip(selection.names, weights):
            pl_module.log_step_scalar(f"data/weight/{name}", float(w))
        if not selection.due(steps_done) or steps_done >= trainer.max_steps:
            return
        losses = [domain_loss(pl_module, datamodule.heldout_batches(d)) for d in range(len(selection.names))]
        datamodule.update_selection(losses, steps_done)
        for name, loss in zip(selection.names, losses):
            pl_module.log_step_scalar(f"data/loss/{name}", loss)


@torch.no_grad()
def domain_loss(module, batches) -> float:
    """The mean validation loss of a domain's held-out batches (every rank calls this in step)."""
    was_training = module.training
    module.eval()
    try:
        losses = [module._eval_loss({k: v.to(module.device) for k, v in b.items()}) for b in batches]
    finally:
        module.train(was_training)
        module.eval_tally.reset()  # the validation tally is for validation runs only
    return float(torch.stack([torch.as_tensor(x, dtype=torch.float64) for x in losses]).mean())
