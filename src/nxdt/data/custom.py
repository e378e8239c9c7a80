"""`data.data_module: package.module.ClassName`: load a user's LightningDataModule by class path.

The contract (see docs/data.md and examples/custom_data_module.py):
- a `lightning.pytorch.LightningDataModule` subclass, constructed as `Cls(cfg, trainer)`;
- it has `vocab_size` (the model is sized from it), or `model.vocab_size` is set;
- its `train_dataloader()` yields dicts with `input_ids`, `labels` LongTensor[B, S], `loss_mask`
  FloatTensor[B, S], optional `position_ids`, with B = global_batch_size // dp size (one global
  step's share for this rank: `trainer.strategy.dp_rank` / `dp_size`); it resumes at
  `trainer.lightning_module.consumed_samples` (or keeps its position in `state_dict()`);
- keys under `data:` that nxdt does not know are free for it to read: they arrive as the plain
  dict `cfg.data.custom` (the rest of `cfg` is the typed `nxdt.config.schema.NxdtConfig`).

The module is imported from `sys.path`, with the working directory added at the end.
"""

from __future__ import annotations

import importlib
import os
import sys

import lightning.pytorch as pl

from nxdt.config.errors import ConfigError


def import_class(path: str, key: str = "data.data_module"):
    """The class named 'package.module.ClassName'; each failure is one ConfigError line."""
    module_name, _, class_name = str(path).rpartition(".")
    if not module_name or not class_name:
        raise ConfigError(f"{key}: expected 'package.module.ClassName', got '{path}'")
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.append(cwd)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        raise ConfigError(f"{key}: cannot import module '{module_name}' for '{path}' ({err})") from None
    except Exception as err:  # noqa: BLE001 - the user's module failed while importing
        raise ConfigError(f"{key}: importing '{module_name}' failed: {type(err).__name__}: {err}") from err
    cls = getattr(module, class_name, None)
    if cls is None:
        raise ConfigError(f"{key}: module '{module_name}' ({getattr(module, '__file__', '?')}) "
                          f"has no class '{class_name}'")
    return cls


def custom_datamodule_class(path: str):
    """The class `data.data_module` names, imported and checked to be a LightningDataModule (ConfigError)."""
    cls = import_class(path)
    if not (isinstance(cls, type) and issubclass(cls, pl.LightningDataModule)):
        raise ConfigError(f"data.data_module: '{path}' is not a lightning.pytorch.LightningDataModule subclass")
    return cls


def build_custom_datamodule(cfg, trainer):
    """Import `cfg.data.data_module`, check it is a LightningDataModule, build it as Cls(cfg, trainer)."""
    path = cfg.data.data_module
    module = custom_datamodule_class(path)(cfg, trainer)
    if getattr(module, "vocab_size", None) is None:
        vocab = cfg.model.vocab_size
        if vocab is None:
            raise ConfigError(f"data.data_module: '{path}' has no vocab_size attribute; set it in the module "
                              "or set model.vocab_size")
        module.vocab_size = int(vocab)
    return module
