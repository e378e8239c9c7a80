"""Reward functions as plug-ins, in TRL's calling convention, and the ones nxdt ships.

`model_alignment_strategy.grpo.reward_funcs: [my_pkg.rewards.accuracy, ...]` names functions

    f(prompts, completions, **columns) -> list[float | None]

called once per batch of completions: `prompts[i]` is the prompt completion i answers (a string
or chat messages, as the row gave it), `completions[i]` its decoded text, `completion_ids[i]` its
token ids, and every other column of the prompt rows comes by name (`answer=[...]`), one value per
completion. None means "no opinion" (TRL: NaN, left out of the weighted sum). Existing TRL reward
functions therefore work unchanged. A function that raises, or returns a list of the wrong length,
stops the run with one line naming it (`RewardError`); a path that does not import is a
ConfigError before anything starts (`load_reward_funcs`).

Shipped (nxdt.rl.rewards.*):
    accuracy        1.0 when the completion's final answer equals the row's `answer`: the content
                    of the last \\boxed{...}, else what follows the last '####', else the last number
    format_reward   1.0 when the completion matches a regex (`format_reward_pattern(...)` makes one
                    for another pattern); default: the answer as '#### <number>'
    length_penalty  -(completion tokens / 100): shorter is better
    token_fraction  the share of the completion's tokens with an id below 1000 (`token_fraction_of(lo, hi)`
                    for another range): a property a random tiny model already has sometimes, which
                    it learns quickly (the tests' and the demo's check that GRPO learns)
"""

from __future__ import annotations

import importlib
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

from nxdt.config.errors import ConfigError

RewardFn = Callable[..., list]


class RewardError(RuntimeError):
    """A reward function failed during the run: one line naming it."""


def load_reward_funcs(paths: Sequence[str], key: str = "model_alignment_strategy.grpo.reward_funcs") -> list[RewardFn]:
    """The functions at dotted paths `pkg.module.name`; ConfigError naming the path that does not import."""
    funcs = []
    for i, path in enumerate(paths):
        module_name, _, attr = str(path).rpartition(".")
        if not module_name:
            raise ConfigError(f"{key}[{i}]: {path!r} is not a dotted path pkg.module.function")
        try:
            module = importlib.import_module(module_name)
        except Exception as err:  # noqa: BLE001 - any import failure is the user's path
            raise ConfigError(f"{key}[{i}]: cannot import {module_name!r} ({type(err).__name__}: "
                              f"{str(err).splitlines()[0] if str(err) else ''})") from None
        fn = getattr(module, attr, None)
        if not callable(fn):
            raise ConfigError(f"{key}[{i}]: {module_name!r} has no function {attr!r}")
        funcs.append(fn)
    return funcs


def reward_name(fn: RewardFn) -> str:
    return getattr(fn, "__name__", None) or type(fn).__name__


def call_rewards(funcs: Sequence[RewardFn], prompts: list, completions: list[str], completion_ids: list[list[int]],
                 columns: dict[str, list]) -> list[list[float]]:
    """rewards[f][i] of every function for every completion (None → NaN); RewardError naming a
    function that raises or returns other than one number (or None) per completion."""
    out = []
    for fn in funcs:
        name = reward_name(fn)
        try:
            values = fn(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
        except Exception as err:  # noqa: BLE001 - reported with the function's name
            raise RewardError(f"reward function {name} raised {type(err).__name__}: "
                              f"{str(err).splitlines()[0] if str(err) else ''}") from None
        try:
            values = list(values)
        except TypeError:
            raise RewardError(f"reward function {name} returned {type(values).__name__}, expected a list of "
                              f"{len(completions)} floats") from None
        if len(values) != len(completions):
            raise RewardError(f"reward function {name} returned {len(values)} values for {len(completions)} "
                              "completions")
        row = []
        for v in values:
            if v is None:
                row.append(math.nan)
            elif isinstance(v, (int, float)) and not isinstance(v, bool) or hasattr(v, "__float__"):
                row.append(float(v))
            else:
                raise RewardError(f"reward function {name} returned a {type(v).__name__}, expected float or None")
        out.append(row)
    return out


# ---- shipped rewards ------------------------------------------------------------------------
_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?")


def _boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} (nested braces allowed), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j].strip()
    return None


def final_answer(text: str) -> str | None:
    """The answer a completion gives: the last \\boxed{}, else what follows the last '####', else its
    last number; numbers normalised ('1,000' → '1000', '3.0' → '3')."""
    boxed = _boxed(text)
    if boxed is None and "####" in text:
        boxed = text.rsplit("####", 1)[1].strip().split("\n")[0].strip()
    candidate = boxed if boxed is not None else text
    numbers = _NUMBER.findall(candidate)
    if numbers:
        return _normal_number(numbers[-1] if boxed is None else numbers[0])
    return boxed or None


def _normal_number(s: str) -> str:
    s = s.replace(",", "")
    try:
        value = float(s)
    except ValueError:
        return s
    return str(int(value)) if value.is_integer() else repr(value)


def accuracy(prompts, completions, answer, **_: Any) -> list[float]:
    """1.0 when the completion's final answer equals the row's `answer` (both normalised), else 0.0."""
    out = []
    for text, truth in zip(completions, answer):
        got = final_answer(str(text))
        want = final_answer(str(truth)) if truth is not None else None
        out.append(1.0 if got is not None and got == want else 0.0)
    return out


def format_reward_pattern(pattern: str) -> RewardFn:
    """A reward: 1.0 for completions that match `pattern` (re.search, DOTALL), else 0.0."""
    compiled = re.compile(pattern, re.DOTALL)

    def format_reward(prompts, completions, **_: Any) -> list[float]:
        return [1.0 if compiled.search(str(c)) else 0.0 for c in completions]

    return format_reward


format_reward = format_reward_pattern(r"####\s*-?\d")


def length_penalty(prompts, completions, completion_ids=None, **_: Any) -> list[float]:
    """-(completion tokens / 100) (characters / 100 when no token ids are given)."""
    lengths = [len(ids) for ids in completion_ids] if completion_ids is not None else [len(c) for c in completions]
    return [-n / 100.0 for n in lengths]


def token_fraction_of(low: int, high: int) -> RewardFn:
    """A reward: the share of a completion's tokens with low <= id < high."""

    def token_fraction(prompts, completions, completion_ids, **_: Any) -> list[float]:
        return [sum(low <= t < high for t in ids) / max(len(ids), 1) for ids in completion_ids]

    return token_fraction


token_fraction = token_fraction_of(0, 1000)
