"""`doc()`: a schema field with its default, its one line of help and its metadata (range, flags).

Shared by the schema modules (`nxdt.config.schema`, `nxdt.config.schema_finetuning`); see the
conventions in `nxdt.config.schema`. Standard library only.
"""

import copy
from dataclasses import field, is_dataclass
from typing import Any


def doc(default: Any, help: str, **meta: Any) -> Any:
    """A dataclass field with a default and a one-line description (`help`)."""
    metadata = {"help": help, **meta}
    if isinstance(default, type) and is_dataclass(default):
        return field(default_factory=default, metadata=metadata)
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: copy.deepcopy(d), metadata=metadata)
    return field(default=default, metadata=metadata)
