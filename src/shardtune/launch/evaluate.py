"""``shardtune eval OUTPUT [CONFIG.yaml] [key=value ...]``: generation-based evaluation of a trained model.

It is a prediction-only run (``do_train: false``, ``do_predict`` and ``predict_with_generate`` on) of the model in
OUTPUT, planned and launched as ``train`` is, so it runs on one process or many, under any engine. OUTPUT is a full
model folder (model_name_or_path) or a LoRA adapter (adapter_name_or_path on its base). The data, template and
generation keys come from CONFIG.yaml, else from the run's own ``shardtune_config.json`` in OUTPUT. The files go to
``OUTPUT/predict`` unless ``output_dir=`` is given on the command line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from shardtune import run_files
from shardtune.errors import ConfigError
from shardtune.model.pretrained_adapters import adapter_method
from shardtune.paths import folder_problem

USAGE = ("usage: shardtune eval OUTPUT [CONFIG.yaml] [key=value ...] [--key value ...] [--dry-run]\n\n"
         "Generates answers for eval_dataset (else dataset) with the model in OUTPUT (a full model folder or a LoRA "
         "adapter) and scores them: OUTPUT/predict/generated_predictions.jsonl and predict_results.json.\n"
         "Without CONFIG.yaml the run's shardtune_config.json in OUTPUT gives the data, template and cutoff_len.\n"
         "NPROC_PER_NODE / FORCE_TORCHRUN and deepspeed= / fsdp= run it on several processes, as for train.")
# What an evaluation takes from the run's resolved config when no CONFIG.yaml is given.
RUN_KEYS = ("template", "default_system", "enable_thinking", "tool_format", "dataset_dir", "dataset", "eval_dataset",
            "cutoff_len", "trust_remote_code", "max_samples")


def eval_arguments(args: list[str]) -> list[str]:
    """The ``train`` command line that evaluates OUTPUT: its config file and settings (key=value, --key value)."""
    from shardtune.arguments import CommandParser
    from shardtune.config.args import parse_command_line, split_settings

    positional, overrides = split_settings(args, CommandParser(prog="shardtune eval"))
    if not positional or positional[0].startswith("-"):
        raise ConfigError("eval: give the trained model folder first: " + USAGE.splitlines()[0])
    output = Path(positional[0])
    if not output.is_dir():
        raise ConfigError(output_folder_problem(positional[0]))
    if len(positional) > 2:
        raise ConfigError(f"eval: unexpected argument '{positional[2]}': " + USAGE.splitlines()[0])
    config_file = positional[1] if len(positional) > 1 else None
    given = parse_command_line(overrides).values.get("output_dir")
    given_out = None if given is None else str(given)
    out = Path(given_out) if given_out else output / "predict"
    forced = [*model_overrides(output), "do_train=false", "do_predict=true", "predict_with_generate=true",
              "do_eval=false", "eval_strategy=no"]
    if given_out is None:
        forced.append(f"output_dir={out}")
    return [config_file or str(write_run_config(output, out)), *forced, *overrides]


def output_folder_problem(output: str) -> str:
    """Why OUTPUT is not the model folder; a config file there is the two arguments swapped, so the order is said."""
    if Path(output).suffix in (".yaml", ".yml", ".json") and Path(output).is_file():
        return (f"eval: {output} is a config file; give the trained model folder first: "
                f"{USAGE.splitlines()[0].removeprefix('usage: ')}")
    return folder_problem("eval", output, "the trained model folder first (a run's output_dir or an exported "
                                          "model)") or ""


def model_overrides(output: Path) -> list[str]:
    """model_name_or_path (and adapter_name_or_path) for the model in ``output``."""
    if (output / "adapter_config.json").is_file():
        base = json.loads((output / "adapter_config.json").read_text()).get("base_model_name_or_path")
        base = run_config(output).get("model_name_or_path") or base
        if not base:
            raise ConfigError(f"eval: {output} is a peft adapter whose base model is unknown; pass "
                              "model_name_or_path=BASE")
        return [f"model_name_or_path={base}", f"adapter_name_or_path={output}",
                f"finetuning_type={adapter_method(output)}"]
    if (output / "config.json").is_file():
        return [f"model_name_or_path={output}", "adapter_name_or_path=", "finetuning_type=full"]
    raise ConfigError(f"eval: {output} holds no model (no config.json or adapter_config.json); a checkpoint-<step> "
                      f"folder becomes one with `shardtune export {output} --out DIR`")


def run_config(output: Path) -> dict[str, Any]:
    path = output / run_files.RESOLVED_CONFIG
    return json.loads(path.read_text()) if path.is_file() else {}


def write_run_config(output: Path, folder: Path) -> Path:
    """A config file of the run's data and template keys, in the evaluation's own folder (its ``.shardtune/``,
    which marks the folder as a run's)."""
    import yaml

    run = run_config(output)
    if not run:
        raise ConfigError(f"eval: no CONFIG.yaml given and {output} has no {run_files.RESOLVED_CONFIG}; give the "
                          "config that names the eval data and template")
    path = folder / ".shardtune" / "eval_config.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump({key: run[key] for key in RUN_KEYS if key in run}, sort_keys=False))
    return path


def eval_command(args: list[str]) -> int:
    if "-h" in args or "--help" in args:
        from shardtune.config.args import keys_help

        print(USAGE + "\n\n" + keys_help())
        return 0
    from shardtune.errors import debug_requested
    from shardtune.launch.preflight import plan_run
    from shardtune.launch.supervise import start_run

    argv = eval_arguments(args)
    return start_run(plan_run(argv, ranks_here=True), debug_requested(argv))
