"""do_predict with predict_with_generate: every rank generates answers for its share of the prompts with the model
as the engine holds it, rank 0 puts them back in the data's order and writes LLaMA-Factory's files:
``generated_predictions.jsonl`` (prompt, predict, label per line) and ``predict_results.json`` (BLEU-4,
ROUGE-1/2/L, exact match, runtime).

Every rank runs the same number of batches (the sampler repeats samples to even out the shares; the repeats are
dropped), so that under ZeRO-3 and FSDP, where each forward gathers the sharded weights, the ranks' generate calls
stay in step. Greedy answers (``do_sample: false``) are those of one process.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler

from shardtune.config.generation import prediction_datasets
from shardtune.config.schema import TrainConfig
from shardtune.engines.base import Engine
from shardtune.infer.generation import answer_ids, generation_settings, stop_token_ids

PREDICTIONS_FILE = "generated_predictions.jsonl"
PREDICT_RESULTS_FILE = "predict_results.json"


def run_prediction(engine: Engine, tokenizer: Any, c: TrainConfig, output_dir: Path) -> dict[str, Any]:
    """Generate for the prediction data, write the two files (main rank) and return the metrics."""
    prompts = build_prompts(engine, tokenizer, c)
    settings = generation_settings(c)
    stops = stop_token_ids(tokenizer, prediction_stop_token(tokenizer, c))
    sampler: DistributedSampler = DistributedSampler(prompts, num_replicas=engine.world_size, rank=engine.rank,
                                                     shuffle=False)
    from shardtune.data.prediction import PromptCollator

    loader = DataLoader(prompts, batch_size=c.per_device_eval_batch_size, sampler=sampler,
                        collate_fn=PromptCollator(tokenizer.pad_token_id))
    started = time.perf_counter()
    mine: list[tuple[int, list[int]]] = []
    for batch in loader:
        generated = engine.generate(batch["input_ids"], batch["attention_mask"],
                                    **settings.generate_kwargs(stops, tokenizer.pad_token_id))
        answers = generated[:, batch["input_ids"].shape[1]:].cpu().tolist()
        mine += [(index, answer_ids(ids, stops)) for index, ids in zip(batch["index"], answers, strict=True)]
    answered = {index: ids for share in engine.gather_objects(mine) for index, ids in share}
    runtime = time.perf_counter() - started
    results: dict[str, Any] = {}
    if engine.is_main:
        results = write_predictions(output_dir, prompts, answered, tokenizer, settings.skip_special_tokens,
                                    runtime, len(loader))
        print(f"[shardtune] do_predict: {len(answered)} answers in {output_dir / PREDICTIONS_FILE}; "
              + ", ".join(f"{k} {v}" for k, v in results.items() if k.startswith("predict_") and "runtime" not in k
                          and "per_second" not in k), flush=True)
    engine.barrier()
    return results


def build_prompts(engine: Engine, tokenizer: Any, c: TrainConfig) -> Any:
    """The prompt set, built on the main rank first (it fills the datasets cache the others then read)."""
    from shardtune.data.prediction import build_prediction_set
    from shardtune.train.settings import data_settings

    if not engine.is_main:
        engine.barrier()
    prompts = build_prediction_set(tokenizer, data_settings(c), prediction_datasets(c))
    if engine.is_main:
        engine.barrier()
    return prompts


def prediction_stop_token(tokenizer: Any, c: TrainConfig) -> str:
    from shardtune.data.templates import get_template

    return get_template(c.template, c.default_system, c.enable_thinking, c.tool_format).stop_token(tokenizer)


def write_predictions(output_dir: Path, prompts: Any, answered: dict[int, list[int]], tokenizer: Any,
                      skip_special_tokens: bool, runtime: float, steps: int) -> dict[str, Any]:
    """generated_predictions.jsonl in the data's order and predict_results.json; returns the results."""
    from shardtune.infer.metrics import answer_scores

    output_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for sample in prompts:
        predict = tokenizer.decode(answered[sample["index"]], skip_special_tokens=skip_special_tokens)
        rows.append({"prompt": tokenizer.decode(sample["input_ids"], skip_special_tokens=False),
                     "predict": predict, "label": sample["label"]})
    with (output_dir / PREDICTIONS_FILE).open("w", encoding="utf-8") as out:
        out.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    scores = answer_scores([r["predict"] for r in rows], [r["label"] for r in rows])
    results = {f"predict_{name}": value for name, value in scores.items()}
    results.update(predict_samples=len(rows), predict_runtime=round(runtime, 4),
                   predict_samples_per_second=round(len(rows) / max(runtime, 1e-9), 3),
                   predict_steps_per_second=round(steps / max(runtime, 1e-9), 3))
    (output_dir / PREDICT_RESULTS_FILE).write_text(json.dumps(results, indent=2) + "\n")
    return results


def predict_only(config: TrainConfig, engine: Engine) -> dict[str, Any]:
    """do_predict without training: the model as configured (base, adapters) is set up by the engine as for
    training, and generates; nothing is trained or saved but the prediction files and the resolved config."""
    from shardtune.config.load import config_to_dict
    from shardtune.model.load import load_tokenizer
    from shardtune.optim.build import build_optimizer, build_scheduler, parameter_names
    from shardtune.optim.settings import optimizer_settings
    from shardtune.run_files import RESOLVED_CONFIG
    from shardtune.train.settings import finetuning_settings
    from shardtune.train.setup import model_source, with_attention_resolved

    torch.manual_seed(config.seed)
    config = with_attention_resolved(config, engine.is_main)
    tokenizer = load_tokenizer(config.model_name_or_path or "", trust_remote_code=config.trust_remote_code)
    source = model_source(config, finetuning_settings(config), tokenizer_size=len(tokenizer),
                          pad_token_id=tokenizer.pad_token_id)
    model = engine.build_model(source)
    # The engine is set up as for training (its optimizer is never stepped): the same code places the weights.
    engine.prepare(model, lambda params: build_optimizer(params, optimizer_settings(config), parameter_names(model),
                                                         model),
                   lambda opt: build_scheduler(opt, "constant", 1, 0))
    output_dir = Path(config.output_dir or "output")
    if engine.is_main:
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / RESOLVED_CONFIG).write_text(json.dumps(config_to_dict(config), indent=2))
    results = run_prediction(engine, tokenizer, config, output_dir)
    engine.close()
    return results
