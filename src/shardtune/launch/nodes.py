"""The node check: before torchrun forms the process group, every node's facts meet on node 0 and are compared.

A multi-node job whose nodes differ (another transformers, another GPU count, another config) or cannot reach
each other otherwise hangs in its first collective until NCCL's time-out. Each node's shardtune process, before it
starts torchrun, reports the facts below through a ``torch.distributed.TCPStore`` that node 0 hosts on
MASTER_ADDR:``check_port(MASTER_PORT)``; node 0 compares them (``compare_reports``, pure) and publishes one
verdict, and every node stops with the same one line (exit 2) or goes on. One node: no check, no cost.

Store keys: ``report/<node>`` (a node's facts, JSON), ``claims/<node>`` (how many nodes said they are that node),
``verdict`` (JSON list of problem lines, empty when all agree), ``read`` (nodes that have read the verdict).
"""

from __future__ import annotations

import errno
import hashlib
import json
import platform
import secrets
import socket
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from shardtune import run_files
from shardtune.errors import ConfigError
from shardtune.host import local_available_memory, visible_gpu_count, visible_gpus
from shardtune.launch import env as launch_env
from shardtune.launch import kubernetes
from shardtune.launch.torchrun import LaunchPlan
from shardtune.versions import installed_version

# Facts every node must share, in the order a difference is reported; a difference stops the job.
EQUAL_FIELDS = ("shardtune", "code_hash", "python", "torch", "cuda", "nccl", "transformers", "deepspeed", "peft",
                "device_count", "nproc_per_node", "config_hash")
# Facts that may differ but are worth a warning (mixed GPU models run at the slowest one's pace).
WARN_FIELDS = ("device_model",)
# Facts that are each node's own (shown by `shardtune doctor`).
INFO_FIELDS = ("host", "interface", "address", "reaches_master", "free_device_memory", "free_host_memory")
# torchrun's static rendezvous waits this long for the nodes when RDZV_TIMEOUT is unset; so does the check.
DEFAULT_TIMEOUT = 600
READ_GRACE = 10.0  # seconds node 0 keeps the store up for the other nodes to read the verdict
_FIXES = {"config_hash": "start every node with the same config and key=value overrides",
          "device_count": "give every node the same number of GPUs (CUDA_VISIBLE_DEVICES, the scheduler's request)",
          "nproc_per_node": "set the same NPROC_PER_NODE on every node (or unset it)",
          "code_hash": "install the same shardtune on every node (pip install the same commit)",
          "shardtune": "install the same shardtune on every node"}


def check_port(master_port: int) -> int:
    """The port of the node check: MASTER_PORT + 1 (MASTER_PORT - 1 at the top of the range); torchrun's
    rendezvous keeps MASTER_PORT itself."""
    return master_port + 1 if master_port < 65535 else master_port - 1


def check_nodes(launch: LaunchPlan, run_plan: Mapping[str, Any], scheduler: str | None = None) -> None:
    """The node check of a multi-node run; raises ConfigError (one line) when a node differs or never arrives.
    ``scheduler``: whose variables decided the nodes (SLURM, PyTorchJob, TrainJob; None: the user's)."""
    if not needs_check(launch, scheduler):
        return
    print(f"[shardtune] node check: node {launch.node_rank} of {launch.nnodes} meets the others at "
          f"{launch.master_addr}:{check_port(launch.master_port)}", flush=True)
    report = node_report(launch, run_plan)
    output_dir = run_plan.get("config", {}).get("output_dir")
    if output_dir:
        report["output_marker"] = write_output_marker(Path(output_dir), launch.node_rank)
    with node_store(launch, scheduler) as store:
        reports, problems = exchange(store, launch, report)
    if output_dir and launch.node_rank == 0:
        clear_output_markers(Path(output_dir))
    if problems:
        raise ConfigError(one_line(problems))
    if launch.node_rank == 0:
        print(f"[shardtune] node check: {len(reports)} nodes agree ({agreed_summary(reports[0])})", flush=True)


def needs_check(launch: LaunchPlan, scheduler: str | None) -> bool:
    """One node: nothing to compare. An elastic node range: how many nodes come is not known up front. An elastic
    PyTorchJob: torchrun numbers the pods, which need not know their own index (PET_NODE_RANK) beforehand."""
    elastic_range = (launch.min_nnodes or launch.nnodes) != (launch.max_nnodes or launch.nnodes)
    return launch.nnodes > 1 and not elastic_range and scheduler != kubernetes.PYTORCHJOB_ELASTIC


def one_line(problems: Sequence[str]) -> str:
    """The first problem, and how many more there are (the job stops with one line)."""
    more = f" (and {len(problems) - 1} more difference(s))" if len(problems) > 1 else ""
    return problems[0] + more


def agreed_summary(report: Mapping[str, Any]) -> str:
    return ", ".join(f"{f} {report[f]}" for f in ("shardtune", "python", "torch", "transformers", "device_count"))


# ---- facts ----

def node_report(launch: LaunchPlan, run_plan: Mapping[str, Any] | None) -> dict[str, Any]:
    """This node's facts (JSON-able), the run plan it will train with, and what it found wrong locally."""
    import torch

    gpu = visible_gpu_count() > 0
    gpus = visible_gpus() if gpu else []
    interface, address, problems = route_interface(launch, gpu)
    report: dict[str, Any] = {
        "node": launch.node_rank, "host": socket.gethostname(), "python": platform.python_version(),
        "torch": torch.__version__, "cuda": torch.version.cuda or "none", "nccl": nccl_version(gpu),
        "transformers": package_version("transformers"), "deepspeed": package_version("deepspeed"),
        "peft": package_version("peft"), "shardtune": shardtune_version(), "code_hash": code_hash(),
        "device_count": visible_gpu_count(), "nproc_per_node": launch.nproc_per_node,
        "device_model": ", ".join(sorted({g.name for g in gpus})) or "cpu",
        "free_device_memory": ", ".join(_gib(g.free) for g in gpus) or "-",
        "free_host_memory": _gib(local_available_memory()),
        "interface": interface, "address": address, "reaches_master": "-",
        "config_hash": plan_hash(run_plan) if run_plan is not None else "-",
        "config": dict(run_plan.get("config", {})) if run_plan is not None else {}, "problems": problems,
    }
    return report


def _gib(size: int | None) -> str:
    return "-" if size is None else f"{size / 1024**3:.1f} GiB"


def package_version(name: str) -> str:
    return installed_version(name) or "not installed"


def shardtune_version() -> str:
    from shardtune import __version__

    return __version__


def nccl_version(gpu: bool) -> str:
    import torch

    if not gpu or not torch.cuda.is_available():
        return "none"
    version = torch.cuda.nccl.version()  # a tuple, no CUDA context needed
    return ".".join(str(v) for v in version) if isinstance(version, tuple) else str(version)


def code_hash() -> str:
    """A hash of shardtune's own source files (and its presets): differs whenever two nodes run other code."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.suffix in (".py", ".json") and "__pycache__" not in p.parts):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:12]


def plan_hash(run_plan: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(run_plan, sort_keys=True, default=str).encode()).hexdigest()[:12]


def route_interface(launch: LaunchPlan, gpu: bool) -> tuple[str, str, list[str]]:
    """The interface gloo/NCCL will use (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME, else the one routing to
    MASTER_ADDR), its IPv4 address, and the problems with it."""
    addresses = interface_addresses()
    named = launch_env.socket_ifname(gpu)
    if named is not None:
        variable, value = named
        wanted = [n.strip().lstrip("=") for n in value.split(",") if n.strip() and not n.startswith("^")]
        # NCCL matches a name prefix (eth matches eth0) unless the list starts with '='; gloo takes exact names.
        exact = variable.startswith("GLOO") or value.startswith("=")
        found = [n for n in addresses if any(n == w or (not exact and n.startswith(w)) for w in wanted)]
        if wanted and not found:
            return value, "-", [f"{variable}={value} names no interface of node {launch.node_rank} "
                                f"({socket.gethostname()}; it has {', '.join(sorted(addresses))}): set {variable} "
                                "to one of those on this node"]
        name = found[0] if found else value
        return name, addresses.get(name, "-"), []
    source = route_source(launch.master_addr)
    name = next((n for n, a in addresses.items() if a == source), "-")
    return name, source or "-", []


def interface_addresses() -> dict[str, str]:
    """IPv4 address of each interface that has one (Linux ioctl SIOCGIFADDR; standard library only)."""
    import fcntl
    import struct

    found = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(sock.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))
            except OSError:
                continue
            found[name] = socket.inet_ntoa(packed[20:24])
    return found


def route_source(master_addr: str) -> str | None:
    """The local address the kernel routes MASTER_ADDR from (a UDP connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect((master_addr, 9))
            return str(sock.getsockname()[0])
        except OSError:
            return None


RESOLVE_SECONDS = 10.0  # a name server that does not answer must not hold the launch


def resolve_within(name: str, seconds: float) -> str:
    """``name``'s IPv4 address; TimeoutError when the resolver does not answer in ``seconds`` (the C resolver has
    no timeout of its own: it runs in a daemon thread that may be left behind)."""
    import threading

    found: list[str | OSError] = []

    def resolve() -> None:
        try:
            found.append(socket.gethostbyname(name))
        except OSError as err:
            found.append(err)

    worker = threading.Thread(target=resolve, daemon=True)
    worker.start()
    worker.join(seconds)
    if not found:
        raise TimeoutError(name)
    if isinstance(found[0], OSError):
        raise found[0]
    return found[0]


def master_problem(launch: LaunchPlan, scheduler: str | None = None) -> str | None:
    """Node 0 hosts the rendezvous on MASTER_ADDR: it must resolve, and (outside Kubernetes, where it names a
    service) be an address of node 0 itself."""
    try:
        address = resolve_within(launch.master_addr, RESOLVE_SECONDS)
    except TimeoutError:
        return (f"MASTER_ADDR={launch.master_addr}: name resolution gave no answer within {RESOLVE_SECONDS:.0f} s on "
                f"node {launch.node_rank} ({socket.gethostname()}): use an IP address, or fix the DNS")
    except OSError:
        return (f"MASTER_ADDR={launch.master_addr} cannot be resolved on node {launch.node_rank} "
                f"({socket.gethostname()}): use an IP address or a name every node resolves")
    if launch.node_rank != 0 or scheduler in ("PyTorchJob", "TrainJob"):
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((address, 0))
        except OSError:
            return (f"MASTER_ADDR={launch.master_addr} is not an address of node 0 ({socket.gethostname()}, which "
                    "hosts the rendezvous): set MASTER_ADDR to node 0's address on every node, or start NODE_RANK=0 "
                    f"on {launch.master_addr}")
    return None


# ---- comparison (pure) ----

def compare_reports(reports: Sequence[Mapping[str, Any]]) -> tuple[list[str], list[str]]:
    """Reports (node 0 first) -> (problems that stop the job, warnings). Each problem names the node, the field
    and both values."""
    problems = [p for r in reports for p in r.get("problems", [])]
    warnings = []
    first = reports[0]
    for report in reports[1:]:
        for field in EQUAL_FIELDS:
            if report.get(field) != first.get(field):
                problems.append(difference(first, report, field))
        for field in WARN_FIELDS:
            if report.get(field) != first.get(field):
                warnings.append(f"{_who(report)} has {field} {report.get(field)}, {_who(first)} has "
                                f"{first.get(field)}: the job runs at the slowest node's pace")
    return problems, warnings


def difference(first: Mapping[str, Any], other: Mapping[str, Any], field: str) -> str:
    """One line: the node, the field and both values (for the config, the first key that differs)."""
    if field == "config_hash":
        keys = sorted(set(first.get("config", {})) | set(other.get("config", {})))
        changed = [k for k in keys if first.get("config", {}).get(k) != other.get("config", {}).get(k)]
        if changed:
            key = changed[0]
            return (f"{_who(other)} differs from {_who(first)} in config key {key}: "
                    f"{first['config'].get(key)!r} on node {first['node']}, {other['config'].get(key)!r} on "
                    f"node {other['node']}; {_FIXES[field]}")
    fix = _FIXES.get(field, f"install the same {field} on every node")
    return (f"{_who(other)} differs from {_who(first)} in {field}: {first.get(field)} on node {first['node']}, "
            f"{other.get(field)} on node {other['node']}; {fix}")


def _who(report: Mapping[str, Any]) -> str:
    return f"node {report['node']} ({report.get('host', '?')})"


def missing_nodes_problem(nnodes: int, arrived: Sequence[int], waited: float, launch: LaunchPlan) -> str:
    missing = [n for n in range(nnodes) if n not in arrived]
    return (f"node(s) {', '.join(map(str, missing))} of {nnodes} never arrived within {waited:.0f} s (RDZV_TIMEOUT) "
            f"at {launch.master_addr}:{check_port(launch.master_port)}: start shardtune on every node with "
            f"NNODES={nnodes}, its own NODE_RANK and MASTER_ADDR={launch.master_addr}, and check that they reach it")


# ---- a shared output_dir ----

MARKER_WAIT = 5.0  # seconds node 0 waits for another node's marker to appear (a network filesystem's caching)


def write_output_marker(output_dir: Path, node: int) -> str:
    """A token this node writes into output_dir for node 0 to find: the same folder on every node, or not."""
    token = secrets.token_hex(8)
    path = output_dir / run_files.NODE_MARKER.format(node=node)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(token)
    return token


def unshared_output_problems(output_dir: Path, reports: Sequence[Mapping[str, Any]]) -> list[str]:
    """One line for each node whose output_dir is another folder than node 0's (its marker is not there).

    Every rank writes its part of each checkpoint into output_dir and every rank resumes from it: a node with
    its own folder (a pod's own disk) would crash at the first checkpoint or resume from another step.
    """
    first, missing = reports[0], [r for r in reports[1:] if "output_marker" in r]
    deadline = time.monotonic() + MARKER_WAIT
    while missing:
        missing = [r for r in missing if _marker(output_dir, r["node"]) != r["output_marker"]]
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    return [f"{_who(r)} does not share output_dir {output_dir} with {_who(first)}: a file it wrote there is not "
            f"there on node {first['node']}; every rank writes its part of each checkpoint into output_dir and "
            "resumes from it, so put output_dir on storage every node mounts (NFS, Lustre, a ReadWriteMany "
            "volume in every pod)" for r in missing]


def _marker(output_dir: Path, node: int) -> str | None:
    try:
        return (output_dir / run_files.NODE_MARKER.format(node=node)).read_text()
    except OSError:
        return None


def clear_output_markers(output_dir: Path) -> None:
    for path in (output_dir / run_files.NODE_MARKER.format(node=0)).parent.glob("node-*"):
        path.unlink(missing_ok=True)


# ---- the exchange ----

@contextmanager
def node_store(launch: LaunchPlan, scheduler: str | None = None) -> Iterator[Any]:
    """The check's TCPStore: hosted by node 0, joined by the others (they retry until it is up or time runs out)."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    timeout = launch.rdzv_timeout or DEFAULT_TIMEOUT
    port = check_port(launch.master_port)
    problem = master_problem(launch, scheduler)
    if problem:
        raise ConfigError(problem)
    try:
        if launch.node_rank == 0:
            listener = listen_for_nodes(launch.master_addr, port)
            address = listener.getsockname()[0]
            store = TCPStore(address, port, None, True, timedelta(seconds=timeout), wait_for_workers=False,
                             master_listen_fd=listener.detach())  # the store owns (and closes) the socket now
        else:
            if not port_opens(launch.master_addr, port, timeout):
                raise OSError(f"{launch.master_addr}:{port} did not open")
            store = TCPStore(launch.master_addr, port, None, False, timedelta(seconds=timeout + READ_GRACE))
    except (RuntimeError, OSError) as err:  # DistNetworkError is a RuntimeError
        if launch.node_rank == 0:
            raise ConfigError(f"node 0 cannot host the node check on port {port} (MASTER_PORT + 1): {_first(err)}; "
                              "choose another MASTER_PORT (or is another node 0 already running here?)") from None
        raise ConfigError(f"node 0 never arrived within {timeout} s (RDZV_TIMEOUT) at {launch.master_addr}:{port}, "
                          f"seen from node {launch.node_rank} ({socket.gethostname()}): start NODE_RANK=0 there, "
                          "or check MASTER_ADDR and the network between the nodes") from None
    try:
        yield store
    finally:
        del store


def port_opens(host: str, port: int, timeout: float) -> bool:
    """Whether ``host:port`` accepts a connection within ``timeout`` seconds (tried again until then). A node
    waits for node 0's store here, not in TCPStore's own connect: that takes 15 s per try and tries twice after a
    16 s pause whatever the timeout (a 5 s RDZV_TIMEOUT waited 46 s), and prints C++ errors on the way."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(left, 2.0))):
                return True
        except OSError:
            if left <= 0:
                return False
            time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))


def listen_for_nodes(master_addr: str, port: int) -> socket.socket:
    """Node 0's listening socket for the check: on MASTER_ADDR's address, the one the other nodes reach it by.

    The store has no authentication and carries each node's versions and resolved config, so it listens on that
    one interface only, not on every interface of the machine. Where MASTER_ADDR is not an address of this machine
    (a Kubernetes service name resolves to the service's address) it listens on all of them, as torchrun's own
    rendezvous store always does.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        try:
            sock.bind((socket.gethostbyname(master_addr), port))
        except OSError as err:
            if err.errno != errno.EADDRNOTAVAIL:
                raise
            sock.bind(("0.0.0.0", port))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


def _first(err: BaseException) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__


def exchange(store: Any, launch: LaunchPlan, report: dict[str, Any]
             ) -> tuple[list[dict[str, Any]], list[str]]:
    """Node 0: collect, compare and publish; others: report and read the verdict. Both return (the reports node 0
    saw, in node order; only node 0 has them all) and the problems."""
    node = launch.node_rank
    started = time.monotonic()
    claims = store.add(f"claims/{node}", 1)
    if node != 0:
        report["reaches_master"] = f"yes ({(time.monotonic() - started) * 1000:.1f} ms)"
        if claims == 1:
            store.set(f"report/{node}", json.dumps(report))
        else:
            store.set(f"duplicate/{node}", report["host"])
        try:
            problems = json.loads(store.get("verdict"))
        except RuntimeError as err:
            raise ConfigError(f"node 0 ({launch.master_addr}) stopped before it compared the nodes: {_first(err)}; "
                              "see node 0's output") from None
        store.add("read", 1)
        return [report], problems
    report["reaches_master"] = "is the master"
    reports, problems = collect(store, launch, report, started)
    store.set("verdict", json.dumps(problems))
    deadline = time.monotonic() + READ_GRACE
    while store.add("read", 0) < len(reports) - 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    return reports, problems


def collect(store: Any, launch: LaunchPlan, own: dict[str, Any], started: float
            ) -> tuple[list[dict[str, Any]], list[str]]:
    """Node 0 waits for every node's report until RDZV_TIMEOUT, then compares what arrived."""
    timeout = launch.rdzv_timeout or DEFAULT_TIMEOUT
    others = range(1, launch.nnodes)
    while True:
        arrived = [n for n in others if store.check([f"report/{n}"])]
        duplicated = [n for n in others if store.check([f"duplicate/{n}"])]
        if len(arrived) == len(others) or duplicated or time.monotonic() - started > timeout:
            break
        time.sleep(0.1)
    reports = [own] + [json.loads(store.get(f"report/{n}")) for n in arrived]
    problems = [f"more than one node started with NODE_RANK={n} (another on {store.get(f'duplicate/{n}').decode()}"
                f"): give each node its own NODE_RANK (0..{launch.nnodes - 1}); RANK is not NODE_RANK"
                for n in duplicated]
    compared, warnings = compare_reports(reports)
    problems += compared
    output_dir = own.get("config", {}).get("output_dir")
    if output_dir and not compared:
        problems += unshared_output_problems(Path(output_dir), reports)
    if len(arrived) < len(others) and not duplicated:
        problems.append(missing_nodes_problem(launch.nnodes, [0, *arrived], time.monotonic() - started, launch))
    for warning in warnings:
        print(f"shardtune: warning: {warning}", flush=True)
    return reports, problems
