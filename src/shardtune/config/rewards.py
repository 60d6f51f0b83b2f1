"""Reward functions of stage grpo, named in ``reward_funcs`` as ``module:function``, ``path/to/file.py:function``, a
built-in name or a reward model folder (stage rm's output, scored by train/reward_model_scorer.py); resolved the
same way on the launching host (to refuse a missing one before any rank starts) and on every rank. A reward
function takes the prompts, the completions and the rows' other columns as keyword arguments (TRL's signature) and
returns one float per completion.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import re
import sys
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from shardtune.errors import ConfigError

RewardFunction = Callable[..., list[float]]


def answer_match(prompts: Sequence[str], completions: Sequence[str], answer: Sequence[str], **_: Any
                 ) -> list[float]:
    """1.0 where the completion, stripped of surrounding whitespace, is the row's ``answer`` (the data's answer
    turn, or a column of that name), else 0.0."""
    return [float(c.strip() == str(a).strip()) for c, a in zip(completions, answer, strict=True)]


def format_match(prompts: Sequence[str], completions: Sequence[str], *, pattern: str, **_: Any) -> list[float]:
    """1.0 where the whole completion matches ``reward_format_regex`` (``re.fullmatch``, DOTALL), else 0.0."""
    compiled = re.compile(pattern, re.DOTALL)
    return [float(compiled.fullmatch(c) is not None) for c in completions]


BUILTIN_REWARDS = ("answer_match", "format_match")


def load_reward_function(spec: str, format_regex: str | None = None) -> RewardFunction:
    """The callable ``spec`` names; ConfigError (naming ``reward_funcs`` and the spec) when it cannot be found."""
    if spec == "answer_match":
        return answer_match
    if spec == "format_match":
        if not format_regex:
            raise ConfigError("reward_funcs (format_match) needs reward_format_regex: the pattern a completion must "
                              "match")
        return partial(format_match, pattern=format_regex)
    module_name, sep, attribute = spec.rpartition(":")
    if not sep or not module_name or not attribute:
        raise ConfigError(f"reward_funcs ({spec}): write module:function, path/to/file.py:function or one of "
                          f"{', '.join(BUILTIN_REWARDS)}")
    module = _import(spec, module_name)
    function = getattr(module, attribute, None)
    if function is None:
        raise ConfigError(f"reward_funcs ({spec}): {module_name} has no attribute {attribute!r}")
    if not callable(function):
        raise ConfigError(f"reward_funcs ({spec}): {attribute} is a {type(function).__name__}, not a function")
    return function


def _import(spec: str, module_name: str) -> Any:
    """A .py path (relative to the working folder) or a dotted module, importable from the working folder too."""
    try:
        if module_name.endswith(".py"):
            path = Path(module_name).resolve()
            if not path.is_file():
                raise ConfigError(f"reward_funcs ({spec}): no file {module_name}")
            name = f"shardtune_reward_{abs(hash(str(path)))}"
            if name in sys.modules:
                return sys.modules[name]
            loader_spec = importlib.util.spec_from_file_location(name, path)
            assert loader_spec is not None and loader_spec.loader is not None
            module = importlib.util.module_from_spec(loader_spec)
            sys.modules[name] = module
            loader_spec.loader.exec_module(module)
            return module
        if str(Path.cwd()) not in sys.path:
            sys.path.append(str(Path.cwd()))
        return importlib.import_module(module_name)
    except ConfigError:
        raise
    except Exception as err:  # the user's module failed to import: say which, with its own error
        raise ConfigError(f"reward_funcs ({spec}): cannot import {module_name}: {type(err).__name__}: {err}") from None


def reward_weights(weights: Sequence[str] | None, count: int) -> list[float]:
    """``reward_weights`` as numbers (validated: one per function), 1.0 each when not given."""
    return [1.0] * count if weights is None else [float(w) for w in weights]


def is_reward_model_folder(spec: str) -> bool:
    """A folder named in reward_funcs: a reward model (stage rm's output) scores the completions."""
    return ":" not in spec and Path(spec).is_dir()


def reward_model_problems(folder: str) -> list[str]:
    """A reward model folder must hold a whole sequence-classification model (config.json's architectures)."""
    if (Path(folder) / "adapter_config.json").is_file():
        return [f"reward_funcs ({folder}) holds a LoRA adapter; merge it into its model first (shardtune export) and "
                "name the merged folder"]
    try:
        config = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return [f"reward_funcs ({folder}): no readable config.json; name a reward model folder (stage rm's output)"]
    architectures = config.get("architectures") if isinstance(config, dict) else None
    if not isinstance(architectures, list) or not any(str(a).endswith("ForSequenceClassification")
                                                      for a in architectures):
        return [f"reward_funcs ({folder}) is not a reward model (config.json names {architectures}, not a "
                "...ForSequenceClassification); train one with stage: rm"]
    return []


def reward_function_problems(specs: Sequence[str], weights: Sequence[str] | None, format_regex: str | None
                             ) -> list[str]:
    """Every reward function that cannot be loaded, and weights that do not fit them: one line each."""
    problems = []
    for spec in specs:
        if is_reward_model_folder(spec):
            problems += reward_model_problems(spec)
            continue
        try:
            load_reward_function(spec, format_regex)
        except ConfigError as err:
            problems.extend(err.problems)
    if format_regex is not None:
        try:
            re.compile(format_regex)
        except re.error as err:
            problems.append(f"reward_format_regex ({format_regex}): not a regular expression: {err}")
    if weights is not None:
        if len(weights) != len(specs):
            problems.append(f"reward_weights ({len(weights)} values) must give one weight per reward_funcs entry "
                            f"({len(specs)})")
        bad = [w for w in weights if not _is_number(w)]
        if bad:
            problems.append(f"reward_weights: {', '.join(bad)} not a number")
    return problems


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True
