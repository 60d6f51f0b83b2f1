"""Registry entries on a hub (hf_hub_url with subset, split, folder, revision; ms_hub_url / om_hub_url; a
``REMOTE:`` dataset_dir) read from a small hub served on 127.0.0.1 (tests/local_hub.py), in process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardtune.data.registry import resolve_entries
from tests.local_hub import LocalHub


def records(*texts: str) -> bytes:
    return "\n".join(json.dumps({"instruction": t, "output": t.upper()}) for t in texts).encode()


@pytest.fixture()
def hub(tmp_path, monkeypatch):
    """The hub, and huggingface_hub pointed at it with an empty cache (as HF_ENDPOINT and HF_HOME would)."""
    from huggingface_hub import constants

    local = LocalHub().start()
    local.add("dataset", "org/subsets", {"en/train.jsonl": records("a", "b"), "en/test.jsonl": records("t"),
                                         "zh/train.jsonl": records("c"), "README.md": b"# subsets"})
    local.add("dataset", "org/folders", {"v2/data/train-00000-of-00001.jsonl": records("x"),
                                         "v1/data/train-00000-of-00001.jsonl": records("old")})
    local.add("dataset", "llamafactory/demo_data", {
        "dataset_info.json": json.dumps({"demo": {"file_name": "demo.jsonl"},
                                         "remote": {"hf_hub_url": "org/subsets", "subset": "zh"}}).encode(),
        "demo.jsonl": records("d")})
    monkeypatch.setattr(constants, "ENDPOINT", local.endpoint)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                        local.endpoint + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    yield local
    local.stop()


def write_registry(folder: Path, entries: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "dataset_info.json").write_text(json.dumps(entries))
    return folder


def test_subset_split_and_folder_pick_inside_the_downloaded_repo(hub, tmp_path):
    data = write_registry(tmp_path / "data", {
        "en": {"hf_hub_url": "org/subsets", "subset": "en"},
        "en_test": {"hf_hub_url": "org/subsets", "subset": "en", "split": "test"},
        "v2": {"hf_hub_url": "org/folders", "folder": "v2"}})
    (en, en_test, v2), problems = resolve_entries(["en", "en_test", "v2"], data)
    assert problems == []
    assert [f.name for f in en.data_files] == ["train.jsonl"] and en.data_files[0].parent.name == "en"
    assert [f.name for f in en_test.data_files] == ["test.jsonl"]
    assert v2.data_files[0].relative_to(v2.path).as_posix() == "v2/data/train-00000-of-00001.jsonl"
    assert not (v2.path / "v1").exists()  # only the entry's folder is downloaded
    downloads = [r for r in hub.requests if r.startswith("GET /datasets/")]
    assert len(downloads) == 3  # en's two files (en_test reads the same folder) and v2's one, each once
    assert hub.requests.count("GET /api/datasets/org/subsets/revision/main") == 1
    resolve_entries(["en", "v2"], data)  # a second resolution (a rank's) reads the cache only
    assert [r for r in hub.requests if r.startswith("GET /datasets/")] == downloads


def test_revision_pins_a_commit_and_an_unknown_one_is_one_line(hub, tmp_path):
    sha = hub.repos[("dataset", "org/subsets")].sha
    data = write_registry(tmp_path / "data", {"pinned": {"hf_hub_url": "org/subsets", "subset": "zh",
                                                         "revision": sha},
                                              "bad": {"hf_hub_url": "org/subsets", "revision": "v9"},
                                              "missing": {"hf_hub_url": "org/nothing"}})
    [pinned], problems = resolve_entries(["pinned"], data)
    assert problems == [] and sha in str(pinned.path)
    _, problems = resolve_entries(["bad", "missing"], data)
    assert len(problems) == 2
    assert "dataset 'bad': hf_hub_url: revision 'v9' of the dataset org/subsets does not exist" in problems[0]
    assert "dataset 'missing': hf_hub_url: the dataset org/nothing does not exist on the hub" in problems[1]


def test_remote_dataset_dir_is_the_registry_on_the_hub(hub, tmp_path):
    """LLaMA-Factory's ``dataset_dir: REMOTE:org/name``: its dataset_info.json, its files and its hub entries."""
    (demo, remote), problems = resolve_entries(["demo", "remote"], "REMOTE:llamafactory/demo_data")
    assert problems == []
    assert demo.data_files[0].name == "demo.jsonl" and remote.data_files[0].parent.name == "zh"


def test_modelscope_and_openmind_entries_need_their_client(hub, tmp_path, monkeypatch):
    data = write_registry(tmp_path / "data", {"ms": {"ms_hub_url": "org/ms-data"},
                                              "om": {"om_hub_url": "org/om-data"},
                                              "both": {"hf_hub_url": "org/subsets", "ms_hub_url": "org/ms-data",
                                                       "subset": "zh"}})
    _, problems = resolve_entries(["ms", "om"], data)
    assert "ModelScope (ms_hub_url: org/ms-data), whose client is not installed: `pip install modelscope`" \
        in problems[0]
    assert "Modelers (openMind) (om_hub_url: org/om-data)" in problems[1] and "openmind-hub" in problems[1]
    [both], problems = resolve_entries(["both"], data)  # hf_hub_url wins unless USE_MODELSCOPE_HUB says otherwise
    assert problems == []
    monkeypatch.setenv("USE_MODELSCOPE_HUB", "1")
    _, problems = resolve_entries(["both"], data)
    assert "pip install modelscope" in problems[0]


def test_offline_without_the_files_is_one_line_and_with_them_reads_the_cache(hub, tmp_path, monkeypatch):
    from huggingface_hub import constants

    data = write_registry(tmp_path / "data", {"en": {"hf_hub_url": "org/subsets", "subset": "en"},
                                              "zh": {"hf_hub_url": "org/subsets", "subset": "zh"}})
    resolve_entries(["en"], data)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    [en], problems = resolve_entries(["en"], data)
    assert problems == [] and en.data_files[0].parent.name == "en"
    _, [problem] = resolve_entries(["zh"], data)  # the same repo, but not its zh folder
    assert "dataset 'zh': hf_hub_url: org/subsets is not in the Hugging Face cache" in problem
    assert "HF_HUB_OFFLINE=1 forbids downloading it" in problem and "hf download org/subsets --repo-type dataset" \
        in problem


def test_an_unreachable_hub_is_one_line_naming_the_id(hub, tmp_path, monkeypatch):
    from huggingface_hub import constants

    hub.stop()
    data = write_registry(tmp_path / "data", {"en": {"hf_hub_url": "org/subsets", "subset": "en"}})
    _, [problem] = resolve_entries(["en"], data)
    assert f"org/subsets is not in the Hugging Face cache and the hub (HF_ENDPOINT {constants.ENDPOINT}) did " \
        "not answer" in problem
    assert "\n" not in problem


def test_script_and_bucket_entries_are_still_refused(tmp_path):
    data = write_registry(tmp_path / "data", {"s": {"script_url": "someone/script"}})
    _, [problem] = resolve_entries(["s"], data)
    assert "'script_url' (someone/script), which shardtune does not read" in problem and "file_name" in problem
