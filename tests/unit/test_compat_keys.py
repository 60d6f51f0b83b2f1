"""LLaMA-Factory and Trainer spellings are rewritten into shardtune keys before the config is built."""

from __future__ import annotations

import pytest

from shardtune.config.load import build_config
from shardtune.errors import ConfigError

BASE = {"model_name_or_path": "org/model", "dataset": "demo", "output_dir": "out"}


def test_a_mapped_key_sets_its_shardtune_key():
    assert build_config({**BASE, "evaluation_strategy": "steps"}).eval_strategy == "steps"


def test_a_mapped_key_that_contradicts_the_shardtune_key_is_refused():
    with pytest.raises(ConfigError, match="'evaluation_strategy' .* contradicts 'eval_strategy'"):
        build_config({**BASE, "evaluation_strategy": "steps", "eval_strategy": "epoch"})
    assert build_config({**BASE, "evaluation_strategy": "epoch", "eval_strategy": "epoch"}).eval_strategy == "epoch"


def test_refused_mapped_and_honoured_keys_are_apart():
    from shardtune.config.compat import MAPPED
    from shardtune.config.refused import REFUSED_REASONS, UNSUPPORTED_KEYS
    from shardtune.config.schema import key_names

    honoured, refused, mapped = set(key_names()), set(REFUSED_REASONS), set(MAPPED)
    assert not honoured & refused and not mapped & refused
    # A key may be both only where the mapping normalises its own values (true -> "all").
    assert all(MAPPED[key].becomes.startswith(key) for key in honoured & mapped)
    assert not refused & UNSUPPORTED_KEYS and not honoured & UNSUPPORTED_KEYS


def test_a_refused_llamafactory_key_names_its_reason():
    with pytest.raises(ConfigError, match="key 'ppo_epochs' is not supported by shardtune: reinforcement learning "
                                          r"\(stage ppo\)"):
        build_config({**BASE, "ppo_epochs": 4})


def test_the_llamafactory_key_table_is_current():
    import subprocess
    import sys

    from tests.conftest import REPO

    done = subprocess.run([sys.executable, "scripts/llamafactory_keys.py", "table", "--check"], cwd=REPO,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
