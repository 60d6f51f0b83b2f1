"""``shardtune export``: a checkpoint, a run's output or an adapter -> a Hugging Face folder ready to serve.

Two forms: ``export SOURCE --out DIR [options]``, or ``export FILE.yaml [key=value ...]`` with LLaMA-Factory's
merge_lora keys (model_name_or_path, adapter_name_or_path, template, export_dir, export_size, export_device, ...).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from shardtune.arguments import CommandParser
from shardtune.config.args import parse_subcommand, read_settings
from shardtune.errors import ConfigError, ModelError
from shardtune.paths import folder_problem

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
# The config keys `export FILE.yaml` reads (LLaMA-Factory's merge_lora keys); `export --help` lists them.
FILE_KEYS = ("model_name_or_path", "adapter_name_or_path", "template", "export_dir", "export_size", "export_device",
             "export_legacy_format", "save_dtype", "trust_remote_code")


def parse_size(text: str) -> int:
    """``5GB``, ``500MB``, ``2GiB`` or a number of bytes."""
    match = _SIZE.match(text)
    if not match:
        raise ConfigError(f"export: --max-shard-size {text!r}: give a size such as 5GB, 500MB or 2GiB")
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "B").upper()])


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="shardtune export",
        description="Any checkpoint-<step> folder (any engine, any number of processes that wrote it), a run's "
                    "output or a LoRA adapter -> a Hugging Face model folder ready to serve (dtype, chat template, "
                    "stop token). Or FILE.yaml with LLaMA-Factory's merge_lora keys (listed below), which the command "
                    "line overrides as key=value or --key value.")
    parser.add_argument("source", help="checkpoint-<step> folder, a run's output_dir, or a YAML file")
    parser.add_argument("--out", help="folder to write: never the source or the base model; an existing folder "
                                      "only when it is an earlier export (or with --overwrite)")
    parser.add_argument("--merge-lora", action="store_true", help="merge LoRA weights into the base model")
    parser.add_argument("--model", help="base model (default: model_name_or_path of the run)")
    parser.add_argument("--finetuning-type", choices=("full", "freeze", "lora", "oft"),
                        help="default: that of the run")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"),
                        help="dtype of a full model (default: the run's save_dtype; auto: the base checkpoint's)")
    parser.add_argument("--max-shard-size", help="largest safetensors file, e.g. 5GB (default: transformers')")
    parser.add_argument("--template", help="chat template written into the tokenizer (default: the run's)")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty folder that is not an export")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    return parser


def export_command(args: list[str]) -> int:
    ns, settings = parse_subcommand(build_parser(), args, FILE_KEYS)
    if Path(ns.source).suffix in (".yaml", ".yml", ".json"):  # LLaMA-Factory's merge file, not a folder
        if not Path(ns.source).exists():
            raise ConfigError(f"export: config file not found: {ns.source}")
        if Path(ns.source).is_file():
            return export_file(ns, settings)
    if settings:  # each key checked as train checks it (a typo is named the same way), then refused here
        given = ", ".join(read_settings(settings))
        raise ConfigError(f"export: {given}: config keys are read from FILE.yaml (export FILE.yaml key=value); "
                          "export SOURCE --out DIR takes its options (`shardtune export --help`)")
    if ns.out is None:
        raise ConfigError("export: --out DIR is required (or give a YAML file with export_dir)")
    from shardtune.export.convert import ExportOptions, export_model

    source = Path(ns.source)
    problem = folder_problem("export", ns.source, "a checkpoint-<step> folder, a run's output_dir or an adapter "
                                                  "folder")
    if problem:
        raise ModelError(problem)
    options = ExportOptions(save_dtype=ns.dtype, template=ns.template, overwrite=ns.overwrite,
                            max_shard_bytes=parse_size(ns.max_shard_size) if ns.max_shard_size else None)
    notes = export_model(source, Path(ns.out), base=ns.model, merge_lora=ns.merge_lora,
                         finetuning_type=ns.finetuning_type, options=options)
    return report(source, Path(ns.out), notes)


def export_file(ns: argparse.Namespace, settings: list[str]) -> int:
    """LLaMA-Factory's ``llamafactory-cli export FILE``: the adapters of adapter_name_or_path merged into
    model_name_or_path (or that model alone), written to export_dir in shards of export_size GB."""
    from shardtune.config.args import load_config
    from shardtune.export.convert import ExportOptions, export_model

    folder_options = [f"--{name.replace('_', '-')}" for name in ("out", "merge_lora", "model", "finetuning_type",
                                                                  "dtype", "max_shard_size") if getattr(ns, name)]
    if folder_options:
        raise ConfigError(f"export FILE.yaml: {', '.join(folder_options)}: options of export SOURCE --out DIR; here "
                          "the file's keys say it (export_dir, export_size, save_dtype, model_name_or_path)")
    template = [f"template={ns.template}"] if ns.template is not None else []  # a config key here
    config, _ = load_config([ns.source, *template, *settings])
    problems = []
    if config.model_name_or_path is None:
        problems.append("model_name_or_path is required (the model, or the base of adapter_name_or_path)")
    if config.export_dir is None:
        problems.append("export_dir is required (the folder to write)")
    if config.export_legacy_format:
        problems.append("export_legacy_format (true): shardtune writes safetensors only; remove it or set false")
    if problems:
        raise ConfigError(*problems)
    assert config.model_name_or_path is not None and config.export_dir is not None
    adapters = list(config.adapter_name_or_path)
    source = Path(adapters[-1] if adapters else config.model_name_or_path)
    options = ExportOptions(save_dtype=config.save_dtype, template=config.template, device=config.export_device,
                            max_shard_bytes=config.export_size * 10**9, trust_remote_code=config.trust_remote_code,
                            overwrite=ns.overwrite, out_name="export_dir")
    notes = export_model(source, Path(config.export_dir), base=config.model_name_or_path if adapters else None,
                         merge_lora=True, finetuning_type="lora" if adapters else None, options=options,
                         merged_first=tuple(adapters[:-1]))
    return report(source, Path(config.export_dir), notes)


def report(source: Path, out: Path, notes: list[str]) -> int:
    from shardtune.export.vllm import vllm_notes

    print(f"exported {source} -> {out}")
    for line in [*notes, *vllm_notes(out, base_vocab_size(out))]:
        print(f"  {line}")
    return 0


def base_vocab_size(out: Path) -> int | None:
    """The vocabulary rows of the export's base model (an adapter's base), for the added-tokens check."""
    import json

    adapter_config = out / "adapter_config.json"
    if not adapter_config.is_file():
        return None
    base = json.loads(adapter_config.read_text()).get("base_model_name_or_path")
    config = Path(base or "") / "config.json"
    return json.loads(config.read_text()).get("vocab_size") if base and config.is_file() else None
