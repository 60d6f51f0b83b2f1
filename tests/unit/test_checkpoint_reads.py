"""What reading a checkpoint may do: no code from the files runs, tensors land on the CPU, RNG state round trips."""

from __future__ import annotations

import ast
import pickle
import random
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from shardtune.engines.safe_load import load_dcp_weights_only
from shardtune.errors import ModelError
from shardtune.train.checkpoint import load_rng_file, rng_state, save_rng_file

SRC = Path(__file__).resolve().parents[2] / "src"


def torch_load_calls(tree: ast.AST) -> list[ast.Call]:
    return [node for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == "load" and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"]


def test_every_torch_load_in_src_names_map_location_and_weights_only():
    """A load without map_location lands on the device that saved the file (GPU 0 for every rank)."""
    found, wrong = 0, []
    for path in sorted(SRC.rglob("*.py")):
        for call in torch_load_calls(ast.parse(path.read_text())):
            found += 1
            keywords = {k.arg: k.value for k in call.keywords}
            weights_only = keywords.get("weights_only")
            if "map_location" not in keywords or not (isinstance(weights_only, ast.Constant) and weights_only.value):
                wrong.append(f"{path.relative_to(SRC)}:{call.lineno}")
    assert found >= 5, "the scan found no torch.load calls: is SRC right?"
    assert not wrong, f"torch.load without map_location or weights_only=True: {wrong}"


def draws() -> tuple:
    return random.random(), float(np.random.rand()), float(torch.rand(1))


def test_rng_state_round_trips_through_its_file(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    draws()
    save_rng_file(tmp_path / "rng.pt")
    expected = draws()
    draws()
    load_rng_file(tmp_path / "rng.pt")
    assert draws() == expected


def test_cuda_rng_state_is_saved_only_when_cuda_is_in_use():
    # Without CUDA (or before this process used it) the file is what it always was.
    in_use = torch.cuda.is_available() and torch.cuda.is_initialized()
    assert ("cuda" in rng_state()) == in_use


# --- torch distributed checkpoints (FSDP sharded state) ---

class WritesFile:
    """Unpickling this object creates ``path``: it stands for any code a tampered checkpoint could run."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (str(self.path), "w"))


def save_dcp(state: dict, path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group": one process writes every shard
        dcp.save(state, checkpoint_id=str(path))


def trained_linear() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, betas=(0.8, 0.9))
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_a_real_dcp_checkpoint_loads_weights_only(tmp_path):
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, optimizer = trained_linear()
    save_dcp(dict(zip(("model", "optim"), get_state_dict(model, optimizer), strict=True)), tmp_path / "ckpt")
    fresh = torch.nn.Linear(4, 3)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.5)
    state = dict(zip(("model", "optim"), get_state_dict(fresh, fresh_opt), strict=True))
    load_dcp_weights_only(state, tmp_path / "ckpt")
    set_state_dict(fresh, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    assert torch.equal(fresh.weight, model.weight)
    assert fresh_opt.param_groups[0]["lr"] == 0.1 and tuple(fresh_opt.param_groups[0]["betas"]) == (0.8, 0.9)
    assert torch.equal(fresh_opt.state[fresh.weight]["exp_avg"], optimizer.state[model.weight]["exp_avg"])


def test_a_dcp_metadata_file_carrying_code_is_refused_before_it_runs(tmp_path):
    ckpt = tmp_path / "ckpt"
    save_dcp({"model": {"w": torch.ones(3)}}, ckpt)
    marker = tmp_path / "payload-ran"
    (ckpt / ".metadata").write_bytes(pickle.dumps(WritesFile(marker)))
    with pytest.raises(ModelError, match=r"\.metadata refers to io\.open.*refusing to unpickle"):
        load_dcp_weights_only({"model": {"w": torch.zeros(3)}}, ckpt)
    assert not marker.exists()
    # The payload is live: torch's own reader (a plain pickle.load) runs it.
    with (ckpt / ".metadata").open("rb") as stream:
        pickle.load(stream)
    assert marker.exists()


def test_a_dcp_value_carrying_code_is_refused_before_it_runs(tmp_path):
    ckpt, marker = tmp_path / "ckpt", tmp_path / "payload-ran"
    save_dcp({"model": {"w": torch.ones(3)}, "extra": WritesFile(marker)}, ckpt)  # pickled, not run, on save
    assert not marker.exists()
    with pytest.raises(ModelError, match="extra is not plain data"):
        load_dcp_weights_only({"model": {"w": torch.zeros(3)}, "extra": None}, ckpt)
    assert not marker.exists()
