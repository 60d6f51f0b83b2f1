"""The schema fuzzer's contract on stage grpo's own base: every generated mistake of each grpo key, and every feature
switched on beside stage grpo, is accepted or refused in a line naming the key (check); a sample of what check
accepted then trains one step (train keeps check's word). tests/unit/test_fuzz_schema.py covers the keys on an sft
base, where each of them is refused as read by stage grpo only."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from shardtune.config.grpo import GRPO_KEYS
from tests.conftest import REPO
from tests.schema_fuzz import FEATURES, Case, config_cases
from tests.unit.test_fuzz_schema import SEED, check_contract, train_keeps_checks_word

KEY_CASES = [c for c in config_cases(SEED) if c.culprits[0] in GRPO_KEYS]
FEATURE_CASES = [Case(f"grpo-{key}", {key: value}, (key, "stage")) for key, value in sorted(FEATURES.items())]


@pytest.fixture(scope="module")
def base(tiny_model_dir, tmp_path_factory) -> dict[str, Any]:
    config = yaml.safe_load((REPO / "examples/grpo/tiny_letter.yaml").read_text())
    out = tmp_path_factory.mktemp("fuzz-grpo")
    return {**config, "model_name_or_path": str(tiny_model_dir), "dataset_dir": str(REPO / "data"),
            "output_dir": str(out / "run"), "reward_funcs": "answer_match", "max_completion_length": 4}


def test_every_grpo_key_has_cases():
    assert {c.culprits[0] for c in KEY_CASES} == set(GRPO_KEYS)


@pytest.mark.parametrize("case", KEY_CASES + FEATURE_CASES, ids=lambda c: c.id)
def test_check_contract_on_grpo(case, base, tmp_path):
    check_contract(case, base, tmp_path)


@pytest.mark.e2e
def test_train_keeps_what_check_accepted_on_grpo(base, tmp_path):
    train_keeps_checks_word(KEY_CASES + FEATURE_CASES, 4, base, tmp_path)
