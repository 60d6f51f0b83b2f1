"""Where a `pytest -n` session's wall time goes, from the timeline its workers wrote (tests/cores.py):

    SHARDTUNE_TEST_TIMELINE=/tmp/timeline.jsonl make test
    python scripts/test_timeline.py /tmp/timeline.jsonl [--top 15]

Prints the span, each worker's time running a test, waiting for cores and between tests, how full the cores were
(core-seconds held over cores x span), the core-seconds by tier and by file, and the tests of the last minutes.
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path


def load(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def per_worker(rows: list[dict], start: float, end: float) -> list[str]:
    lines = []
    for worker in sorted({r["worker"] for r in rows}):
        mine = [r for r in rows if r["worker"] == worker]
        running = sum(r["done"] - r["held"] for r in mine)
        waiting = sum(r["held"] - r["asked"] for r in mine)
        lines.append(f"  {worker}: {len(mine)} tests, running {running:7.0f} s, waiting for cores {waiting:6.0f} s, "
                     f"elsewhere {end - start - running - waiting:6.0f} s (collection, fixtures between tests, idle)")
    return lines


def by_key(rows: list[dict], key) -> collections.Counter[str]:
    seconds: collections.Counter[str] = collections.Counter()
    for row in rows:
        seconds[key(row["test"])] += (row["done"] - row["held"]) * row["cores"]
    return seconds


def summarize(rows: list[dict], cores: int, top: int) -> str:
    start = min(r["asked"] for r in rows)
    end = max(r["done"] for r in rows)
    held = sum((r["done"] - r["held"]) * r["cores"] for r in rows)
    out = [f"{len(rows)} tests over {end - start:.0f} s; cores held {held:.0f} core-s of {cores} x {end - start:.0f}"
           f" = {held / (cores * (end - start)):.0%}"]
    out += per_worker(rows, start, end)
    out.append("core-seconds by tier:")
    tiers = by_key(rows, lambda test: test.split("/")[1] if test.count("/") > 1 else test)
    out += [f"  {seconds:7.0f}  {tier}" for tier, seconds in tiers.most_common()]
    out.append(f"core-seconds by file (top {top}):")
    files = by_key(rows, lambda test: test.split("::")[0])
    out += [f"  {seconds:7.0f}  {name}" for name, seconds in files.most_common(top)]
    out.append("the last 3 minutes:")
    for row in sorted(rows, key=lambda r: r["done"]):
        if row["done"] > end - 180:
            out.append(f"  {row['held'] - start:6.0f} -> {row['done'] - start:6.0f} s  {row['worker']}  "
                       f"{row['cores']} core(s)  {row['test']}")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("timeline", type=Path)
    parser.add_argument("--cores", type=int, default=2, help="the cores the session had (default 2)")
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    print(summarize(load(args.timeline), args.cores, args.top))


if __name__ == "__main__":
    main()
