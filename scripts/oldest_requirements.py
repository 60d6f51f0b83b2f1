"""The oldest supported stack, read from pyproject.toml's lower bounds, for `make test-oldest`.

    python scripts/oldest_requirements.py --extras deepspeed,metrics,web > build/oldest-requirements.txt
    python scripts/oldest_requirements.py --extras deepspeed,metrics,web --check build/oldest-venv/bin/python

Prints ``name==lower-bound`` for every dependency and each named extra; torch is the lock's (requirements.txt),
since this machine has one CPU build of torch and the oldest torch runs on a GPU machine instead. ``--check`` asks
that interpreter's installed versions and fails (exit 1) on any that is not the lower bound: pip did not quietly
move one up. The ranges themselves are decided in docs/development.md ("Supported versions").
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
REQUIREMENT = re.compile(r"^\s*([A-Za-z0-9_.\-\[\]]+?)\s*(\[.*\])?\s*((?:[<>=!~]=?[^,;]+,?\s*)*)(;.*)?$")


def lower_bound(requirement: str) -> tuple[str, str | None]:
    """``"peft>=0.18.0,<1"`` -> ("peft", "0.18.0"); a requirement without ``>=``/``==`` -> (name, None)."""
    found = REQUIREMENT.match(requirement)
    if not found:
        raise SystemExit(f"pyproject.toml: cannot read the requirement {requirement!r}")
    name, specifiers = found[1], found[3] or ""
    floor = re.search(r"(?:>=|==)\s*([^,\s]+)", specifiers)
    return name, floor[1] if floor else None


def with_extras(requirement: str) -> str:
    """``"ray[train]>=2.60.0,<3"`` -> ``"ray[train]"``: what pip installs, the name and its extras."""
    found = REQUIREMENT.match(requirement)
    assert found is not None
    return found[1] + (found[2] or "")


def oldest(extras: list[str]) -> dict[str, str]:
    """Each declared dependency (and each named extra's) -> its lower bound; torch -> the lock's version."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    unknown = [e for e in extras if e not in project.get("optional-dependencies", {})]
    if unknown:
        raise SystemExit(f"no such extra in pyproject.toml: {', '.join(unknown)}")
    requirements = list(project["dependencies"])
    for extra in extras:
        requirements += project["optional-dependencies"][extra]
    floors: dict[str, str] = {}
    for requirement in requirements:
        name, floor = lower_bound(requirement)
        if floor is None:
            raise SystemExit(f"pyproject.toml: {requirement!r} declares no lower bound")
        floors[with_extras(requirement)] = floor
    floors["torch"] = locked("torch")
    return floors


def locked(name: str) -> str:
    """The version requirements.txt (the lock) pins for ``name``."""
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        if line.startswith(f"{name}=="):
            return line.split("==", 1)[1].strip()
    raise SystemExit(f"requirements.txt pins no {name}")


def installed(python: str, names: list[str]) -> dict[str, str | None]:
    """Each name's installed version in ``python``'s environment (None: not installed)."""
    script = ("import importlib.metadata as m, json, sys\n"
              "def v(n):\n    try:\n        return m.version(n)\n"
              "    except m.PackageNotFoundError:\n        return None\n"
              "print(json.dumps({n: v(n) for n in sys.argv[1:]}))")
    out = subprocess.run([python, "-c", script, *names], check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def same_release(found: str | None, wanted: str) -> bool:
    """``2.13.0+cpu`` is the lock's ``2.13.0``; ``1.0`` is ``1.0.0``."""
    def parts(text: str) -> list[int]:
        numbers = [int(p) for p in re.findall(r"\d+", text.split("+")[0])]
        while numbers and numbers[-1] == 0:
            numbers.pop()
        return numbers

    return found is not None and parts(found) == parts(wanted)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--extras", default="", help="comma-separated extras of pyproject.toml to include")
    parser.add_argument("--check", metavar="PYTHON", help="compare this interpreter's installed versions instead")
    args = parser.parse_args()
    floors = oldest([e for e in args.extras.split(",") if e])
    if not args.check:
        print("\n".join(f"{name}=={version}" for name, version in floors.items()))
        return 0
    floors = {name.split("[")[0]: version for name, version in floors.items()}
    found = installed(args.check, list(floors))
    wrong = {n: found[n] for n, v in floors.items() if not same_release(found[n], v)}
    for name, version in floors.items():
        print(f"  {name:<14} {found[name] or 'not installed':<14} (lower bound {version})")
    if wrong:
        print(f"not at the lower bound: {', '.join(wrong)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
