"""The built wheel installs into an environment that already holds torch without touching it, and trains from a
folder outside the checkout (make test-install; a few minutes, so not part of make test).

The wheel is built (``python -m build``) from a copy of the checkout that is deleted before anything is installed,
so a run that still reads a file of the source tree (the tokenizer corpus, DeepSpeed presets, the run page's static
files) fails here. The install goes through scripts/install_wheel.sh, the commands docker/Dockerfile runs
(tests/unit/test_dockerfile.py checks that they are the same).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.install, pytest.mark.timeout(1500)]

ROOT = Path(__file__).resolve().parents[2]
INSTALL_WHEEL = ROOT / "scripts" / "install_wheel.sh"
# Files of the package that are documentation, not read at run time.
NOT_PACKAGE_DATA = {"shardtune/estimate/README.md"}


def run(command: list[str], **kwargs) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(command, capture_output=True, text=True, **kwargs)
    output = f"{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    assert result.returncode == 0, f"{command} exited {result.returncode}:\n{output}"
    return result


def checkout_files() -> list[str]:
    """What a fresh clone plus this work tree's new files hold (tracked and untracked, not ignored)."""
    out = run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=ROOT).stdout
    return [name for name in out.split("\0") if name and (ROOT / name).is_file()]


def locked_torch() -> str:
    return next(line for line in (ROOT / "requirements.txt").read_text().splitlines() if line.startswith("torch=="))


def torch_files(python: Path) -> dict[str, tuple[int, int]]:
    """Every file of the installed torch distribution (its RECORD), with size and modification time: a reinstall or
    an upgrade changes them. The dist-info folder's name carries the version."""
    script = ("import importlib.metadata as m, json, os\n"
              "d = m.distribution('torch')\n"
              "out = {}\n"
              "for f in d.files:\n"
              "    p = f.locate()\n"
              "    if os.path.isfile(p):\n"
              "        s = os.stat(p)\n"
              "        out[str(f)] = (s.st_size, s.st_mtime_ns)\n"
              "print(json.dumps(out))")
    return {name: tuple(v) for name, v in json.loads(run([str(python), "-c", script]).stdout).items()}


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict[str, object]:
    """Build the wheel from a deleted copy of the checkout; a fresh venv with the lock's torch; the wheel installed
    by scripts/install_wheel.sh with its default extras; torch's files listed before and after."""
    base = tmp_path_factory.mktemp("wheel")
    copy = base / "checkout-copy"
    for name in checkout_files():
        (copy / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, copy / name)
    builder = sys.executable
    # From the temporary folder: in the checkout, its ignored build/ folder would import as a package named build.
    if subprocess.run([builder, "-c", "import build.__main__"], capture_output=True, cwd=base).returncode != 0:
        run([sys.executable, "-m", "venv", str(base / "build-env")])
        builder = str(base / "build-env" / "bin" / "python")
        run([builder, "-m", "pip", "install", "--quiet", "build"])
    run([builder, "-m", "build", "--wheel", "--outdir", str(base / "dist"), str(copy)], cwd=base)
    shutil.rmtree(copy)
    wheel = next((base / "dist").glob("shardtune-*.whl"))

    venv = base / "venv"
    run([sys.executable, "-m", "venv", str(venv)])
    python = venv / "bin" / "python"
    run([str(python), "-m", "pip", "install", "--quiet", locked_torch()])
    before = torch_files(python)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    install = run(["bash", str(INSTALL_WHEEL), str(python), str(wheel)], env=env)
    return {"wheel": wheel, "venv": venv, "python": python, "before": before, "after": torch_files(python),
            "install_log": install.stdout + install.stderr, "env": env}


def test_pip_changed_no_torch_file(installed) -> None:
    before, after = installed["before"], installed["after"]
    assert before, "torch lists no files"
    changed = sorted(name for name in before.keys() | after.keys() if before.get(name) != after.get(name))
    assert not changed, f"pip changed {len(changed)} of torch's files, e.g. {changed[:5]}"
    assert "Uninstalling torch" not in installed["install_log"]


def test_every_requirement_is_inside_the_declared_ranges(installed) -> None:
    """pip check: each installed distribution's requirements, shardtune's ranges and its extras' among them, hold."""
    run([str(installed["python"]), "-m", "pip", "check"])
    import_check = ("import importlib.metadata as m\n"
                    "for name in ('shardtune', 'deepspeed', 'nltk', 'ray'):\n"
                    "    print(name, m.version(name))")
    run([str(installed["python"]), "-c", import_check])


def test_an_empty_venv_resolves_inside_the_declared_ranges(installed, tmp_path) -> None:
    """pip's resolution of the wheel and its default extras in an empty venv (a dry run: nothing is installed, and
    with this machine's indexes torch resolves to the local CPU build): every package shardtune declares resolves to
    a version its range allows."""
    from packaging.requirements import Requirement

    venv = tmp_path / "empty"
    run([sys.executable, "-m", "venv", str(venv)])
    report = tmp_path / "resolution.json"
    run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--dry-run", "--ignore-installed",
         "--report", str(report), f"{installed['wheel']}[deepspeed]"], env=installed["env"])
    resolved = {item["metadata"]["name"].lower().replace("_", "-"): item["metadata"]["version"]
                for item in json.loads(report.read_text())["install"]}
    wheel_meta = zipfile.ZipFile(installed["wheel"])
    metadata = next(n for n in wheel_meta.namelist() if n.endswith(".dist-info/METADATA"))
    declared = [Requirement(line.split(":", 1)[1].strip()) for line in
                wheel_meta.read(metadata).decode().splitlines() if line.startswith("Requires-Dist:")]
    checked = []
    for requirement in declared:
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": "deepspeed"}):
            continue
        version = resolved.get(requirement.name.lower().replace("_", "-"))
        assert version is not None, f"{requirement.name} was not resolved"
        assert requirement.specifier.contains(version, prereleases=True), f"{requirement.name} {version}: {requirement}"
        checked.append(requirement.name)
    assert {"torch", "transformers", "peft", "accelerate", "datasets", "deepspeed"} <= set(checked), checked


def test_the_wheel_holds_every_file_the_package_reads(installed) -> None:
    in_wheel = set(zipfile.ZipFile(installed["wheel"]).namelist())
    package_files = {name.removeprefix("src/") for name in checkout_files()
                     if name.startswith("src/shardtune/") and "__pycache__" not in name}
    missing = sorted(package_files - in_wheel - NOT_PACKAGE_DATA)
    assert not missing, f"not in the wheel (pyproject.toml [tool.setuptools.package-data]): {missing}"


def test_the_tiny_example_trains_from_a_folder_outside_the_checkout(installed, tmp_path) -> None:
    """The user's own files only: the example's YAML and the demo data it names, copied into an empty folder; the
    tiny model is built from the package's tokenizer corpus; a DeepSpeed preset resolves from the package."""
    shutil.copy2(ROOT / "examples" / "tiny" / "sft_lora.yaml", tmp_path / "sft_lora.yaml")
    shutil.copytree(ROOT / "data", tmp_path / "data", ignore=shutil.ignore_patterns("demo_images*"))
    shardtune = str(installed["venv"] / "bin" / "shardtune")
    env = {**installed["env"], "OMP_NUM_THREADS": "1", "TORCH_EXTENSIONS_DIR": str(installed["venv"] / "ext")}
    where = run([str(installed["python"]), "-c", "import shardtune; print(shardtune.__file__)"], cwd=tmp_path,
                env=env).stdout.strip()
    assert where.startswith(str(installed["venv"])), where
    run([shardtune, "check", "sft_lora.yaml", "deepspeed=z3"], cwd=tmp_path, env=env)
    run([shardtune, "train", "sft_lora.yaml", "max_steps=4", "logging_steps=1", "save_steps=4",
         "output_dir=out"], cwd=tmp_path, env=env)
    results = json.loads((tmp_path / "out" / "train_results.json").read_text())
    assert results, "train_results.json is empty"
    assert (tmp_path / "out" / "adapter_model.safetensors").is_file()
    assert (tmp_path / "models" / "tiny-llama" / "config.json").is_file()
