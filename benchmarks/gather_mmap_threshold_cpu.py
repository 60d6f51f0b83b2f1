"""glibc's mmap threshold on the CPU ranks of an engine that gathers parameters: the 206M-parameter ZeRO-3 LoRA run
of ``make test-big`` (``zero3_lora_ratio_cpu.py``: 2 CPU ranks, bounded ZeRO-3, LoRA rank 16 on all linear
layers, cutoff 128, 3 steps, final save) with the threshold the launcher sets for FSDP and ZeRO-3 on the CPU
against the 128 KiB it set before. Interleaved pairs; per run each rank's measured peak, the measured over
estimated ratio of the run's memory line and the loop's time (``train_runtime``).

    .venv/bin/python benchmarks/gather_mmap_threshold_cpu.py [--repeats 3] [--precision bf16|fp32] [--work DIR]

Results go to benchmarks/results/gather-mmap-threshold-cpu.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, machine_line  # noqa: E402
from zero3_lora_ratio_cpu import RESULTS, big_zero3  # noqa: E402

from shardtune.launch.supervise import GATHERING_MMAP_THRESHOLD  # noqa: E402

BEFORE = 128 * 1024
SETTINGS = {f"{BEFORE // 1024} KiB (before)": BEFORE,
            f"{GATHERING_MMAP_THRESHOLD // 1024} KiB (the launcher's)": GATHERING_MMAP_THRESHOLD}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--work", type=Path, default=None, help="keep the built model here between runs")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="gather-mmap-threshold-"))
    work.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict]] = {name: [] for name in SETTINGS}
    for repeat in range(args.repeats):
        for name, threshold in SETTINGS.items():
            found = big_zero3(work, args.precision == "bf16", f"-{threshold}", MALLOC_MMAP_THRESHOLD_=str(threshold))
            runs[name].append(found)
            print(f"[{repeat + 1}/{args.repeats}] {name}: {json.dumps(found)}", flush=True)
    info = machine()
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "gather-mmap-threshold-cpu"
    out.with_suffix(".json").write_text(json.dumps({"machine": info, "precision": args.precision, "runs": runs},
                                                   indent=1) + "\n")
    lines = [f"# mmap threshold on CPU ranks that gather: 206M ZeRO-3 LoRA, {args.precision}, 2 CPU ranks", "",
             f"`benchmarks/gather_mmap_threshold_cpu.py --repeats {args.repeats} --precision {args.precision}`, "
             f"{time.strftime('%Y-%m-%d %H:%M')}; interleaved runs.", "", machine_line(info), "",
             "| threshold | ratio per run | median ratio | peak per rank, median | loop seconds, median |",
             "|---|---|---|---|---|"]
    for name, found in runs.items():
        peaks = [max(r["peak_mib"]) for r in found]
        lines.append(f"| {name} | {', '.join(str(r['ratio']) for r in found)} | "
                     f"{statistics.median(r['ratio'] for r in found)} | {statistics.median(peaks)} MiB | "
                     f"{statistics.median(r['loop_seconds'] for r in found):.2f} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
