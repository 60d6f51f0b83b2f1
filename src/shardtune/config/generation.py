"""What a run generates (do_predict) and which keys belong to other commands, read from the config: validation,
the workflow and ``shardtune eval`` ask here."""

from __future__ import annotations

from shardtune.config.schema import TrainConfig

# Read by `shardtune chat` (infer_dtype) and `shardtune export FILE` (export_*), never by a training run.
OTHER_COMMAND_KEYS = {"infer_dtype": "shardtune chat", "export_dir": "shardtune export FILE",
                      "export_size": "shardtune export FILE", "export_device": "shardtune export FILE",
                      "export_legacy_format": "shardtune export FILE"}


def predicts_only(c: TrainConfig) -> bool:
    """do_predict without training: the model as loaded (with its adapters) generates, nothing is trained.
    ``do_train: false``, or no training data at all (LLaMA-Factory's predict files leave do_train out, and its
    default there is false)."""
    return c.do_predict and (not c.do_train or not (c.dataset or c.tokenized_path))


def prediction_datasets(c: TrainConfig) -> list[str]:
    """The datasets do_predict generates for: eval_dataset, else (nothing trained) dataset."""
    return list(c.eval_dataset) or (list(c.dataset) if not c.do_train else [])


def generation_key_problems(c: TrainConfig) -> list[str]:
    """do_predict's requirements, and other commands' keys given to a training run."""
    problems = []
    defaults = TrainConfig()
    problems += [f"{key} ({getattr(c, key)!r}) is read by `{command}`, not by a training run; remove it"
                 for key, command in OTHER_COMMAND_KEYS.items() if getattr(c, key) != getattr(defaults, key)]
    if not c.do_train and not c.do_predict:
        problems.append("do_train (false) without do_predict: nothing to do; set do_train: true, or do_predict: true "
                        "with predict_with_generate: true to generate with the model as it is")
    if not c.do_predict:
        if c.predict_with_generate:
            problems.append("predict_with_generate (true) without do_predict: set do_predict: true")
        return problems
    if not c.predict_with_generate:
        problems.append("do_predict (true) without predict_with_generate: shardtune's prediction generates answers "
                        "and scores them; set predict_with_generate: true")
    if c.stage != "sft":
        problems.append(f"do_predict (true) with stage {c.stage}: generation-based prediction is for stage sft")
    if not prediction_datasets(c):
        problems.append("do_predict (true) needs eval_dataset (the datasets to generate for; a val_size hold-out is "
                        "not used for prediction)" + ("" if c.do_train else " or dataset"))
    if predicts_only(c) and (c.do_eval or c.eval_strategy != "no"):
        problems.append(f"do_eval/eval_strategy ({c.eval_strategy}) with a prediction-only run (do_predict without "
                        "training): nothing is trained to evaluate; remove them")
    return problems
