"""The architecture table (docs/architectures.md) is generated from the tests' parametrization and must be current."""

from __future__ import annotations

import os
import sys

from tests.conftest import REPO
from tests.rank_server import run_python


def test_the_architecture_table_is_current():
    # (forked by the session's rank server where it can: collecting tests/distributed imports the whole stack)
    done = run_python([sys.executable, str(REPO / "scripts/architecture_table.py"), "--check"], os.environ.copy(),
                      REPO, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:] + done.stdout[-2000:]


def test_the_table_marks_each_tested_cell_with_its_tier():
    sys.path.insert(0, str(REPO / "scripts"))
    from architecture_table import table

    rows = {line.split(" | ")[0]: line for line in table({("qwen3", "zero3", "full"): "test",
                                                          ("qwen3", "zero3", "lora"): "matrix"}).splitlines()
            if line.startswith("| `")}
    assert rows["| `qwen3`"].split(" | ")[3] == "test / matrix"
    assert rows["| `qwen3`"].endswith("| tied embeddings (as Qwen3-0.6B to 4B) |")
    assert rows["| `gpt_oss`"].split(" | ")[1:6] == ["- / -"] * 5
