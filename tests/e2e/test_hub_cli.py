"""Hub models and datasets through the real CLI, against a small hub served on 127.0.0.1 (tests/local_hub.py,
``HF_ENDPOINT``): two of LLaMA-Factory's example files whose data is on the hub (tests/fixtures/llamafactory_hub/,
unchanged from its examples/ at ff6d4d12eeb0) and a hub model id, downloaded once before the ranks start; an
unreachable hub and offline mode without the files end in one line naming the id, offline mode with them trains.
"""

from __future__ import annotations

import json
import math
import socket
from pathlib import Path

import pytest

from tests.conftest import REPO, run_cli
from tests.local_hub import LocalHub, folder_files

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

FIXTURES = REPO / "tests" / "fixtures" / "llamafactory_hub"
LF_DATA = REPO / "tests" / "fixtures" / "llamafactory_examples" / "data"
MODEL_ID = "shardtune-test/tiny-llama"
# Small enough for two CPU steps; the files keep their own batch, accumulation and template.
SHORT = ("max_steps=2", "cutoff_len=128", "max_samples=16")


@pytest.fixture(scope="module")
def hub(tiny_model_dir):
    """The tiny model as a hub model, LLaMA-Factory's alpaca_zh (tiny stand-in) and its demo_data registry."""
    local = LocalHub().start()
    local.add("model", MODEL_ID, folder_files(tiny_model_dir))
    local.add("dataset", "llamafactory/alpaca_zh", {
        "alpaca_data_zh_51k.json": (LF_DATA / "alpaca_zh.json").read_bytes(),
        "README.md": b"---\nlicense: cc-by-4.0\n---\n"})
    demo = {"identity": {"file_name": "identity.json"}, "alpaca_en_demo": {"file_name": "alpaca_en_demo.json"}}
    local.add("dataset", "llamafactory/demo_data", {
        "dataset_info.json": json.dumps(demo).encode(),
        "identity.json": (LF_DATA / "identity.json").read_bytes(),
        "alpaca_en_demo.json": (LF_DATA / "alpaca_en_demo.json").read_bytes()})
    yield local
    local.stop()


def hub_env(home: Path, endpoint: str, offline: str = "0") -> dict[str, str]:
    return {"HF_HOME": str(home), "HF_HUB_CACHE": str(home / "hub"), "HF_ENDPOINT": endpoint, "HF_TOKEN": "",
            "HF_HUB_OFFLINE": offline, "TRANSFORMERS_OFFLINE": offline, "HF_HUB_DISABLE_TELEMETRY": "1",
            "HF_DATASETS_CACHE": str(home / "datasets")}


def errors(result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("shardtune: error:")]


def resolved_files(hub: LocalHub, repo: str) -> list[str]:
    return [r for r in hub.requests if r.startswith(f"GET /{repo}/resolve/")]


def test_lf_ray_example_reads_its_remote_registry_and_a_hub_model_on_two_processes(hub, tmp_path):
    """qwen3_lora_sft_ray.yaml: ``dataset_dir: REMOTE:llamafactory/demo_data`` and the model given as a hub id;
    2 ranks, and every file of both repositories is fetched once, before they start."""
    out = tmp_path / "out"
    result = run_cli("train", str(FIXTURES / "qwen3_lora_sft_ray.yaml"), f"model_name_or_path={MODEL_ID}",
                     f"output_dir={out}", *SHORT, cwd=tmp_path, FORCE_TORCHRUN="1", NPROC_PER_NODE="2",
                     timeout=800, **hub_env(tmp_path / "hf", hub.endpoint))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    results = json.loads((out / "train_results.json").read_text())
    assert results["world_size"] == 2 and results["global_step"] == 2 and math.isfinite(results["final_loss"])
    data_gets = resolved_files(hub, "datasets/llamafactory/demo_data")
    assert len(data_gets) == len(set(data_gets)) == 3, data_gets
    model_gets = resolved_files(hub, MODEL_ID)
    assert len(model_gets) == len(set(model_gets)) == len(hub.repos[("model", MODEL_ID)].files), model_gets


def test_lf_example_with_an_hf_hub_url_entry_trains(hub, tiny_model_dir, tmp_path):
    """ascend/qwen3moe_full_sft_fsdp.yaml: ``dataset: alpaca_zh``, which LLaMA-Factory's own dataset_info.json
    names by hf_hub_url (and ms_hub_url: hf is read unless USE_MODELSCOPE_HUB=1, as there). Its fa2 needs a CUDA
    GPU, so sdpa here; one process."""
    out = tmp_path / "out"
    result = run_cli("train", str(FIXTURES / "qwen3moe_full_sft_fsdp.yaml"), f"model_name_or_path={tiny_model_dir}",
                     f"dataset_dir={FIXTURES / 'data'}", f"output_dir={out}", "flash_attn=sdpa", *SHORT,
                     cwd=tmp_path, NPROC_PER_NODE="1", timeout=600, **hub_env(tmp_path / "hf", hub.endpoint))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    results = json.loads((out / "train_results.json").read_text())
    assert results["global_step"] == 2 and math.isfinite(results["final_loss"])
    assert resolved_files(hub, "datasets/llamafactory/alpaca_zh")


def test_offline_with_the_files_cached_trains_and_without_them_is_one_line(hub, tmp_path):
    from huggingface_hub import snapshot_download

    home = tmp_path / "hf"
    for repo, kind in ((MODEL_ID, "model"), ("llamafactory/alpaca_zh", "dataset")):
        snapshot_download(repo, repo_type=kind, cache_dir=home / "hub", endpoint=hub.endpoint)
    closed = f"http://127.0.0.1:{closed_port()}"  # offline must not even try it
    args = ("train", str(FIXTURES / "qwen3moe_full_sft_fsdp.yaml"), f"model_name_or_path={MODEL_ID}",
            f"dataset_dir={FIXTURES / 'data'}", "flash_attn=sdpa", *SHORT, "max_steps=1")
    result = run_cli(*args, f"output_dir={tmp_path / 'out'}", cwd=tmp_path, NPROC_PER_NODE="1", timeout=600,
                     **hub_env(home, closed, offline="1"))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    result = run_cli(*args, f"output_dir={tmp_path / 'out2'}", cwd=tmp_path, NPROC_PER_NODE="1", timeout=300,
                     **hub_env(tmp_path / "empty", closed, offline="1"))
    assert result.returncode == 2, result.stderr[-3000:]
    lines = errors(result)
    assert any(f"model_name_or_path: {MODEL_ID} is not in the Hugging Face cache and HF_HUB_OFFLINE=1" in line
               for line in lines), lines
    assert any("dataset 'alpaca_zh': hf_hub_url: llamafactory/alpaca_zh is not in the Hugging Face cache" in line
               and "HF_HUB_OFFLINE=1 forbids downloading it" in line for line in lines), lines


def test_an_unreachable_hub_is_one_line_naming_each_id(tmp_path):
    closed = f"http://127.0.0.1:{closed_port()}"
    result = run_cli("train", str(FIXTURES / "qwen3_lora_sft_ray.yaml"), f"model_name_or_path={MODEL_ID}",
                     f"output_dir={tmp_path / 'out'}", *SHORT, cwd=tmp_path, NPROC_PER_NODE="1", timeout=300,
                     **hub_env(tmp_path / "hf", closed))
    assert result.returncode == 2, result.stderr[-3000:]
    lines = errors(result)
    said = f"is not in the Hugging Face cache and the hub (HF_ENDPOINT {closed}) did not answer"
    assert any(line.startswith(f"shardtune: error: model_name_or_path: {MODEL_ID} {said}") for line in lines), lines
    assert any(f"dataset_dir REMOTE:llamafactory/demo_data: llamafactory/demo_data {said}" in line
               for line in lines), lines


def test_a_missing_repo_or_revision_is_one_line(hub, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "dataset_info.json").write_text(json.dumps({
        "gone": {"hf_hub_url": "llamafactory/no_such_data"},
        "pinned": {"hf_hub_url": "llamafactory/alpaca_zh", "revision": "v0.0"}}))
    result = run_cli("check", str(FIXTURES / "qwen3_lora_sft_ray.yaml"), "model_name_or_path=someorg/no-such-model",
                     f"dataset_dir={data}", "dataset=gone,pinned", f"output_dir={tmp_path / 'out'}", cwd=tmp_path,
                     timeout=300, **hub_env(tmp_path / "hf", hub.endpoint))
    assert result.returncode == 2, result.stderr[-3000:]
    lines = errors(result)
    assert any("dataset 'gone': hf_hub_url: the dataset llamafactory/no_such_data does not exist on the hub" in line
               for line in lines), lines
    assert any("revision 'v0.0' of the dataset llamafactory/alpaca_zh does not exist" in line for line in lines), lines


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
