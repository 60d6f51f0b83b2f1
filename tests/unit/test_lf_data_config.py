"""The data-group keys LLaMA-Factory users bring, from the config file to the data settings."""

from __future__ import annotations

import pytest

from shardtune.config.load import build_config
from shardtune.errors import ConfigError
from shardtune.train.settings import data_settings

BASE = {"model_name_or_path": "m", "output_dir": "o", "dataset": "a,b"}


def test_data_keys_reach_the_data_settings() -> None:
    config = build_config({**BASE, "eval_dataset": "c", "mix_strategy": "interleave_over",
                           "interleave_probs": "0.7,0.3", "mask_history": True, "neat_packing": True,
                           "preprocessing_batch_size": 64})
    settings = data_settings(config)
    assert settings.eval_dataset == ("c",) and settings.mix_strategy == "interleave_over"
    assert settings.interleave_probs == (0.7, 0.3) and settings.mask_history
    assert settings.neat_packing and settings.packing  # neat_packing turns (always neat) packing on
    assert settings.preprocessing_batch_size == 64


def test_unknown_mix_strategy_is_refused() -> None:
    with pytest.raises(ConfigError) as caught:
        build_config({**BASE, "mix_strategy": "shuffle", "streaming": True})
    text = str(caught.value)
    assert "mix_strategy" in text and "streaming" not in text  # streaming is honoured (test_lf_streaming.py)


def test_non_numeric_interleave_probs_are_reported_by_the_data_checks() -> None:
    from shardtune.data import check_data_settings

    settings = data_settings(build_config({**BASE, "mix_strategy": "interleave_under", "interleave_probs": "x,1"}))
    assert any("interleave_probs" in p and "sum to 1" in p for p in check_data_settings(settings))
