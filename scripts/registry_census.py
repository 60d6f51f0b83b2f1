#!/usr/bin/env python3
"""Every decoder family of the installed transformers, tried on one process through shardtune's loading code.

  python scripts/registry_census.py [--image-text] [--out FILE.md] [--json FILE.jsonl] [--timeout S] [FAMILY ...]

The families are transformers' own (``AutoModelForCausalLM``'s table, model/registry.py), none named here;
``--image-text`` takes ``AutoModelForImageTextToText``'s table instead (families named ``image-text:TYPE``, built as
the image-text class with a vision tower, as such checkpoints are downloaded, and trained on text). For each:
a tiny random model from its own config class (sizes shrunk, one layer of each kind kept) is saved with a tokenizer,
then

  check     the launching host's folder checks (``shardtune check``'s model_folder_problems) say nothing is wrong
  load      ``load_causal_lm`` (the whole-model path: one process, DDP, ZeRO-1/2) gives the saved model's logits
  skeleton  the sharding engines' path (FSDP, ZeRO-3): an empty skeleton filled tensor by tensor from the files,
            by the names ``build_skeleton`` maps, gives the same logits
  full      forward and backward with every parameter trainable: a finite loss; parameters left without a
            gradient are counted (under DDP they need find_unused_parameters or hang)
  lora      ``lora_target: all`` through shardtune's apply_finetuning: forward and backward, the adapters get
            gradients

Each family runs in a worker process with a time bound (a hang or a crash is that family's failure). The table goes
to --out (Markdown) with the date, the transformers version and the counts; --json keeps one record per family.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import select
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

STEPS = ("check", "load", "skeleton", "full", "lora")
IMAGE_TEXT = "image-text:"
MAX_PARAMETERS = 30_000_000  # a config that does not shrink below this is reported, not built
SEQUENCE = 24


def run_family(family: str, tokenizer, folder: Path) -> dict:
    import torch

    from shardtune.model.registry import special_token_ids

    record: dict = {"family": family}
    ids = torch.randint(5, len(tokenizer), (1, SEQUENCE), generator=torch.Generator().manual_seed(0))
    try:
        model = build(family, len(tokenizer), special_token_ids(tokenizer), record)
        with torch.no_grad():
            reference = logits(model, ids)
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    except Exception as err:  # one family's failure is a row of the table, never the end of the census
        record["build"] = short(err)
        return record
    record["build"] = "ok"
    for step, action in (("check", lambda: check(folder)), ("load", lambda: load(folder, ids, reference)),
                         ("skeleton", lambda: skeleton(folder, ids, reference)),
                         ("full", lambda: full(model, ids)), ("lora", lambda: lora(folder, ids))):
        try:
            record[step] = action() or "ok"
        except Exception as err:
            record[step] = short(err)
    return record


def build(family: str, vocab_size: int, special_ids: dict[str, int], record: dict):
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from shardtune.model.registry import tiny_image_text_config, tiny_registry_config

    image_text = family.startswith(IMAGE_TEXT)
    tiny = tiny_image_text_config if image_text else tiny_registry_config
    config = tiny(family.removeprefix(IMAGE_TEXT), vocab_size, special_ids)
    auto = AutoModelForImageTextToText if image_text else AutoModelForCausalLM
    record["class"] = auto._model_mapping[type(config)].__name__
    with torch.device("meta"):
        count = sum(p.numel() for p in auto.from_config(config).parameters())
    record["parameters"] = count
    if count > MAX_PARAMETERS:
        raise ValueError(f"{count:,} parameters after shrinking (the tiny sizes do not reach this config)")
    torch.manual_seed(0)
    return auto.from_config(config, dtype=torch.float32).eval()


def logits(model, ids):
    return model(input_ids=ids).logits.float()


def check(folder: Path) -> str | None:
    from shardtune.model.folder import model_folder_problems

    problems = model_folder_problems(folder)
    return f"check: {problems[0]}" if problems else None


def load(folder: Path, ids, reference) -> str | None:
    import torch

    from shardtune.model.load import load_causal_lm

    model = load_causal_lm(str(folder)).eval()
    with torch.no_grad():
        return same_logits(logits(model, ids), reference)


def skeleton(folder: Path, ids, reference) -> str | None:
    import torch

    from shardtune.model.attention import auto_choice
    from shardtune.model.finetuning.settings import FinetuningSettings
    from shardtune.model.folder import read_config_json
    from shardtune.model.source import ModelSource

    kernel = auto_choice(read_config_json(folder) or {}, has_cuda=False, model=str(folder)).kernel
    built = ModelSource(str(folder), FinetuningSettings(finetuning_type="full"), attn_implementation=kernel)
    skeleton = built.build_skeleton()
    buffers = skeleton.non_persistent_buffers()
    model = skeleton.model.to_empty(device="cpu")
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if name in skeleton.checkpoint_names:
                tensor.copy_(skeleton.read(skeleton.checkpoint_names[name]))
            elif name in buffers:
                tensor.copy_(buffers[name])
        return same_logits(logits(model.eval(), ids), reference)


def full(model, ids) -> str | None:
    import torch

    model.train().requires_grad_(True)
    loss = torch.nn.functional.cross_entropy(logits(model, ids)[0, :-1], ids[0, 1:])
    if not torch.isfinite(loss):
        return f"loss {float(loss)}"
    loss.backward()
    unused = [name for name, p in model.named_parameters() if p.grad is None]
    return f"ok ({len(unused)} without a gradient, e.g. {unused[0]})" if unused else None


def lora(folder: Path, ids) -> str | None:
    import torch

    from shardtune.model.finetuning.apply import apply_finetuning
    from shardtune.model.finetuning.settings import FinetuningSettings
    from shardtune.model.load import load_causal_lm

    model = apply_finetuning(load_causal_lm(str(folder)), FinetuningSettings(finetuning_type="lora"))
    model.train()
    loss = torch.nn.functional.cross_entropy(logits(model, ids)[0, :-1], ids[0, 1:])
    loss.backward()
    adapters = [p for name, p in model.named_parameters() if "lora_" in name]
    if not adapters:
        return "no LoRA parameter"
    without = sum(p.grad is None for p in adapters)
    return f"ok ({without} of {len(adapters)} adapters without a gradient)" if without else None


def same_logits(found, expected) -> str | None:
    import torch

    if found.shape != expected.shape:
        return f"logits of shape {tuple(found.shape)}, not {tuple(expected.shape)}"
    if not torch.allclose(found, expected, atol=1e-4, rtol=1e-4):
        return f"logits differ by up to {float((found - expected).abs().max()):.3g}"
    return None


def short(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text[:300]}"


def worker(families: list[str]) -> None:
    """The child: one JSON line per family, a START line before each (so the parent knows which one hung)."""
    import warnings

    warnings.filterwarnings("ignore")
    from transformers.utils import logging

    logging.set_verbosity_error()
    from shardtune.model.tiny import build_tiny_tokenizer, bundled_corpus

    tokenizer = build_tiny_tokenizer(bundled_corpus(), vocab_size=512)
    for family in families:
        print(f"START {family}", flush=True)
        with tempfile.TemporaryDirectory() as folder:
            try:
                record = run_family(family, tokenizer, Path(folder))
            except Exception:
                record = {"family": family, "build": short(RuntimeError(traceback.format_exc(limit=1)))}
        print("RESULT " + json.dumps(record), flush=True)


def census(families: list[str], timeout: float) -> list[dict]:
    """Workers run the families in order; a worker that exceeds the bound or dies is replaced for the rest."""
    records: dict[str, dict] = {}
    pending = list(families)
    while pending:
        proc = subprocess.Popen([sys.executable, __file__, "--worker", *pending], stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        current, started = None, time.monotonic()
        while True:
            ready, _, _ = select.select([proc.stdout], [], [], 1.0)
            if ready:
                line = proc.stdout.readline()
                if not line:
                    break
                if line.startswith("START "):
                    current, started = line.split(None, 1)[1].strip(), time.monotonic()
                elif line.startswith("RESULT "):
                    record = json.loads(line[7:])
                    records[record["family"]] = record
                    print(summary_line(record), flush=True)
            elif current and time.monotonic() - started > timeout:
                proc.kill()
                break
        proc.wait()
        if current and current not in records:
            records[current] = {"family": current, "build": f"no result: the worker hung for {timeout:.0f} s or "
                                                            f"died (exit {proc.returncode})"}
            print(summary_line(records[current]), flush=True)
        pending = [f for f in families if f not in records]
    return [records[f] for f in families]


def passed(record: dict, step: str) -> bool:
    return str(record.get(step, "")).startswith("ok")


def summary_line(record: dict) -> str:
    cells = " ".join(f"{step}={'ok' if passed(record, step) else 'FAIL'}" for step in ("build", *STEPS))
    return f"{record['family']:<28} {cells}"


def markdown(records: list[dict]) -> str:
    import transformers

    every = [r for r in records if all(passed(r, s) for s in ("build", *STEPS))]
    image_text = any(r["family"].startswith(IMAGE_TEXT) for r in records)
    table = "AutoModelForImageTextToText" if image_text else "AutoModelForCausalLM"
    counts = ", ".join(f"{step} {sum(passed(r, step) for r in records)}" for step in ("build", *STEPS))
    lines = [f"# Registry census: {datetime.date.today()}, transformers {transformers.__version__}, CPU, one process",
             "", f"`python scripts/registry_census.py{' --image-text' if image_text else ''} --out ...`: "
             f"{len(records)} {'image-text' if image_text else 'decoder'} families ({table}'s table); all steps "
             f"pass for {len(every)}. Passed per step: {counts}.", "",
             "| family | class | parameters | " + " | ".join(STEPS) + " |",
             "|---|---|---|" + "---|" * len(STEPS)]
    for r in records:
        if r.get("build") != "ok":
            lines.append(f"| `{r['family']}` | {r.get('class', '-')} | - | build: {cell(r['build'])} |"
                         + " |" * (len(STEPS) - 1))
            continue
        lines.append(f"| `{r['family']}` | {r['class']} | {r['parameters']:,} | "
                     + " | ".join(cell(r.get(s, "-")) for s in STEPS) + " |")
    return "\n".join(lines) + "\n"


def cell(text: str) -> str:
    return text.replace("|", "\\|") if text != "ok" else "ok"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("families", nargs="*")
    parser.add_argument("--out")
    parser.add_argument("--json")
    parser.add_argument("--timeout", type=float, default=180.0)
    parser.add_argument("--image-text", action="store_true", help="AutoModelForImageTextToText's families")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.families)
        return 0
    from shardtune.model.registry import decoder_families, image_text_families

    every = [IMAGE_TEXT + f for f in image_text_families()] if args.image_text else decoder_families()
    records = census(args.families or every, args.timeout)
    if args.json:
        Path(args.json).write_text("".join(json.dumps(r) + "\n" for r in records))
    if args.out:
        Path(args.out).write_text(markdown(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
