"""do_predict scores its answers with nltk and rouge-score (the ``metrics`` extra): without them the run is refused
before launch, not ended by an import error after training (a GPU machine without nltk, 2026-11-28)."""

from __future__ import annotations

import importlib.util

from shardtune.config.schema import TrainConfig
from shardtune.infer import metrics

PREDICTING = TrainConfig(do_predict=True, predict_with_generate=True, eval_dataset=["parrot_eval"], stage="sft")


def test_this_environment_has_them_and_predicting_is_not_refused_for_it():
    assert metrics.missing_score_packages() == []
    assert metrics.score_package_problems(PREDICTING) == []


def test_a_missing_one_is_named_with_the_install_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(metrics.importlib.util, "find_spec", lambda name: None if name == "nltk" else real(name))
    assert metrics.score_package_problems(PREDICTING) == [
        "do_predict (true): the answers are scored with nltk, not installed here; pip install 'shardtune[metrics]' "
        "(or do_predict: false)"]
    assert metrics.score_package_problems(TrainConfig()) == []
