"""Rows holding several samples of a family that hangs under ZeRO-3 with them (launch/model_checks.py
``PACKED_ZERO3_FAILS``, found by the registry cells of tests/distributed/test_packed_state_engines.py): refused
before launch in one line naming the key, the stage and the family, and only there."""

from __future__ import annotations

import json

from shardtune.config.schema import TrainConfig
from shardtune.launch.model_checks import PACKED_ZERO3_FAILS, packed_zero3_problems


def config_folder(tmp_path, model_type: str):
    folder = tmp_path / model_type
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": model_type}))
    return folder


def test_packed_rows_of_a_listed_family_are_refused_under_zero3_only(tmp_path):
    listed = config_folder(tmp_path, next(iter(PACKED_ZERO3_FAILS)))
    packed = TrainConfig(model_name_or_path=str(listed), packing=True)
    lines = packed_zero3_problems(packed, 3)
    assert len(lines) == 1 and lines[0].startswith("packing with deepspeed ZeRO stage 3 on minimax: ")
    assert lines[0].endswith("or set packing: false and padding_free: false")
    assert packed_zero3_problems(packed, 2) == []
    unpacked = TrainConfig(model_name_or_path=str(listed), packing=False, padding_free=False)
    assert packed_zero3_problems(unpacked, 3) == []
    other = TrainConfig(model_name_or_path=str(config_folder(tmp_path, "qwen3_next")), packing=True)
    assert packed_zero3_problems(other, 3) == []
