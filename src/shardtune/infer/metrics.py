"""Scores of generated answers against the references, under LLaMA-Factory's names (``predict_`` prefixed in
predict_results.json), each the mean over samples of a per-sample score x 100, rounded to 4 places; answer and
reference are compared without surrounding whitespace:

- ``bleu-4``: nltk's sentence BLEU on characters with smoothing method 3, as LLaMA-Factory computes it.
- ``rouge-1``, ``rouge-2``, ``rouge-l``: F1 of Google's ``rouge-score`` on words, a CJK character being a word of
  its own (LLaMA-Factory segments Chinese with jieba into words, so its numbers differ on Chinese text).
- ``exact_match``: the answer equals the reference.
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shardtune.config.schema import TrainConfig

_WORD = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff]|[^\W_]+|[^\w\s]", re.UNICODE)
ROUGE_NAMES = {"rouge1": "rouge-1", "rouge2": "rouge-2", "rougeL": "rouge-l"}
PACKAGES = {"nltk": "nltk", "rouge_score": "rouge-score"}  # module -> distribution (the ``metrics`` extra)


def score_package_problems(c: TrainConfig) -> list[str]:
    """A predicting run whose scores need packages this environment lacks, refused before launch in one line."""
    missing = missing_score_packages() if c.do_predict and c.predict_with_generate else []
    if not missing:
        return []
    return [f"do_predict (true): the answers are scored with {' and '.join(missing)}, not installed here; "
            "pip install 'shardtune[metrics]' (or do_predict: false)"]


def missing_score_packages() -> list[str]:
    """The distributions the scores need that this environment lacks (checked before a run that predicts: a
    missing one would otherwise end the run after training, as on a GPU machine without nltk on 2026-11-28)."""
    return [dist for module, dist in PACKAGES.items() if importlib.util.find_spec(module) is None]


class WordTokenizer:
    """Words, punctuation marks and single CJK characters (rouge-score's own tokenizer drops non-ASCII text)."""

    def tokenize(self, text: str) -> list[str]:
        return _WORD.findall(text)


def answer_scores(predictions: Sequence[str], references: Sequence[str]) -> dict[str, float]:
    """Mean scores over the pairs (``bleu-4``, ``rouge-1``, ``rouge-2``, ``rouge-l``, ``exact_match``)."""
    from nltk.translate.bleu_score import SmoothingFunction, sentence_bleu
    from rouge_score.rouge_scorer import RougeScorer

    scorer = RougeScorer(list(ROUGE_NAMES), tokenizer=WordTokenizer())
    smoothing = SmoothingFunction().method3
    totals = dict.fromkeys(["bleu-4", *ROUGE_NAMES.values(), "exact_match"], 0.0)
    for prediction, reference in zip(predictions, references, strict=True):
        prediction, reference = prediction.strip(), reference.strip()
        totals["bleu-4"] += round(sentence_bleu([list(reference)], list(prediction),
                                                smoothing_function=smoothing) * 100, 4)
        for name, score in scorer.score(reference, prediction).items():
            totals[ROUGE_NAMES[name]] += round(score.fmeasure * 100, 4)
        totals["exact_match"] += 100.0 if prediction == reference else 0.0
    count = max(len(predictions), 1)
    return {name: round(total / count, 4) for name, total in totals.items()}
