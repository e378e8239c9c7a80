"""OmegaConf resolvers used by nxdt configs. `register()` is idempotent.

- `${multiply:a,b,...}`: product (NxDT writes `model_parallel_size: ${multiply:tp, pp}`).
- `${nxdt_asset:NAME}`: absolute path of `src/nxdt/assets/NAME` in the installed package
  (bundled tokenizer, corpus), e.g. `tokenizer.type: ${nxdt_asset:tokenizer}`.
- `${nxdt_conf:REL}`: absolute path of `REL` relative to the directory of the config being
  composed (set by `nxdt.config.load.compose`); when the file is not there, relative to nxdt's
  shipped `conf/` directory instead (so a copied YAML still finds
  `${nxdt_conf:model_configs/llama3_8B/config.json}`). `NXDT_CONF_DIR` overrides the shipped dir.
"""

from __future__ import annotations

import os
from pathlib import Path

from omegaconf import OmegaConf

ASSETS_DIR = Path(__file__).resolve().parents[1] / "assets"
# src/nxdt/config/resolvers.py -> repository root is parents[3]
_REPO_CONF_DIR = Path(__file__).resolve().parents[3] / "conf"

# The directory of the config currently being composed (set by load.compose).
_current_config_dir: Path | None = None


def shipped_conf_dir() -> Path:
    """nxdt's own conf/ directory (the repository's, or $NXDT_CONF_DIR)."""
    env = os.environ.get("NXDT_CONF_DIR")
    return Path(env).resolve() if env else _REPO_CONF_DIR


def set_config_dir(path: str | os.PathLike | None) -> None:
    """Tell `${nxdt_conf:...}` which directory the composed config came from."""
    global _current_config_dir
    _current_config_dir = Path(path).resolve() if path is not None else None


def asset_path(name: str) -> str:
    return str(ASSETS_DIR / str(name))


def conf_path(rel: str) -> str:
    rel = str(rel)
    if os.path.isabs(rel):
        return rel
    if _current_config_dir is not None:
        candidate = _current_config_dir / rel
        if candidate.exists():
            return str(candidate)
    return str(shipped_conf_dir() / rel)


def _multiply(*args):
    result = 1
    for a in args:
        result = result * a
    return result


RESOLVERS = {
    "multiply": _multiply,
    "nxdt_asset": asset_path,
    "nxdt_conf": conf_path,
}


def register() -> None:
    """Register nxdt's resolvers (safe to call any number of times)."""
    for name, fn in RESOLVERS.items():
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)
