"""`shardtune` command: parse the subcommand and dispatch. Heavy libraries load only inside commands."""

from __future__ import annotations

import sys

USAGE = """usage: shardtune <command> [options]

commands (a config key goes as key=value, --key value or --key=value, to every command that reads settings):
  train CONFIG.yaml [key=value ...] [--key value ...]   fine-tune a model
  check CONFIG.yaml [key=value ...]                      validate config, data and model paths; no weights loaded
  estimate CONFIG.yaml [--gpus-per-node N --nodes M --gpu-memory 80GiB --cpu-memory 512GiB] [--json] [key=value ...]
                                                         memory per engine option and the recommended engine
  export SOURCE --out DIR [--merge-lora] [--model BASE] [--dtype D] [--max-shard-size 5GB]
                                                         a checkpoint or output -> a Hugging Face folder ready to serve
  export FILE.yaml [key=value ...]                       LLaMA-Factory's merge_lora file (export_dir, export_size, ...)
  chat OUTPUT|FILE.yaml [--prompt TEXT | --file F] [key=value ...]
                                                         talk to a trained model (interactive, or one-shot)
  eval OUTPUT [CONFIG.yaml] [key=value ...]              generate for eval_dataset and score it (BLEU, ROUGE)
  make-tiny-model --out DIR [--arch NAME --layers N ...]  write a random tiny model + local tokenizer
  expand-model MODEL --out DIR --num-expand N            LLaMA-Pro: insert N zero-output copies of decoder layers
                                                         (then train them with use_llama_pro: true)
  slurm CONFIG.yaml --nodes N --gpus-per-node G [--partition P --time T --account A --submit] [key=value ...]
                                                         write (and submit) an sbatch script for the config
  k8s CONFIG.yaml --nodes N --gpus-per-node G --image IMG [--kind pytorchjob|trainjob --namespace NS] [key=value ...]
                                                         write a Kubeflow manifest with the config in a ConfigMap
  doctor [CONFIG.yaml ...] [--iterations N]              check every node (versions, devices, network) and time
                                                         all-reduces across them; run it on each node like train
  keys [--markdown]                                      list every config key
  convert-config FILE.yaml [--out NEW.yaml] [key=value ...]
                                                         what happens to each key of a LLaMA-Factory file
  status OUTPUT_DIR [--watch SECONDS] [--json]           a run's progress, ETA, every rank's row, last error
  web [ROOT] [--port P] [--host H]                       a live page of the runs under ROOT; launch and stop
                                                         runs from it (needs the web extra: shardtune[web])

Run `shardtune train --help` for every config key with its type, default and description.
Set SHARDTUNE_DEBUG=1 (or pass --debug) to see tracebacks for errors."""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        if argv:
            print(_keys_help())
        return 0
    command, rest = argv[0], argv[1:]
    handlers = {"train": _train, "check": _check, "estimate": _estimate, "export": _export, "chat": _chat,
                "eval": _eval, "make-tiny-model": _make_tiny_model, "expand-model": _expand_model, "keys": _keys,
                "convert-config": _convert_config, "slurm": _slurm, "k8s": _k8s, "doctor": _doctor,
                "status": _status, "web": _web}
    if command not in handlers:
        print(unknown_command_message(command, list(handlers)), file=sys.stderr)
        return 2
    from shardtune.errors import run_reporting_errors

    return run_reporting_errors(handlers[command], rest)


def unknown_command_message(command: str, commands: list[str]) -> str:
    """One line, with the closest command: the usage block would bury the typo under 30 lines."""
    import difflib

    from shardtune.paths import shown

    close = difflib.get_close_matches(command, commands, n=1, cutoff=0.6)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    if command.endswith((".yaml", ".yml", ".json")):  # the command was left out, as `llamafactory-cli` users may
        hint = f" (a config file: did you mean `shardtune train {command}` or `shardtune check {command}`?)"
    return f"shardtune: error: unknown command {shown(command)}{hint}; `shardtune --help` lists the commands"


def _keys_help() -> str:
    from shardtune.config.args import keys_help

    return keys_help()


def _train(args: list[str]) -> int:
    if "-h" in args or "--help" in args:
        print("usage: shardtune train CONFIG.yaml [key=value ...] [--key value ...] [--dry-run]\n")
        print(_keys_help())
        return 0
    from shardtune.errors import debug_requested
    from shardtune.launch.env import inside_launcher

    if inside_launcher():  # started as a rank by the user's own torchrun / accelerate / deepspeed
        from shardtune.launch.worker import worker_command

        return worker_command(args)
    from shardtune.launch.preflight import plan_run
    from shardtune.launch.supervise import start_run

    return start_run(plan_run(args, ranks_here=True), debug_requested(args), command_line=args)


def _check(args: list[str]) -> int:
    if "-h" in args or "--help" in args:
        print("usage: shardtune check CONFIG.yaml [key=value ...] [--key value ...]\n\nValidates everything `train` "
              "would, without loading weights; exit 0 when fine, 2 with every problem listed.\n")
        print(_keys_help())
        return 0
    from shardtune.launch.preflight import check_command

    return check_command(args)


def _estimate(args: list[str]) -> int:
    from shardtune.estimate.command import estimate_command
    from shardtune.launch.env import read_launch_env

    launch = read_launch_env()  # NNODES / NPROC_PER_NODE are the defaults of --nodes / --gpus-per-node
    return estimate_command(args, launch.nnodes, launch.nproc_per_node)


def _status(args: list[str]) -> int:
    from shardtune.web.status import status_command

    return status_command(args)


def _web(args: list[str]) -> int:
    from shardtune.web.command import web_command

    return web_command(args)


def _slurm(args: list[str]) -> int:
    from shardtune.launch.sbatch import slurm_command

    return slurm_command(args)


def _doctor(args: list[str]) -> int:
    from shardtune.launch.doctor import doctor_command

    return doctor_command(args)


def _k8s(args: list[str]) -> int:
    from shardtune.launch.k8s_manifest import k8s_command

    return k8s_command(args)


def _export(args: list[str]) -> int:
    from shardtune.export.command import export_command

    return export_command(args)


def _chat(args: list[str]) -> int:
    from shardtune.infer.chat import chat_command

    return chat_command(args)


def _eval(args: list[str]) -> int:
    from shardtune.launch.evaluate import eval_command

    return eval_command(args)


def _expand_model(args: list[str]) -> int:

    from pathlib import Path

    from shardtune.arguments import CommandParser

    parser = CommandParser(prog="shardtune expand-model",
                                     description="LLaMA-Pro block expansion (LLaMA-Factory's scripts/llama_pro.py)")
    parser.add_argument("model", help="the model folder to expand")
    parser.add_argument("--out", required=True, help="output folder (new or empty)")
    parser.add_argument("--num-expand", type=int, required=True,
                        help="blocks to insert; must divide the layers (train with freeze_trainable_layers: N)")
    ns = parser.parse_args(args)
    from shardtune.errors import ModelError
    from shardtune.paths import listed, user_entries

    if not (Path(ns.model) / "config.json").is_file():
        raise ModelError(f"expand-model: {ns.model} is not a model folder (no config.json)")
    entries = user_entries(Path(ns.out))
    if entries:
        raise ModelError(f"expand-model: --out {ns.out} is not empty ({listed(entries)}); give a new or empty folder")
    from shardtune.model.llama_pro import expand_model

    out = expand_model(ns.model, ns.out, ns.num_expand)
    print(f"expanded model written to {out}: train the new blocks with use_llama_pro: true and "
          f"freeze_trainable_layers: {ns.num_expand}")
    return 0


def _make_tiny_model(args: list[str]) -> int:

    from shardtune.arguments import CommandParser, whole_number
    from shardtune.model.architectures import FAMILIES
    from shardtune.model.registry import decoder_families, image_text_families

    parser = CommandParser(prog="shardtune make-tiny-model")
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--arch", default="llama",
                        choices=sorted({*FAMILIES, *decoder_families(), *image_text_families()}),
                        metavar="NAME", help=f"model family (default: llama): {', '.join(FAMILIES)}, or any model type "
                        "transformers builds a causal LM for (then at the registry's tiny sizes: --layers, --hidden, "
                        "... apply to the families above)")
    parser.add_argument("--registry", action="store_true",
                        help="build --arch as transformers' registry builds that model type even where a family above "
                        "has the name (gemma3: the image-text model)")
    parser.add_argument("--image-text", action="store_true",
                        help="build --arch as transformers' image-text class with its vision tower, as such "
                        "checkpoints are downloaded (qwen3_5, gemma4, mistral3, ...)")
    # Bounded: a tiny model's sizes; past them the tokenizer trainer aborts the process (a Rust panic).
    parser.add_argument("--layers", type=whole_number(1, 64), default=2)
    parser.add_argument("--hidden", type=whole_number(1, 8192), default=64)
    parser.add_argument("--heads", type=whole_number(1, 256), default=4)
    parser.add_argument("--kv-heads", type=whole_number(1, 256), default=2)
    parser.add_argument("--intermediate", type=whole_number(1, 32768), default=172)
    parser.add_argument("--vocab-size", type=whole_number(300, 262144), default=2048)
    parser.add_argument("--seed", type=whole_number(0, 2**32 - 1), default=0)
    parser.add_argument("--overwrite", action="store_true", help="write into --out even if it holds files")
    ns = parser.parse_args(args)
    from pathlib import Path

    from shardtune.errors import ModelError
    from shardtune.paths import listed, user_entries

    if ns.hidden % ns.heads or ns.heads % ns.kv_heads:
        raise ModelError(f"make-tiny-model: --heads ({ns.heads}) must divide --hidden ({ns.hidden}) and --kv-heads "
                         f"({ns.kv_heads}) must divide --heads")
    entries = user_entries(Path(ns.out))
    if entries and not ns.overwrite:
        raise ModelError(f"make-tiny-model: --out {ns.out} is not empty ({listed(entries)}); its files would be "
                         "overwritten: give a new or empty folder, or add --overwrite")
    from shardtune.model.tiny import build_tiny_model

    out = build_tiny_model(ns.out, arch=ns.arch, layers=ns.layers, hidden=ns.hidden, heads=ns.heads,
                           kv_heads=ns.kv_heads, intermediate=ns.intermediate, vocab_size=ns.vocab_size, seed=ns.seed,
                           from_registry=ns.registry, image_text=ns.image_text)
    print(f"tiny {ns.arch} model written to {out}")
    return 0


def _convert_config(args: list[str]) -> int:

    from pathlib import Path

    from shardtune.arguments import CommandParser
    from shardtune.config.args import parse_subcommand, read_settings

    parser = CommandParser(prog="shardtune convert-config",
                                     description="Each key of a LLaMA-Factory or Trainer YAML file: honoured, mapped "
                                                 "(and to what), refused (and why) or unknown. Exit 0 when the file "
                                                 "runs as it is, 2 otherwise. Settings on the command line (key=value, "
                                                 "--key value) override the file's.")
    parser.add_argument("config", help="the YAML file")
    parser.add_argument("--out", help="also write the file in shardtune's spelling")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    ns, settings = parse_subcommand(parser, args)
    from shardtune.config.convert import convert_config

    lines, runs = convert_config(Path(ns.config), Path(ns.out) if ns.out else None, read_settings(settings))
    print("\n".join(lines))
    return 0 if runs else 2


def _keys(args: list[str]) -> int:
    from shardtune.config.reference import help_text, markdown_reference

    print(markdown_reference() if "--markdown" in args else help_text().lstrip("\n"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
