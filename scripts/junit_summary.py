"""What a pytest run's JUnit XML says: tests passed / failed / skipped, the summed test time, the slowest files, and
every failure with the first line of its message. Rerunnable on any `--junitxml` file:

    python scripts/junit_summary.py /tmp/matrix-junit.xml [--top 15]
"""

from __future__ import annotations

import argparse
import collections
import xml.etree.ElementTree as ET


def test_file(classname: str) -> str:
    """The test module of a JUnit classname (``tests.unit.test_x`` or ``tests.unit.test_x.TestCase``)."""
    module, _, last = classname.rpartition(".")
    return module if last.startswith("Test") else classname


def summarize(path: str, top: int) -> str:
    cases = ET.parse(path).getroot().iter("testcase")
    counts: collections.Counter[str] = collections.Counter()
    by_file: collections.Counter[str] = collections.Counter()
    failures: list[str] = []
    total = 0.0
    for case in cases:
        seconds = float(case.get("time") or 0.0)
        total += seconds
        by_file[test_file(case.get("classname", "?"))] += seconds
        outcome = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed")
        counts[outcome] += 1
        if outcome in ("failure", "error"):
            message = next(child for child in case if child.tag == outcome).get("message", "")
            first = message.splitlines()[0][:200] if message else ""
            failures.append(f"{case.get('classname')}::{case.get('name')}: {first}")
    lines = [", ".join(f"{n} {k}" for k, n in sorted(counts.items())) + f"; summed test time {total:.0f} s"]
    lines += [f"  {seconds:7.0f} s  {name}" for name, seconds in by_file.most_common(top)]
    if failures:
        lines += ["failures:", *(f"  {f}" for f in failures)]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("junit_xml")
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    print(summarize(args.junit_xml, args.top))


if __name__ == "__main__":
    main()
