"""The one exception type for bad user input (config, data file, checkpoint, CLI).

Entry points catch it, print `error: <message>` as one line on stderr and exit 2.
Set HYDRA_FULL_ERROR=1 (or NXDT_FULL_ERROR=1) to see the traceback instead.
"""


class ConfigError(Exception):
    """A user-facing error: the message names what is wrong and where (dotted key path, file, line)."""

    exit_code = 2
