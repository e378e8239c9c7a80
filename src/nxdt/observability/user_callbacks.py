"""The callbacks a config adds to nxdt's own: the profiler (`exp_manager.profiler`,
nxdt.observability.profiler) and the user's `trainer.callbacks`, each `{_target_: pkg.module.Class, <kwargs>}`.

User callbacks are built with `hydra.utils.instantiate` (so `_args_`, nested `_target_`s and
`_partial_` work as in Hydra) before anything is written or any process group starts, so a bad
entry is one line, exit 2: the module or class not found, not a `lightning.pytorch.Callback`,
arguments the class does not take, or its constructor failing. The module is imported from
`sys.path` with the working directory added (as `data.data_module`). They run after nxdt's own
callbacks and before its checkpoint callback; the profiler runs first (nxdt.training.trainer.train).
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any, Mapping

from hydra.errors import InstantiationException
from hydra.utils import instantiate
from lightning.pytorch.callbacks import Callback

from nxdt.config.errors import ConfigError
from nxdt.data.custom import import_class
from nxdt.observability.profiler import StepProfiler


def build_user_callbacks(entries: list[Any]) -> list[Callback]:
    return [_build(entry, f"trainer.callbacks[{i}]") for i, entry in enumerate(entries)]


def _build(entry: Any, key: str) -> Callback:
    target = entry.get("_target_") if isinstance(entry, Mapping) else None
    if not isinstance(target, str):
        raise ConfigError(f"{key}: expected {{_target_: package.module.ClassName, <arguments>}}, got {entry!r}")
    cls = import_class(target, key)  # module / class not found: one line naming the key
    kwargs = {name: value for name, value in entry.items() if not name.startswith("_")}
    if isinstance(cls, type) and not entry.get("_partial_", False):
        try:
            inspect.signature(cls).bind(*entry.get("_args_", []), **kwargs)
        except TypeError as err:  # "got an unexpected keyword argument 'x'", "missing a required argument"
            raise ConfigError(f"{key}: {target}: {err}") from None
        except ValueError:  # no signature to read (a C type): instantiate says what is wrong
            pass
    try:
        # plain dicts and lists for the constructor, not OmegaConf containers (unless the entry asks)
        callback = instantiate(entry, **({} if "_convert_" in entry else {"_convert_": "all"}))
    except InstantiationException as err:
        cause = err.__cause__ or err
        raise ConfigError(f"{key}: building {target} failed: {type(cause).__name__}: {cause}") from None
    if not isinstance(callback, Callback):
        raise ConfigError(f"{key}: {target} built a {type(callback).__name__}, not a lightning.pytorch.Callback "
                          "(subclass lightning.pytorch.Callback, not pytorch_lightning's)")
    return callback


def extra_callbacks(cfg, log_dir: Path, world_size: int, global_rank: int) -> tuple[list[Callback], list[Callback]]:
    """The callbacks a config adds to nxdt's own, checked and built before anything is written:
    ([the profiler] if exp_manager.profiler.enabled, the user's trainer.callbacks)."""
    profiler: list[Callback] = []
    if cfg.exp_manager.profiler.enabled:
        profiler.append(StepProfiler(cfg.exp_manager.profiler, log_dir / "profiler", world_size, global_rank))
    return profiler, build_user_callbacks(cfg.trainer.callbacks)
