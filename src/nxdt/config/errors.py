"""The one exception type for bad user input (config, data file, checkpoint, CLI).

Entry points catch it, print `error: <message>` as one line on stderr and exit 2; `ConfigErrors`
(several problems found together, e.g. every missing path) as a first line and a line each.
Set HYDRA_FULL_ERROR=1 (or NXDT_FULL_ERROR=1) to see the traceback instead.
"""


class ConfigError(Exception):
    """A user-facing error: the message names what is wrong and where (dotted key path, file, line)."""

    exit_code = 2


class ConfigErrors(ConfigError):
    """Several problems found together (every missing path of a config at once): the message is a
    first line saying how many, then one line per problem; entries print it line by line."""

    def __init__(self, headline: str, problems: list[str]) -> None:
        self.headline, self.problems = headline, list(problems)
        super().__init__("\n".join([headline, *(f"  {p}" for p in self.problems)]))
