"""nxdt: config-driven, device-neutral training of Llama-family LLMs.

Importing this package imports nothing heavy: `nxdt.config` must be usable
before torch (or torch-xla) is imported, so that config-derived environment
variables can be set first.
"""

__version__ = "0.1.0"
