"""Random mutations of a valid config and of a data file: `shardtune check` either passes or exits 2 cleanly."""

from __future__ import annotations

import contextlib
import io
import json
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from shardtune.cli import main
from shardtune.config.schema import key_names
from tests.conftest import REPO

VALID = {"model_name_or_path": "org/model", "dataset": "demo", "dataset_dir": str(REPO / "data"),
         "template": "chatml", "output_dir": "outputs/fuzz", "max_steps": 2}
VALUES = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6), st.floats(allow_nan=True),
                   st.text(max_size=20), st.lists(st.text(max_size=5), max_size=3),
                   st.dictionaries(st.text(max_size=5), st.integers(), max_size=2))
KEYS = st.one_of(st.sampled_from(key_names()), st.text(min_size=1, max_size=12))


def run_check(config: str | bytes) -> tuple[int, str]:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "cfg.yaml"
        path.write_bytes(config if isinstance(config, bytes) else config.encode())
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = main(["check", str(path)])
    return code, err.getvalue()


# Derandomized: the same examples every run (make test must not fail one run in ten); widen with SEED below.
@settings(derandomize=True, database=None, max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(KEYS, VALUES, max_size=4))
@example({"model_name_or_path": "0\r"})  # found by hypothesis: a value's line break must not split the message
@example({"fsdp": ["\x1e"]})  # found by hypothesis: str.splitlines() also breaks at the record separator
@example({"pref_loss": []})  # found by hypothesis: an unhashable value reached a lookup in the key's mapping
def test_mutated_configs_pass_or_exit_2(mutation):
    code, err = run_check(json.dumps({**VALID, **mutation}, default=str))
    assert code in (0, 2), err
    assert "Traceback" not in err
    if code == 2:
        lines = err.strip().splitlines()
        assert any(line.startswith("shardtune: error:") for line in lines), err
        assert all(line.startswith(("shardtune: error:", "shardtune: warning:")) for line in lines), err


@settings(derandomize=True, database=None, max_examples=60, deadline=None)
@given(st.binary(max_size=200))
def test_garbage_config_files_exit_2(blob):
    code, err = run_check(blob)
    assert code == 2 and "Traceback" not in err


@settings(derandomize=True, database=None, max_examples=60, deadline=None)
@given(st.lists(st.one_of(st.text(max_size=40), st.just('{"instruction": "a", "output": "b"}')), max_size=5))
def test_mutated_data_files_pass_or_exit_2(lines):
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "d.jsonl").write_text("\n".join(lines))
        (Path(tmp) / "dataset_info.json").write_text(json.dumps({"d": {"file_name": "d.jsonl"}}))
        code, err = run_check(json.dumps({**VALID, "dataset": "d", "dataset_dir": tmp}))
    assert code in (0, 2) and "Traceback" not in err
