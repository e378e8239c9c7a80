"""Config: compose (Hydra), the schema, its checks (unknown keys, types, ranges, values not
supported yet), the inert-key and env-var tables. Imports nothing heavy. What the values mean
together (layout, cross-checks) is nxdt.spec, which runs these checks first.

Public API:
    compose(argv, default_config_dir=None, default_config_name=None, notices=None) -> DictConfig
    config_from_dict(values) -> NxdtConfig  (schema-checked; nxdt.spec.config_from_dict cross-checks)
    to_yaml(cfg) -> str  (the resolved, rerunnable YAML of a typed config)
    apply_env(cfg, environ=os.environ, is_xla=None) -> list[str]  (inert keys off XLA)
    main_guard(fn), describe(section=None), ConfigError
"""

from nxdt.config.env import apply_env, format_inert
from nxdt.config.errors import ConfigError
from nxdt.config.inert import NOT_SUPPORTED_YET, describe
from nxdt.config.load import compose, config_from_dict, main_guard, report
from nxdt.config.schema import NxdtConfig
from nxdt.config.typed import to_yaml

__all__ = [
    "ConfigError", "NOT_SUPPORTED_YET", "NxdtConfig", "apply_env", "compose", "config_from_dict", "describe",
    "format_inert", "main_guard", "report", "to_yaml",
]
