"""LoRA for a run (model_alignment_strategy.peft): adapters added to the built model from the config,
the run summary's line, and the pre-flight check that names a bad target before any process starts.

The adapters themselves are nxdt.models.lora (plain PyTorch); NxdtLightningModule adds them right
after building the model, before the precision conversion and the parallel plan (which shards
each adapter like its base linear, nxdt.parallel.tensor_parallel).
"""

from __future__ import annotations

import torch

from nxdt.config.errors import ConfigError
from nxdt.models import build_model
from nxdt.models.lora import inject_lora, lora_parameter_counts


def add_lora(model: torch.nn.Module, peft) -> str:
    """Wrap `model`'s target linears with adapters (`peft`: the PeftConfig) and freeze the rest.
    Returns the summary line: trainable vs total parameters (and, with lora_verbose, the targets)."""
    wrapped = inject_lora(model, peft.target_modules, peft.lora_rank, peft.lora_alpha, peft.lora_dropout,
                          peft.lora_bias, peft.target_parameters, peft.modules_to_save)
    trainable, total = lora_parameter_counts(model)
    line = (f"rank={peft.lora_rank} alpha={peft.lora_alpha:g}  trainable {trainable:,} of {total:,} parameters "
            f"({100 * trainable / max(total, 1):.3f}%)")
    if peft.lora_verbose:
        leaves = sorted({path.rpartition(".")[2] for path in wrapped})
        line += f"  adapters on {len(wrapped)} linears or expert weights ({', '.join(leaves)}), " \
                f"lora_bias={peft.lora_bias}"
        if peft.modules_to_save:
            line += f", trained in full: {', '.join(peft.modules_to_save)} (modules_to_save)"
    return line


def check_lora_targets(spec, vocab_size: int | None) -> None:
    """Pre-flight: the target modules exist in the model the run spec's config builds (a meta-device
    build: nothing allocated). ConfigError naming the key and the valid names otherwise."""
    cfg, peft = spec.cfg, spec.alignment.peft
    if peft is None:
        return
    try:
        add_lora(build_model(cfg, vocab_size, device="meta"), peft)
    except ValueError as err:
        raise ConfigError(str(err)) from None
