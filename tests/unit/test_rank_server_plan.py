"""The rank server's pure parts: which environments it can serve, and each rank's environment."""

from __future__ import annotations

from shardtune.launch.rank_server import import_time_differences
from shardtune.launch.served import rank_environments


def test_variables_read_at_import_must_match_the_server():
    served = {"HOME": "/root", "HF_HOME": "/a", "PATH": "/bin", "OMP_NUM_THREADS": "1"}
    assert import_time_differences(served, {**served, "HF_HOME": "/b"}) == ["HF_HOME"]
    assert import_time_differences(served, {**served, "PYTHONPATH": "x"}) == ["PYTHONPATH"]
    assert import_time_differences(served, {k: v for k, v in served.items() if k != "HF_HOME"}) == ["HF_HOME"]


def test_variables_read_at_run_time_or_applied_by_the_fork_may_differ():
    served = {"HOME": "/root", "OMP_NUM_THREADS": "1"}
    wanted = {**served, "PATH": "/other", "OMP_NUM_THREADS": "4", "MALLOC_MMAP_THRESHOLD_": "131072",
              "SHARDTUNE_RANK_SERVER": "/tmp/s", "NPROC_PER_NODE": "2", "FORCE_TORCHRUN": "1",
              "TORCHELASTIC_RUN_ID": "x", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "GLOO_SOCKET_IFNAME": "lo"}
    assert import_time_differences(served, wanted) == []


def test_each_rank_gets_its_place_in_a_one_node_job():
    envs = rank_environments({"PATH": "/bin", "RANK": "stale"}, 3, "127.0.0.1", 29511, "run-1")
    assert [(e["RANK"], e["LOCAL_RANK"], e["ROLE_RANK"]) for e in envs] == [("0", "0", "0"), ("1", "1", "1"),
                                                                            ("2", "2", "2")]
    assert {(e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"], e["MASTER_PORT"], e["TORCHELASTIC_RUN_ID"], e["PATH"])
            for e in envs} == {("3", "3", "29511", "run-1", "/bin")}


def test_a_pythonpath_of_folders_the_server_already_imports_from_is_served(tmp_path):
    """A test's workers add the repository and its src folder (already on the server's path): served; a folder new
    to the server could hold other copies of what it imported, and dropping the server's own entry cannot be
    undone in a fork: refused."""
    repo, src, new = tmp_path / "repo", tmp_path / "repo" / "src", tmp_path / "elsewhere"
    for folder in (repo, src, new):
        folder.mkdir(parents=True, exist_ok=True)
    on_path = [str(repo), "/usr/lib/python3", str(src)]
    served = {"HOME": "/root"}
    for value in (f"{src}:{repo}:", f"{src}", "src", ""):  # "": the working folder, the repository here
        assert import_time_differences(served, {**served, "PYTHONPATH": value}, on_path, str(repo)) == [], value
    assert import_time_differences(served, {**served, "PYTHONPATH": f"{src}:{new}"}, on_path,
                                   str(repo)) == ["PYTHONPATH"]
    started_with = {**served, "PYTHONPATH": str(src)}
    assert import_time_differences(started_with, served, on_path, str(repo)) == ["PYTHONPATH"]
