"""Rows longer than a model's table of positions are refused before launch (model/positions.py): Blenderbot's 128
positions against 244-token rows failed inside the forward ("index out of range in self") in the registry matrix."""

from __future__ import annotations

import json

import pytest

from shardtune.config.schema import TrainConfig
from shardtune.launch.validate import file_problems
from shardtune.model.folder import model_folder_problems
from shardtune.model.positions import SIZE_KEYS, TABLE, position_problem, position_table
from shardtune.model.registry import decoder_families
from tests.conftest import run_cli


@pytest.mark.parametrize(("config", "table"), [
    ({"model_type": "blenderbot", "max_position_embeddings": 128}, ("max_position_embeddings", 128)),
    ({"model_type": "gpt2", "n_positions": 1024}, ("n_positions", 1024)),
    ({"model_type": "opt", "max_position_embeddings": 2048}, ("max_position_embeddings", 2048)),
    ({"model_type": "llama", "max_position_embeddings": 2048}, None),  # RoPE: no table
    ({"model_type": "bloom"}, None),  # ALiBi
])
def test_the_table_is_found_only_where_positions_are_looked_up(config, table):
    assert position_table(config) == table


def test_a_longer_cutoff_is_refused_with_the_size_and_the_fix():
    config = {"model_type": "blenderbot", "max_position_embeddings": 128}
    assert position_problem(128, config, "m") is None
    assert position_problem(256, config, "m") == (
        "cutoff_len (256): m (blenderbot) looks positions up in a table of 128 (max_position_embeddings in its "
        "config.json), so a longer row fails inside the model; set cutoff_len: 128 or less")
    assert position_problem(100_000, {"model_type": "llama", "max_position_embeddings": 2048}, "m") is None


def test_every_registry_family_with_a_table_names_its_size_in_its_config():
    """Derived from transformers' registry: each decoder family whose modelling file holds a position table has
    one of SIZE_KEYS in its default config, so the check always has a size to compare with."""
    from transformers import AutoConfig

    from shardtune.model.attention import causal_lm_class_file

    with_table, without_size = [], []
    for family in decoder_families():
        try:
            config = AutoConfig.for_model(family).to_dict()
        except Exception:  # noqa: BLE001 - families whose default config transformers cannot build
            continue
        found = causal_lm_class_file(config)
        if found is None or not TABLE.search(found[1].read_text(encoding="utf-8")):
            continue
        with_table.append(family)
        if not any(isinstance(config.get(key), int) for key in SIZE_KEYS):
            without_size.append(family)
    assert {"blenderbot", "gpt2", "opt", "bart", "biogpt"} <= set(with_table)
    assert not {"llama", "qwen2", "mistral", "gemma3_text"} & set(with_table)
    assert without_size == []


def test_check_refuses_a_blenderbot_folder_in_one_line(tmp_path):
    """The registry's tiny Blenderbot (128 positions, as the released checkpoints) under the tiny example's
    cutoff_len of 256: `shardtune check` names the size and the fix, exit 2."""
    from shardtune.model.tiny import build_tiny_model

    build_tiny_model(tmp_path / "blenderbot", arch="blenderbot", from_registry=True)
    assert json.loads((tmp_path / "blenderbot" / "config.json").read_text())["max_position_embeddings"] == 128
    done = run_cli("check", "examples/tiny/sft_lora.yaml", f"model_name_or_path={tmp_path / 'blenderbot'}",
                   f"output_dir={tmp_path / 'out'}")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "looks positions up in a table of 128 (max_position_embeddings in its config.json)" in done.stderr
    assert "Traceback" not in done.stderr
    assert file_problems(TrainConfig(model_name_or_path=str(tmp_path / "blenderbot"), cutoff_len=128)) == []


def test_xmod_without_a_default_language_is_refused(tmp_path):
    config = {"model_type": "xmod", "languages": ["en_XX", "de_DE"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert any('set "default_language" in config.json to one of en_XX, de_DE' in p
               for p in model_folder_problems(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({**config, "default_language": "en_XX"}))
    assert not any("default_language" in p for p in model_folder_problems(tmp_path))
