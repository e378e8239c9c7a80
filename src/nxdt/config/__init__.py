"""Config: compose (Hydra), schema, validation, layout, env vars. Imports nothing heavy.

Public API:
    load_config(argv, world_size=None, check_paths=True, check_supported=True) -> NxdtConfig (typed)
    compose(argv, default_config_dir=None, default_config_name=None, notices=None) -> DictConfig
    validate(cfg, world_size=None, check_paths=True, check_supported=True, notices=None) -> NxdtConfig
    config_from_dict(values, world_size=None, check=False) -> NxdtConfig  (a saved YAML, tests)
    to_yaml(cfg) -> str  (the resolved, rerunnable YAML of a typed config)
    compute_layout(cfg, world_size=None) -> Layout
    apply_env(cfg, environ=os.environ, is_xla=None) -> list[str]  (inert keys off XLA)
    main_guard(fn), describe(section=None), ConfigError
"""

from nxdt.config.env import apply_env, format_inert
from nxdt.config.errors import ConfigError
from nxdt.config.layout import Layout, compute_layout
from nxdt.config.load import compose, config_from_dict, load_config, main_guard, report
from nxdt.config.schema import NxdtConfig, describe
from nxdt.config.typed import to_yaml
from nxdt.config.validate import NOT_SUPPORTED_YET, validate

__all__ = [
    "ConfigError", "Layout", "NOT_SUPPORTED_YET", "NxdtConfig", "apply_env", "compose", "compute_layout",
    "config_from_dict", "describe", "format_inert", "load_config", "main_guard", "report", "to_yaml", "validate",
]
