"""`shardtune web` in a real headless browser (Debian's chromium driven by chromedriver through selenium).

A 2-process CPU run launched from the form: per-key errors before anything starts, live steps within 2 s of the rank
logs, a rank whose data loader is held back flagged as the straggler, a reload that reattaches, Stop that leaves no
process, the checkpoint list equal to the folder; and a run whose ranks fail showing the failing rank's own error.
Any error in the page's console fails the test. Installs chromium when missing (root and apt-get; about a minute),
skipped with the reason otherwise. SHARDTUNE_SCREENSHOTS=DIR saves the main views (docs/images holds them).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, cli_env

pytestmark = pytest.mark.e2e
TOKEN = "test-token"
SCRIPT = REPO / "scripts" / "browser_local.sh"
NOT_INSTALLABLE = 3
CHROMIUM_FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage", "--window-size=1400,1700")


@pytest.fixture(scope="module")
def browser_paths() -> tuple[str, str]:
    pytest.importorskip("selenium")
    pytest.importorskip("starlette")
    pytest.importorskip("uvicorn")
    done = subprocess.run(["bash", str(SCRIPT), "install"], capture_output=True, text=True, timeout=600)
    if done.returncode == NOT_INSTALLABLE:
        pytest.skip(f"no browser here: {done.stderr.strip()}")
    assert done.returncode == 0, done.stderr
    chromium, driver = done.stdout.split()
    return chromium, driver


@pytest.fixture
def driver(browser_paths, tmp_path):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = browser_paths[0]
    for flag in (*CHROMIUM_FLAGS, f"--user-data-dir={tempfile.mkdtemp(dir=tmp_path)}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    browser = webdriver.Chrome(options=options, service=Service(browser_paths[1]))
    yield browser
    browser.quit()


@pytest.fixture
def page_root(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    return root


@pytest.fixture
def web_url(page_root, tmp_path):
    """`shardtune web ROOT` on a free port; its URL with the token (read from a file: never on a command line)."""
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    proc = subprocess.Popen([sys.executable, "-m", "shardtune", "web", str(page_root), "--port", "0", "--token-file",
                             str(token_file), "--stop-grace", "90"], env=cli_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    url = None
    for line in proc.stdout:
        match = re.search(r"open (http://\S+)", line)
        if match:
            url = match.group(1)
            break
    assert url, "shardtune web printed no URL"
    threading.Thread(target=proc.stdout.read, daemon=True).start()  # keep its pipe drained
    yield url
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()


def console_errors(driver) -> list[str]:
    return [entry["message"] for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]


def wait_for(predicate, timeout: float, what: str, interval: float = 0.1):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def screenshot(driver, name: str) -> None:
    folder = os.environ.get("SHARDTUNE_SCREENSHOTS")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(Path(folder) / f"{name}.png"))


def last_step(path: Path) -> dict | None:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None
    steps = [json.loads(line) for line in lines if '"event":"step"' in line]
    return steps[-1] if steps else None


# Read in one script: the page redraws these elements on every update, so a handle can go stale between calls.
def page_step(driver) -> int:
    text = driver.execute_script("const e = document.getElementById('run-step'); return e ? e.textContent : ''")
    return int(text) if text.isdigit() else -1


def rank_rows(driver) -> dict[int, str]:
    """rank -> the row's class (straggler / stalled flags)."""
    rows = driver.execute_script("return Array.from(document.querySelectorAll('#rank-table tbody tr'))"
                                 ".map((r) => [r.dataset.rank, r.className])")
    return {int(rank): cls or "" for rank, cls in rows}


def page_text(driver, selector: str) -> list[str]:
    return driver.execute_script("return Array.from(document.querySelectorAll(arguments[0]))"
                                 ".map((e) => e.textContent)", selector)


def loader_workers(rank_pid: int) -> list[int]:
    """The data loader worker processes of a rank (its children)."""
    found = []
    for task in Path(f"/proc/{rank_pid}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return found


class Throttle:
    """Holds processes back: SIGSTOP for ``stopped`` seconds, then SIGCONT for ``running``, until stopped. The
    processes are looked up again each round: a new epoch's loader starts new workers."""

    def __init__(self, find_pids, stopped: float = 1.5, running: float = 0.05) -> None:
        self.find_pids, self.stopped, self.running = find_pids, stopped, running
        self.pids: list[int] = []
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _signal(self, sig: int) -> None:
        for pid in self.pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def _run(self) -> None:
        while not self.done.is_set():
            self.pids = self.find_pids()
            self._signal(signal.SIGSTOP)
            self.done.wait(self.stopped)
            self._signal(signal.SIGCONT)
            self.done.wait(self.running)
        self._signal(signal.SIGCONT)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.done.set()
        self.thread.join(timeout=10)


RUN_YAML = """model_name_or_path: {model}
stage: sft
finetuning_type: full
dataset: demo
dataset_dir: {data}
template: chatml
cutoff_len: 128
output_dir: outputs/live
overwrite_output_dir: true
per_device_train_batch_size: 2
max_steps: 2000
save_steps: 10
save_total_limit: 3
logging_steps: 2
dataloader_num_workers: 1
dataloader_persistent_workers: true
"""


def test_form_launch_is_live_flags_a_straggler_reattaches_and_stops(driver, web_url, page_root, tiny_model_dir):
    from selenium.webdriver.common.by import By

    from shardtune.web.processes import run_processes

    driver.get(web_url + "#/new")
    yaml_box = wait_for(lambda: driver.find_elements(By.ID, "yaml"), 20, "the form")[0]
    driver.execute_script("arguments[0].value = arguments[1]", yaml_box,
                          RUN_YAML.format(model=tiny_model_dir, data=REPO / "data"))
    nproc = driver.find_element(By.ID, "nproc")
    nproc.clear()
    nproc.send_keys("2")
    wait_for(lambda: driver.find_elements(By.ID, "key-learning_rate"), 20, "the schema's fields")
    rate = driver.find_element(By.ID, "key-learning_rate")
    driver.execute_script("arguments[0].closest('details').open = true", rate)
    rate.send_keys("-1")
    driver.find_element(By.ID, "check-button").click()
    # The error is shown at its key, and nothing started.
    field = wait_for(lambda: driver.find_elements(By.CSS_SELECTOR, '.field.has-error[data-field="learning_rate"]'), 120,
                     "learning_rate's problem")[0]
    assert "learning_rate" in field.text and not (page_root / "outputs" / "live").exists()
    screenshot(driver, "web-new-run-errors")
    rate.clear()
    driver.find_element(By.ID, "launch-button").click()
    wait_for(lambda: "#/run/outputs%2Flive" in driver.current_url, 120, "the run's page after Launch")
    out = page_root / "outputs" / "live"

    # Live: the page shows each step within 2 s of the rank writing it.
    wait_for(lambda: len(rank_rows(driver)) == 2, 180, "both ranks in the table")
    for _ in range(3):
        record = wait_for(lambda: last_step(out / "ranks" / "rank_0.jsonl"), 60, "a step in rank 0's log")
        wait_for(lambda r=record: page_step(driver) >= r["step"], 5, f"step {record['step']} on the page")
        assert time.time() - record["time"] < 2.0, "the page showed the step more than 2 s after the rank logged it"
        time.sleep(0.3)

    # A rank whose data loader is held back makes the other wait: it is flagged as the straggler.
    rank1 = json.loads((out / "ranks" / "rank_1.jsonl").read_text().splitlines()[0])
    # Persistent workers: the same worker stays for the whole run, so there is no gap between epochs without one.
    wait_for(lambda: loader_workers(rank1["pid"]), 30, "rank 1's data loader worker")
    with Throttle(lambda: loader_workers(rank1["pid"])):
        rows = wait_for(lambda: (r := rank_rows(driver)) and "straggler" in r.get(1, "") and r, 60,
                        "rank 1 flagged as a straggler")
        assert "straggler" not in rows[0]
        screenshot(driver, "web-run-live")
    # A reload reattaches: the same run, still stepping.
    before = page_step(driver)
    driver.refresh()
    wait_for(lambda: page_step(driver) > before, 30, "steps after the reload")
    assert len(rank_rows(driver)) == 2
    assert not console_errors(driver)

    # Stop reaches every rank: they save and exit, and no process of the run is left.
    driver.execute_script("document.getElementById('stop-button').click()")  # arms it
    driver.execute_script("document.getElementById('stop-button').click()")  # confirms
    report = wait_for(lambda: [t for t in page_text(driver, "#stop-report") if "no process" in t], 150,
                      "the stop report")[0]
    assert "Stopped: no process of this run is left" in report and "killed" not in report
    assert run_processes(out) == {}
    wait_for(lambda: driver.find_elements(By.CSS_SELECTOR, '#run-state [data-state="stopped"]'), 10, "state stopped")
    ended = [json.loads((out / "ranks" / f"rank_{r}.jsonl").read_text().splitlines()[-1]) for r in (0, 1)]
    assert all(e["event"] == "end" and e["interrupted"] for e in ended)

    # The checkpoint list is the folder's.
    shown = dict(driver.execute_script("return Array.from(document.querySelectorAll('#checkpoint-table tbody tr'))"
                                       ".map((r) => [r.dataset.name, r.dataset.complete])"))
    on_disk = {p.name: "1" if (p / "COMPLETE").is_file() else "0" for p in out.glob("checkpoint-*")}
    assert shown == on_disk and shown
    # What each complete save held training for, and its write, as rank 0's marker recorded them.
    costs = driver.execute_script("return Array.from(document.querySelectorAll("
                                  "'#checkpoint-table tbody tr[data-complete=\"1\"] td:nth-child(5)'))"
                                  ".map((c) => c.textContent)")
    assert costs and all(re.fullmatch(r"\d+\.\d\d s / \d+\.\d\d s", c) for c in costs), costs
    screenshot(driver, "web-run-stopped")
    driver.get(web_url + "#/")
    wait_for(lambda: driver.find_elements(By.CSS_SELECTOR, '#runs tr[data-run-id="outputs/live"]'), 20, "the runs list")
    screenshot(driver, "web-runs")
    assert not console_errors(driver)


def test_failed_run_shows_the_failing_ranks_own_error(driver, web_url, page_root, tiny_model_dir):
    """A 2-process run started on the command line whose rank 0 fails while the run goes on (a file appears where
    its checkpoint goes, after the launching host's checks passed): the page lists the run as failed and shows
    rank 0's own error first, rank 1's lost connection (or its stop by torchrun) after it."""
    from selenium.webdriver.common.by import By

    out = page_root / "outputs" / "failed"
    proc = subprocess.Popen([sys.executable, "-m", "shardtune", "train", "examples/tiny/sft_full.yaml",
                             f"model_name_or_path={tiny_model_dir}", f"output_dir={out}", "max_steps=40",
                             "save_steps=30", "do_eval=false"], cwd=REPO, env=cli_env(NPROC_PER_NODE="2"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: (out / "ranks" / "rank_0.jsonl").is_file() or proc.poll() is not None, 180, "the ranks' start",
             interval=0.05)
    (out / "checkpoint-30").write_text("not a checkpoint")
    assert proc.wait(timeout=300) != 0
    assert "rank 0 failed: AssertionError" in proc.stderr.read()
    driver.get(web_url + "#/run/" + "outputs%2Ffailed")
    # Both ranks' errors: the page may show rank 0's before its next poll brings rank 1's (one run in many).
    errors = wait_for(lambda: (found := page_text(driver, "#errors .rank-error")) and len(found) >= 2 and found, 20,
                      "both ranks' errors")
    assert "rank 0 failed: AssertionError:" in errors[0] and "checkpoint-30 was not written by shardtune" in errors[0]
    # Rank 1 either saw the connection close in a collective or was stopped by torchrun first (one run in many).
    assert ("rank 1 failed: lost the connection to another rank" in errors[1]
            or "rank 1 failed: stopped by the launcher after another rank failed" in errors[1])
    assert driver.find_elements(By.CSS_SELECTOR, '#run-state [data-state="failed"]')
    screenshot(driver, "web-run-failed")
    assert not console_errors(driver)
