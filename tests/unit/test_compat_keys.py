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
