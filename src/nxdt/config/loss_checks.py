"""`model.fusions.cross_entropy_chunk_size`: where the chunked output layer + cross entropy is built.

It runs inside nxdt's native model (nxdt.models.chunked_loss), on the next-token loss, with any
data parallelism, context parallelism and tensor parallelism (the output layer vocabulary-parallel,
with or without sequence parallel). Elsewhere it is refused as not supported yet: a pipeline's last
stage computes its loss inside the schedule; transformers' models and the preference losses (which
need per-sequence log-probs) take logits.
"""

from __future__ import annotations

from typing import Any

from nxdt.config.alignment import alignment_of
from nxdt.config.errors import ConfigError

KEY = "model.fusions.cross_entropy_chunk_size"


def check_loss_chunking(cfg: Any, layout: Any) -> None:
    if not cfg.model.fusions.cross_entropy_chunk_size:
        return
    alignment = alignment_of(cfg)
    why = ("model_source=hf (transformers' models compute their own logits)" if cfg.model_source == "hf" else
           "distributed_strategy.pipeline_model_parallel_size > 1 (the last stage's loss runs inside the "
           "pipeline schedule)" if layout.pp > 1 else
           "DPO / ORPO (their losses take per-sequence log-probs from the logits)" if alignment.preference is not None
           else None)
    if why is not None:
        raise ConfigError(f"{KEY} with {why} is not supported yet; leave it null there")
