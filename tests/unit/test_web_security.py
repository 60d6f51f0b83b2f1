"""`shardtune web` locked down: every API request needs the token and comes from the page itself under a name the
server is served by; no file is read through a symbolic link out of a run folder; the launch form's output_dir is
read as `shardtune train` reads it before the under-ROOT check; the token is never on a command line; a body the page
never sends is refused with one line. Real HTTP through Starlette's test client, and one real `shardtune web`."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("starlette")
pytest.importorskip("httpx")

from starlette.testclient import TestClient  # noqa: E402

from shardtune.web.guard import served_names  # noqa: E402
from shardtune.web.processes import LaunchRequest, request_problems  # noqa: E402
from shardtune.web.server import build_app  # noqa: E402
from tests.conftest import cli_env  # noqa: E402
from tests.unit.test_watch_runs import write_rank  # noqa: E402

TOKEN = "the-page-token"
PAGE = "http://127.0.0.1:7860"
READS = ("/api/runs", "/api/run?id=run", "/api/curves?id=run", "/api/config?id=run", "/api/schema")


@pytest.fixture
def root(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    write_rank(root / "run", 0, 3, end="done")
    (root / "run" / "shardtune_config.json").write_text(json.dumps({"learning_rate": 0.001}))
    return root


def client(root: Path, **kwargs) -> TestClient:
    return TestClient(build_app(root, TOKEN), base_url=PAGE, **kwargs)


def test_a_read_without_the_token_is_refused(root):
    page = client(root)
    for url in (*READS, "/api/events?id=run"):
        refused = page.get(url)
        assert refused.status_code == 403, url
        assert "needs its token" in refused.json()["error"] and "Traceback" not in refused.text
        assert page.get(url, headers={"x-shardtune-token": "wrong"}).status_code == 403, url
    for url in READS:
        assert page.get(url, headers={"x-shardtune-token": TOKEN}).status_code == 200, url
        assert page.get(url + ("&" if "?" in url else "?") + f"token={TOKEN}").status_code == 200, url
    # The URL's token is for an EventSource's reads only: an action needs the header.
    assert page.post(f"/api/stop?id=run&token={TOKEN}").status_code == 403
    assert page.get("/").status_code == 200  # the page itself holds no data: it asks for the token


def test_a_foreign_host_is_refused(root):
    """DNS rebinding: a site's own name resolved to 127.0.0.1 reaches the server with that name as its Host."""
    page = client(root, headers={"x-shardtune-token": TOKEN})
    for host in ("evil.example:7860", "evil.example", "127.0.0.1.evil.example:7860", "", "127.0.0.1:bad"):
        refused = page.get("/api/runs", headers={"host": host})
        assert refused.status_code == 421 and "not served under the name" in refused.json()["error"], host
        assert page.get("/", headers={"host": host}).status_code == 421, host
    # An ssh -L tunnel may use another local port: the name decides.
    for host in ("127.0.0.1:7860", "localhost:8000", "[::1]:7860", "LOCALHOST"):
        assert page.get("/api/runs", headers={"host": host}).status_code == 200, host


def test_the_served_names_follow_the_bound_address():
    local = served_names("127.0.0.1")
    assert local.allow("127.0.0.1:7860") and not local.allow("10.0.0.5:7860") and not local.allow("gpu-node:7860")
    everywhere = served_names("0.0.0.0", ["runs.example.org"])
    assert everywhere.allow("10.0.0.5:7860") and everywhere.allow("[fe80::1]:7860")
    assert everywhere.allow("runs.example.org") and not everywhere.allow("evil.example:7860")
    assert served_names("10.0.0.5").allow("10.0.0.5:7860") and not served_names("10.0.0.5").allow("10.0.0.6")


def test_a_cross_origin_request_is_refused(root):
    """A page on another site cannot read the answers, but a POST would still act: its Origin gives it away, and a
    no-cors request carries Sec-Fetch-Site instead."""
    page = client(root, headers={"x-shardtune-token": TOKEN})
    for headers in ({"origin": "http://evil.example"}, {"origin": "http://127.0.0.1:9999"}, {"origin": "null"},
                    {"sec-fetch-site": "cross-site"}, {"sec-fetch-site": "same-site"}):
        refused = page.post("/api/stop?id=run", headers=headers)
        assert refused.status_code == 403 and "another site" in refused.json()["error"], headers
        assert page.get("/api/runs", headers=headers).status_code == 403, headers
    # The page's own requests: same origin (the browser's Origin is the Host it asked).
    assert page.get("/api/runs", headers={"origin": PAGE, "sec-fetch-site": "same-origin"}).status_code == 200
    assert page.post("/api/check", headers={"origin": PAGE}, content=b"{").status_code == 400  # reached the route


def test_no_file_is_read_through_a_symbolic_link_out_of_a_run_folder(root, tmp_path):
    """Someone who can write into a folder under ROOT links a run's files to the server user's secrets: the page
    shows none of them."""
    secret = "s3cret-of-the-server-user"
    outside = tmp_path / "outside"
    write_rank(outside, 0, 7)  # outside/ranks/rank_0.jsonl
    (outside / "secret.json").write_text(json.dumps({"private_key": secret}))
    (outside / "secret.txt").write_text(f"{secret}\n\n{secret}\n")
    (outside / "log.jsonl").write_text(json.dumps({"current_steps": 1, "loss": 1234.5}) + "\n")
    (outside / "big").mkdir()
    (outside / "big" / "blob").write_bytes(b"x" * 5000)
    run = root / "linked"
    (run / ".shardtune").mkdir(parents=True)
    links = {"shardtune_config.json": "secret.json", "train_results.json": "secret.json", "ranks": "ranks",
             ".shardtune/console.log": "secret.txt", ".shardtune/rank-0-error.txt": "secret.txt",
             ".shardtune/web_launch.json": "secret.json", "trainer_log.jsonl": "log.jsonl", "checkpoint-5": "big"}
    for name, target in links.items():
        (run / name).symlink_to(outside / target)
    page = client(root, headers={"x-shardtune-token": TOKEN})
    answers = [page.get(url) for url in ("/api/runs", "/api/run?id=linked", "/api/curves?id=linked",
                                         "/api/config?id=linked")]
    assert [a.status_code for a in answers] == [200] * 4
    text = " ".join(a.text for a in answers)
    assert secret not in text and "1234.5" not in text
    detail = answers[1].json()
    assert detail["ranks"] == [] and detail["errors"] == [] and detail["console_tail"] == []
    assert detail["checkpoints"] == [] and answers[3].json()["config"] is None
    # A link inside ranks/ is refused too, and the run's own files still read.
    (root / "run" / "ranks" / "rank_1.jsonl").symlink_to(outside / "ranks" / "rank_0.jsonl")
    rows = page.get("/api/run?id=run").json()["ranks"]
    assert [(r["rank"], r["step"]) for r in rows] == [(0, 3), (1, 0)]


def request(output_dir: str | None = None, yaml_text: str = "", **values: str) -> LaunchRequest:
    if output_dir is not None:
        values["output_dir"] = output_dir
    return LaunchRequest(yaml_text, values)


def problems_of(req: LaunchRequest, root: Path) -> tuple[Path | None, list[str]]:
    config = root / ".scratch.yaml"
    config.write_text(req.yaml_text or "{}\n")
    return request_problems(req, root, config)


def test_the_forms_output_dir_is_read_as_train_reads_it_before_the_root_check(root, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("RUNS", str(root / "runs"))
    monkeypatch.setenv("ELSEWHERE", str(tmp_path / "elsewhere"))
    monkeypatch.delenv("UNSET_VARIABLE", raising=False)
    # `~` and variables are expanded (in the YAML and in the form's overrides), then checked against ROOT.
    for escape in ("~/escape", "$ELSEWHERE/run", "${HOME}/x", "runs/../../x"):
        for req in (request(escape), request(yaml_text=f"output_dir: {escape}\n")):
            out, problems = problems_of(req, root)
            assert out is not None and not out.is_relative_to(root) and "is outside" in problems[0], escape
    assert problems_of(request("$RUNS/a"), root) == ((root / "runs" / "a").resolve(), [])
    # The form's value overrides the YAML's; a value is read as YAML, as on the command line.
    assert problems_of(request('"runs/b"', yaml_text="output_dir: ~/escape\n"), root)[0] == (root / "runs/b").resolve()
    assert problems_of(request("$UNSET_VARIABLE/x"), root) == (None, [
        "command line: output_dir: '$UNSET_VARIABLE/x' uses $UNSET_VARIABLE, which is not set in the environment; "
        "set it or write the path out"])
    assert problems_of(request(), root)[1] == ["output_dir is required (where the model and logs are written)"]
    (root / "link").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    assert "is outside" in problems_of(request("link/run"), root)[1][0]
    (root / "loop").symlink_to(root / "loop")
    assert problems_of(request("loop/run"), root)[1][0].startswith("output_dir (loop/run): cannot be resolved")


def test_a_launch_outside_root_is_refused_through_the_page_with_one_line(root, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    page = client(root, headers={"x-shardtune-token": TOKEN})
    answer = page.post("/api/launch", json={"yaml": "output_dir: ~/run\n", "values": {}, "nproc_per_node": 1})
    assert answer.status_code == 400
    [problem] = answer.json()["problems"]
    assert problem["key"] == "output_dir" and f"output_dir ({tmp_path / 'home' / 'run'}) is outside" in \
        problem["problem"]
    assert not (tmp_path / "home").exists()


@pytest.mark.parametrize("body", [b"{", b"[1, 2]", b'{"values": [1]}', b'{"nproc_per_node": "two"}',
                                  b'{"yaml": 5}', b'{"values": {"--dry-run": "x"}}', b"\xff\xfe"])
def test_a_body_the_page_never_sends_is_one_line(root, body):
    answer = client(root, headers={"x-shardtune-token": TOKEN}).post("/api/check", content=body)
    assert answer.status_code == 400 and "Traceback" not in answer.text
    line = answer.json()["error"]
    assert line and "\n" not in line


def test_a_run_name_no_folder_can_have_is_not_found(root):
    (root / "loop").symlink_to(root / "loop")
    page = client(root, headers={"x-shardtune-token": TOKEN})
    for name in ("%00", "run%00x", "/etc", "../root/run/../../x", "loop/x"):
        answer = page.get(f"/api/run?id={name}")
        assert answer.status_code == 404 and answer.json()["error"] == "no such run under this page's root", name


def test_the_token_is_refused_on_the_command_line_and_never_in_a_process_list(tmp_path):
    from shardtune.errors import ConfigError
    from shardtune.web.command import read_token

    with pytest.raises(ConfigError, match="--token-file FILE"):
        read_token("on-the-command-line", None)
    token_file = tmp_path / "token"
    token_file.write_text("short\n")
    with pytest.raises(ConfigError, match="8 or more"):
        read_token(None, str(token_file))
    token_file.write_text(TOKEN + "\n")
    env = cli_env()
    done = subprocess.run([sys.executable, "-m", "shardtune", "web", str(tmp_path), "--token", TOKEN],
                          capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "--token-file" in done.stderr
    proc = subprocess.Popen([sys.executable, "-m", "shardtune", "web", str(tmp_path), "--port", "0", "--token-file",
                             str(token_file)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        url = next(m.group(1) for line in proc.stdout if (m := re.search(r"open (http://\S+)", line)))
        assert url.endswith(f"?token={TOKEN}")
        on_command_lines = [p.name for p in Path("/proc").iterdir() if p.name.isdigit() and
                            TOKEN.encode() in _cmdline(p)]
        assert on_command_lines == []
        base = url.split("/?")[0]
        with urllib.request.urlopen(urllib.request.Request(base + "/api/runs", headers={"X-Shardtune-Token": TOKEN}),
                                    timeout=30) as answer:
            assert answer.status == 200
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(base + "/api/runs", timeout=30)
        assert refused.value.code == 403
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _cmdline(proc: Path) -> bytes:
    try:
        return (proc / "cmdline").read_bytes()
    except OSError:
        return b""
