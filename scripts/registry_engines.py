#!/usr/bin/env python3
"""Every decoder family of the installed transformers on every engine: two processes against one, per-step losses.

  python scripts/registry_engines.py [--out FILE.md] [--json FILE.jsonl] [--bound S] [--work DIR] [FAMILY ...]

The families are transformers' own (``AutoModelForCausalLM``'s table, model/registry.py). For each, a tiny random
model is built from its own config class (``shardtune make-tiny-model --registry``) and three cells are trained on
two gloo processes, each against one process with the same global batch (4 steps of 8 rows):

  ddp-lora    DDP, ``finetuning_type: lora`` (``lora_target: all``)
  zero3-full  DeepSpeed ZeRO-3, full fine-tuning
  fsdp2-full  FSDP2 (``full_shard auto_wrap``), full fine-tuning

A cell passes when its per-step losses equal the one-process run's (relative 2e-3). Before anything trains, each
cell's config goes through the launching host's preflight (what ``shardtune check`` and ``shardtune train`` run):
a family it refuses is listed with its reason, never launched.

Cost: one ``shardtune train`` per cell would start Python, torch, transformers and DeepSpeed again for each of about
160 x 5 runs. Here one two-process launch trains every cell in turn and one process trains every reference
(scripts/registry_engine_ranks.py): the same rank entry, plan file, engines, loop and loss as ``shardtune train``.
A cell whose first step has not finished ``--bound`` seconds after it started, or which fails, ends its launch and
is that cell's failure (with its rank's error); the next launch goes on with the cells after it, so nothing hangs.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RANKS = Path(__file__).resolve().parent / "registry_engine_ranks.py"
PROCESSES = 2
# The run of tests/distributed/helpers.py (what test_engines_cli.py compares): 4 steps of 2 accumulated
# micro-batches of 4 rows on one process, of 2 rows on each of two.
COMMON = (str(REPO / "examples/tiny/sft_full.yaml"), f"dataset_dir={REPO / 'data'}", "max_steps=4", "logging_steps=1",
          "save_strategy=no", "do_eval=false", "eval_strategy=no", "val_size=0", "plot_loss=false", "max_samples=80",
          "gradient_accumulation_steps=2", "learning_rate=1e-3", "lr_scheduler_type=constant", "warmup_ratio=0")
CELLS: dict[str, tuple[tuple[str, ...], str]] = {
    "ddp-lora": ((), "lora"),
    "zero3-full": (("deepspeed=z3",), "full"),
    "fsdp2-full": (("fsdp=full_shard auto_wrap",), "full"),
}
EXAMPLE_CUTOFF = 256  # examples/tiny/sft_full.yaml's cutoff_len
LOSS_TOLERANCE = 2e-3  # relative, as tests/distributed/test_engines_cli.py
MAX_PARAMETERS = 30_000_000  # a config that does not shrink below this is reported, not built
BOUND_S = 120.0  # a cell whose first step has not finished this long after it started has failed
CELL_LIMIT_S = 600.0  # nor may a whole cell (load, 4 steps, save) take longer


def build_folder(family: str, folder: Path) -> str:
    """'ok' with the tiny model saved in ``folder``, or why it cannot be built (transformers' own error)."""
    import torch
    from transformers import AutoModelForCausalLM

    from shardtune.model.registry import special_token_ids, tiny_registry_config
    from shardtune.model.tiny import build_tiny_model

    try:
        tokenizer = tiny_tokenizer()
        config = tiny_registry_config(family, len(tokenizer), special_token_ids(tokenizer))
        with torch.device("meta"):
            count = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
        if count > MAX_PARAMETERS:
            return f"{count:,} parameters after shrinking (the tiny sizes do not reach this config)"
        if not (folder / "config.json").is_file():
            build_tiny_model(folder, arch=family, from_registry=True)
    except Exception as err:  # one family's failure is a row of the table, never the end of the matrix
        return "ok" if refused_as_downloaded(family, folder) else short(err)
    return "ok"


def refused_as_downloaded(family: str, folder: Path) -> bool:
    """A family the launching host refuses from its config.json alone (model/folder.py's ``UNTRAINABLE_FAMILIES``,
    a tower whose package is missing) needs no weights to show it: ``folder`` gets the family's default config and
    the tiny tokenizer, and every cell is then refused by the preflight, as a user's download would be."""
    from transformers import AutoConfig

    from shardtune.model.folder import untrainable_problems

    try:
        fields = AutoConfig.for_model(family).to_dict()
    except Exception:  # noqa: BLE001 - a default that does not build (Gemma 4's assistants): its model_type says it
        fields = {"model_type": family}
    if not untrainable_problems(folder / "config.json", family, fields):
        return False
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(fields, indent=2, default=str))
    tiny_tokenizer().save_pretrained(folder)
    return True


@functools.cache
def tiny_tokenizer():
    """The tokenizer build_tiny_model gives every registry family (its special ids go into the config)."""
    from shardtune.model.tiny import build_tiny_tokenizer, bundled_corpus

    return build_tiny_tokenizer(bundled_corpus(), vocab_size=2048)


def plan_cell(name: str, model: Path, out: Path, nproc: int, keys: tuple[str, ...], finetuning: str) -> dict:
    """The launching host's plan for one cell, written where the ranks read it; or why preflight refuses it."""
    from shardtune.errors import ShardtuneError
    from shardtune.launch.preflight import preflight, write_run_plan

    argv = [*COMMON, f"model_name_or_path={model}", f"output_dir={out}", f"finetuning_type={finetuning}",
            f"per_device_train_batch_size={8 // (2 * nproc)}", *cutoff_within_positions(model), *keys]
    try:
        plan = preflight(argv, 1, nproc, announce=False)
    except ShardtuneError as err:
        return {"cell": name, "refused": "; ".join(err.problems)}
    return {"cell": name, "plan": str(write_run_plan(plan)), "out": str(out)}


def cutoff_within_positions(model: Path) -> list[str]:
    """A family with a table of positions shorter than the example's rows (Blenderbot: 128) trains rows that fit
    it, as its users must (the preflight refuses longer ones: model/positions.py)."""
    import json

    from shardtune.model.positions import position_table

    table = position_table(json.loads((model / "config.json").read_text()))
    return [f"cutoff_len={table[1]}"] if table is not None and table[1] < EXAMPLE_CUTOFF else []


def plan_family(family: str, model: Path, runs: Path) -> tuple[list[dict], list[dict]]:
    """The one-process references (one per finetuning type) and the two-process cells of ``family``."""
    references = [plan_cell(f"{family}/one-{kind}", model, runs / family / f"one-{kind}", 1, (), kind)
                  for kind in sorted({finetuning for _, finetuning in CELLS.values()})]
    cells = [plan_cell(f"{family}/{cell}", model, runs / family / cell, PROCESSES, keys, finetuning)
             for cell, (keys, finetuning) in CELLS.items()]
    return references, cells


def run_cells(cells: list[dict], nproc: int, work: Path, bound: float) -> dict[str, dict]:
    """Every cell's end, ``{"code": 0}`` or ``{"code": N, "error": why}``: launches follow one another until each
    cell has ended (a failed or stuck cell ends its launch; the next starts after it)."""
    ends: dict[str, dict] = {}
    for attempt in range(1, len(cells) + 1):
        pending = [cell for cell in cells if cell["cell"] not in ends]
        if not pending:
            break
        launch_dir = work / f"launch-{nproc}-{attempt}"
        launch_dir.mkdir(parents=True, exist_ok=True)
        (launch_dir / "cells.json").write_text(json.dumps(pending))
        found = watch_launch(start_launch(launch_dir, nproc), launch_dir, pending, nproc, bound)
        if not found:  # the launch died before its first cell started: that cell takes the failure
            found = {pending[0]["cell"]: {"code": -1, "error": f"the launch ended before the cell started "
                                                               f"({tail(launch_dir / 'log.txt')})"}}
        ends.update(found)
    return ends


def start_launch(launch_dir: Path, nproc: int) -> subprocess.Popen:
    """torchrun with ``nproc`` ranks (a plain process for one), as `shardtune train` starts them on a CPU host."""
    rank = [str(RANKS), str(launch_dir / "cells.json"), str(launch_dir)]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    argv = [*torchrun, *rank] if nproc > 1 else [sys.executable, *rank]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "TQDM_DISABLE": "1",
           "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
    with (launch_dir / "log.txt").open("w") as log:
        return subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)


def watch_launch(proc: subprocess.Popen, launch_dir: Path, cells: list[dict], nproc: int,
                 bound: float) -> dict[str, dict]:
    """Wait for the launch; stop it when its current cell overruns the bound. The ends of its cells."""
    outputs = {cell["cell"]: Path(cell["out"]) for cell in cells}
    overrun = None
    while proc.poll() is None:
        time.sleep(0.5)
        current, started = current_cell(launch_dir, nproc)
        if current is not None:
            overrun = overrun_reason(time.time() - started, outputs[current], bound)
            if overrun:
                stop_launch(proc, launch_dir, current)
                break
    ends = finished_cells(launch_dir, nproc)
    current, started = current_cell(launch_dir, nproc)
    if current is not None and current not in ends:
        ends[current] = {"code": proc.returncode or -1, "error": overrun, "seconds": round(time.time() - started, 1)}
    for cell, end in ends.items():  # a rank under torchrun wrote its error where `shardtune train` writes it
        if end["code"] != 0 and not end.get("error"):
            end["error"] = rank_error(outputs[cell]) or ""
            if not end["error"] or "another rank" in end["error"]:  # that rank died without a word: say how
                end["error"] = launcher_reason(launch_dir / "log.txt", proc.returncode)
    return ends


def launcher_reason(log: Path, code: int | None) -> str:
    """How the launch's ranks died (torchrun's report of signals), with the C++ error a rank printed, if any."""
    text = log.read_text(errors="replace") if log.is_file() else ""
    signals = sorted(set(re.findall(r"\((SIG[A-Z]+)\)", text)))
    thrown = re.findall(r"what\(\):\s*(.+)", text)
    died = f"a rank died by {', '.join(signals)}" if signals else f"the launch ended with exit code {code}"
    return died + (f": {' '.join(thrown[0].split())[:300]}" if thrown else f" ({tail(log)})")


def stop_launch(proc: subprocess.Popen, launch_dir: Path, cell: str) -> None:
    """Kill the launcher and its ranks (torchrun starts them in sessions of their own, so the launcher's process
    group is not theirs); the ranks' Python stacks go to stuck-<cell>.txt first, where py-spy is installed."""
    import psutil  # type: ignore[import-untyped]  # DeepSpeed's and accelerate's dependency

    ranks = psutil.Process(proc.pid).children(recursive=True)
    spy = shutil.which("py-spy", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    if spy:
        dumps = [subprocess.run([spy, "dump", "--pid", str(rank.pid)], capture_output=True, text=True, timeout=60)
                 for rank in ranks]
        (launch_dir / f"stuck-{cell.replace('/', '-')}.txt").write_text("\n".join(d.stdout + d.stderr for d in dumps))
    for rank in ranks:
        with contextlib.suppress(psutil.NoSuchProcess):
            rank.kill()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    psutil.wait_procs(ranks, timeout=30)


def overrun_reason(elapsed: float, out: Path, bound: float) -> str | None:
    if elapsed > bound and not logged_losses(out):
        return f"first step not finished within {bound:g} s"
    if elapsed > CELL_LIMIT_S:
        return f"not finished within {CELL_LIMIT_S:g} s"
    return None


def status_lines(launch_dir: Path) -> list[dict]:
    lines = []
    for path in sorted(launch_dir.glob("rank-*.jsonl")):
        rank = int(path.stem.split("-")[1])
        lines += [{**json.loads(line), "rank": rank} for line in path.read_text().splitlines() if line.strip()]
    return lines


def current_cell(launch_dir: Path, nproc: int) -> tuple[str | None, float]:
    """The first cell some rank started and not every rank ended (a rank stuck in it holds its peers in the next
    one's collectives), and when it started; None between cells."""
    starts: dict[str, float] = {}
    ends: dict[str, int] = {}
    for line in status_lines(launch_dir):
        if line["event"] == "start":
            starts.setdefault(line["cell"], line["time"])
        else:
            ends[line["cell"]] = ends.get(line["cell"], 0) + 1
    open_cells = [(cell, started) for cell, started in starts.items() if ends.get(cell, 0) < nproc]
    return min(open_cells, key=lambda item: item[1]) if open_cells else (None, 0.0)


def finished_cells(launch_dir: Path, nproc: int) -> dict[str, dict]:
    """Cells every rank ended (code 0 on each) or one rank failed (its code and, from one process, its error);
    ``seconds`` from the first start to the last end."""
    lines_of: dict[str, list[dict]] = {}
    for line in status_lines(launch_dir):
        lines_of.setdefault(line["cell"], []).append(line)
    ends = {}
    for cell, lines in lines_of.items():
        done = [line for line in lines if line["event"] == "end"]
        failed = [line for line in done if line["code"] != 0]
        seconds = round(max(line["time"] for line in lines) - min(line["time"] for line in lines), 1)
        if failed:
            ends[cell] = {"code": failed[0]["code"], "error": failed[0].get("error"), "seconds": seconds}
        elif len(done) == nproc:
            ends[cell] = {"code": 0, "seconds": seconds}
    return ends


def rank_error(out: Path) -> str | None:
    """The first line of the rank error that is not a consequence of another rank's (launch/failures.py)."""
    lines = [path.read_text().splitlines()[0] for path in sorted((out / ".shardtune").glob("rank-*-error.txt"))]
    own = [line for line in lines if "lost the connection" not in line and "another rank" not in line]
    return (own or lines or [None])[0]  # type: ignore[list-item]


def logged_losses(out: Path) -> list[float]:
    log = out / "trainer_log.jsonl"
    if not log.is_file():
        return []
    records = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    return [record["loss"] for record in records if "loss" in record]


def tail(path: Path, chars: int = 300) -> str:
    text = " ".join(path.read_text(errors="replace").split()) if path.is_file() else ""
    return text[-chars:]


def short(err: BaseException) -> str:
    return f"{type(err).__name__}: {' '.join(str(err).split())[:300]}"


def run_matrix(families: list[str], work: Path, bound: float = BOUND_S) -> dict:
    """``families``: one record per family, its ``build`` ('ok' or why not) and each cell's outcome: 'ok',
    'refused: ...' (by the preflight, before launch) or 'failed ...: why', and each two-process cell's seconds;
    ``seconds``: the wall time of the whole matrix; ``launches``: the processes started (one per failed cell)."""
    started = time.time()
    records: dict[str, dict] = {family: {"family": family, "build": build_folder(family, work / "models" / family)}
                                for family in families}
    references, cells = [], []
    for family, record in records.items():
        if record["build"] == "ok":
            family_references, family_cells = plan_family(family, work / "models" / family, work / "runs")
            references += family_references
            cells += family_cells
    with ThreadPoolExecutor(2) as pool:  # the reference process runs beside the two ranks
        one = pool.submit(run_cells, [c for c in references if "plan" in c], 1, work / "one", bound)
        two = pool.submit(run_cells, [c for c in cells if "plan" in c], PROCESSES, work / "two", bound)
        ends = {**one.result(), **two.result()}
    planned = {c["cell"]: c for c in [*references, *cells]}
    for family, record in records.items():
        if record["build"] == "ok":
            record["cells"] = {cell: cell_outcome(f"{family}/{cell}", f"{family}/one-{finetuning}", planned, ends)
                               for cell, (_, finetuning) in CELLS.items()}
            record["seconds"] = {cell: ends[f"{family}/{cell}"]["seconds"] for cell in CELLS
                                 if f"{family}/{cell}" in ends}
    return {"families": [records[family] for family in families], "seconds": round(time.time() - started),
            "launches": len(list(work.glob("*/launch-*")))}


def cell_outcome(cell: str, reference: str, planned: dict[str, dict], ends: dict[str, dict]) -> str:
    """'ok' when the cell's per-step losses equal the one-process run's; else why not."""
    for name, what in ((reference, "one process"), (cell, "two processes")):
        if "refused" in planned[name]:
            return f"refused: {planned[name]['refused']}" + (f" ({what})" if name == reference else "")
        if ends[name]["code"] != 0:
            return f"failed ({what}): {ends[name]['error']}"
    one, two = logged_losses(Path(planned[reference]["out"])), logged_losses(Path(planned[cell]["out"]))
    if not one or len(one) != len(two) or any(abs(a - b) > LOSS_TOLERANCE * abs(a)
                                              for a, b in zip(one, two, strict=True)):
        return f"failed: losses {rounded(two)} on two processes, {rounded(one)} on one"
    return "ok"


def rounded(values: list[float]) -> list[float]:
    return [round(value, 4) for value in values]


def markdown(matrix: dict) -> str:
    import transformers

    records = matrix["families"]
    built = [r for r in records if r["build"] == "ok"]
    every = [r for r in built if all(v == "ok" for v in r["cells"].values())]
    refused = [r for r in built if all(v.startswith("refused") for v in r["cells"].values())]
    per_cell = ", ".join(f"{cell} {sum(r['cells'][cell] == 'ok' for r in built)}" for cell in CELLS)
    engine_minutes = ", ".join(f"{cell} {sum(r['seconds'].get(cell, 0) for r in built) / 60:.1f}" for cell in CELLS)
    lines = [f"# Registry x engines: {datetime.date.today()}, transformers {transformers.__version__}, CPU, "
             f"{PROCESSES} gloo processes against one", "",
             f"`python scripts/registry_engines.py --out ...`: {len(records)} decoder families "
             f"(AutoModelForCausalLM's table). {len(records) - len(built)} tiny configs cannot be built, "
             f"{len(refused)} families are refused before launch, {len(every)} pass every cell. Passing per cell: "
             f"{per_cell}.", "",
             f"Wall time of the whole matrix: {matrix['seconds'] / 60:.1f} min on a 2-core CPU ({matrix['launches']} "
             f"launches: one for the references, one for the two-process cells, one more after each failed cell); "
             f"minutes of two-process training per cell: {engine_minutes}.",
             "", "| family | " + " | ".join(CELLS) + " |", "|---|" + "---|" * len(CELLS)]
    for r in records:
        cells = [cell_text(r["cells"][c]) for c in CELLS] if r["build"] == "ok" else \
            [f"not built: {cell_text(r['build'])}", *[""] * (len(CELLS) - 1)]
        lines.append(f"| `{r['family']}` | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def cell_text(text: str) -> str:
    return text.replace("|", "\\|")


def main() -> int:
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("families", nargs="*")
    parser.add_argument("--out")
    parser.add_argument("--json")
    parser.add_argument("--bound", type=float, default=BOUND_S)
    parser.add_argument("--work", help="where models and runs go (default: a temporary folder)")
    args = parser.parse_args()
    from shardtune.model.registry import decoder_families

    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="registry-engines-"))
    matrix = run_matrix(args.families or decoder_families(), work, args.bound)
    for record in matrix["families"]:
        outcome = " ".join(f"{c}={v[:60]}" for c, v in record["cells"].items()) if "cells" in record else \
            f"build: {record['build'][:80]}"
        print(f"{record['family']:<28} {outcome}", flush=True)
    print(f"{matrix['seconds']} s, {matrix['launches']} launches; work folder {work}")
    if args.json:
        Path(args.json).write_text("".join(json.dumps(r) + "\n" for r in matrix["families"]))
    if args.out:
        Path(args.out).write_text(markdown(matrix))
    return 0


if __name__ == "__main__":
    sys.exit(main())
