#!/usr/bin/env python3
"""Fetch once per cluster (issue 17): 3 nodes stage one revision at once, through a limited bucket link.

Real parts only: a real S3 server (versitygw), a real kube-apiserver + etcd, one real
node agent (``python -m dscache_node``) per fake Node, and the real ``dscache-stage``
CLI as the init container runs it (``--agent``, ``--cache``, ``--bytes``).

The bucket's link. Loopback cannot be limited without limiting the peers too, so the
S3 server runs in its own network namespace, joined to the host by a veth pair, and
the server side's egress (bucket -> clients) is shaped with ``tc`` ``tbf``
(``--bucket-mbit``, default 200; ``netem`` is not available on these kernels). The
stagers and the agents stay on the host and talk to each other over 127.0.0.1,
unshaped: the cluster network. ``bucket_bytes`` is counted at the S3 side: the TX
byte counter of the server's veth, read before and after each phase. It counts what
left the server on the wire (TCP/IP and HTTP headers included, listings included),
not the stagers' own report; their report is in the JSON too, as a cross-check.

Phases, in one run, through the same link, the same server and the same dataset:
 - ``independent``: 3 stagers without ``--peer-token-file``, started together: each
   copies everything from the bucket itself (today's behaviour);
 - ``fanout``: 3 stagers with ``--peer-token-file`` (a token of a stager pod of
   the cache on each node, checked by the agents with TokenReview), started together:
   they split the objects and take the rest from each other's agents.
The lone node ("never slower for the lone node"): ``lone`` stages the dataset on ONE
node, nobody else staging, through the same shaped link, once with
``--peer-token-file`` (peers on: it asks its agent, publishes its staging label,
claims each object, finds nobody and reads the bucket itself) and once without
(today's path), alternating which goes first from round to round, over
``--rounds``. Through the shaped link the link hides a small cost, so the pairs are
also run after the last round with the link opened (``--lone-mbit``, default 0: the
tbf qdisc removed, so the bucket is as near as the veth allows and the stager and
the server are CPU-bound), ``--rounds`` times again, alternating too (a single pair
is not enough: the first run of a pair came out slower whichever it was): that
shows the cost best, in wall time and in CPU. Each stager's CPU (user + sys) comes from its own rusage (os.wait4);
its agent's CPU during the run from /proc (the agent answers the peers question
and labels its Node: part of the cost of looking for peers).

Each phase-round stages into a fresh cache name (so no copy, label or token of an
earlier phase can serve it), with the page cache dropped before it; afterwards every
byte of every node's copy is checked (sha256 against the generated source) and the
copies are wiped through the agents' own API. ``--rounds`` repeats both phases,
alternating, and reports medians.

Fairness ("the harness must not favour us"): both phases go through the same shaped
link to the same server, with the same agents, the same stager options (``--agent``,
``--cache``, ``--bytes``) and the same memory state; only the peer token differs.
The bench checks its own counter: in the independent phase the server's veth must
have sent at least ``nodes x dataset_bytes`` (else it fails: a counter that misses
traffic would flatter the fanout figure); ``independent_bucket_ratio`` is reported
(3 plus HTTP headers and listings; the veth counts each GSO super-packet once, so
TCP/IP headers add ~0.1%: a lone 50 MB GET through this link counted 1.001x, at
191 mbit of the 200 allowed). It also reports the rate the link carried in the
independent phase (``independent_link_mbit``, at most ``bucket_mbit``: the shaper
held) so one can see that the link, not the CPUs, was the bottleneck.

The last line printed is one JSON object with a ``"fanout"`` object: ``nodes``,
``dataset_bytes``, ``dataset_objects``, ``bucket_bytes`` (S3 side, fanout phase),
``bucket_ratio`` (= bucket_bytes / dataset_bytes; target <= 1.1), ``peer_bytes``
(the fanout stagers' own reports, summed), ``stager_bucket_bytes`` (the same, from
the bucket), ``all_ready_s`` (fanout: the start of the 3 stagers to the last one's
exit 0), ``independent_all_ready_s``, ``independent_bucket_bytes``,
``independent_bucket_ratio``, ``speedup`` (= independent_all_ready_s / all_ready_s;
target >= 2 when the link is the bottleneck), the link (``bucket_mbit``,
``tbf_burst_bytes``, ``tbf_latency_ms``, ``mtu``), ``independent_link_mbit``,
``per_node_s``, ``runs`` (every phase-round, in the order they ran, with each
stager's ``cpu_s`` and its agent's ``agent_cpu_s``) and ``loadavg``; from the lone
phase: ``lone_s`` (median, without peers), ``lone_peers_s`` (median, with),
``lone_ratio`` (= lone_peers_s / lone_s; target: no measurable difference),
``lone_cpu_s`` and ``lone_peers_cpu_s`` (the stager's CPU seconds, medians),
``lone_agent_cpu_s`` and ``lone_peers_agent_cpu_s`` (its agent's), and the opened
link's pairs (medians): ``lone_open_mbit`` (0: unshaped), ``lone_open_s``,
``lone_open_peers_s``, ``lone_open_ratio``, ``lone_open_cpu_s``,
``lone_open_peers_cpu_s``. Needs root (netns, tc).

``--nodes 4,8,16,32`` (issue 30) adds fan-out past three nodes, after the phases above:
every simulated node in its own network namespace with its own tbf-shaped link to a shared
bridge, a real agent and a real stager inside it, and a seeded start skew per node. The
``fanout`` object then gains ``by_nodes`` (keyed by N: ``bucket_ratio``,
``all_ready_over_one``, ``p99_object_s``, ``agent_cpu_s``, ...), ``small_files`` and the
figures they rest on; see bench/fanout_scale.py and bench/netsim.py. ``--phases=`` (none)
with ``--nodes`` runs only those.
"""

from __future__ import annotations

import argparse
import atexit
import concurrent.futures
import contextlib
import hashlib
import json
import os
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import dscache_contract as contract  # noqa: E402
from bench import fanout_scale, netsim  # noqa: E402
from tests.support.kubeapi import OPERATOR_NS, KubeAPI, load_yaml_docs  # noqa: E402
from tests.support.nodeagent import NodeAgent  # noqa: E402
from tests.support.s3server import S3Server  # noqa: E402

BUCKET = "bench"
PREFIX = "ds"
NS = "fanout-bench"
NODES = 3
#: --tls on: (ca.crt, tls.crt, tls.key) the agents serve with (tests.support.tlscerts), as the chart's.
TLS: tuple[Path, Path, Path] | None = None
S3_PORT = 9000
#: The issue's targets (reported, and logged; the bench fails only on a wrong byte or a broken counter).
TARGET_BUCKET_RATIO = 1.1
TARGET_SPEEDUP = 2.0


def log(msg: str) -> None:
    print(f"[fanout] {msg}", file=sys.stderr, flush=True)


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def run(*argv: str, check: bool = True) -> str:
    p = subprocess.run(argv, capture_output=True, text=True)
    if check and p.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {p.returncode}: {p.stderr.strip()}")
    return p.stdout


# --- the bucket's link: a netns, a veth pair, tbf on the server side's egress --------------------


@dataclass
class Link:
    """The S3 server's own network namespace, joined to the host by a veth pair whose
    server end sends at most ``mbit`` (tbf). Everything it creates goes in ``down()``."""

    mbit: float
    burst: int
    latency_ms: float
    mtu: int = 1500
    tag: str = field(default_factory=lambda: str(os.getpid()))
    created: bool = False

    @property
    def netns(self) -> str:
        return f"dsfanout-{self.tag}"

    @property
    def host_if(self) -> str:
        return f"dsf{self.tag}h"[:15]

    @property
    def server_if(self) -> str:
        return f"dsf{self.tag}s"[:15]

    @property
    def subnet(self) -> int:
        return 16 + int(self.tag) % 200

    @property
    def host_ip(self) -> str:
        return f"10.231.{self.subnet}.1"

    @property
    def server_ip(self) -> str:
        return f"10.231.{self.subnet}.2"

    def up(self) -> Link:
        self.created = True
        run("ip", "netns", "add", self.netns)
        run("ip", "link", "add", self.host_if, "type", "veth", "peer", "name", self.server_if, "netns", self.netns)
        run("ip", "link", "set", self.host_if, "mtu", str(self.mtu))
        run("ip", "addr", "add", f"{self.host_ip}/30", "dev", self.host_if)
        run("ip", "link", "set", self.host_if, "up")
        ns = ("ip", "-n", self.netns)
        run(*ns, "link", "set", "lo", "up")
        run(*ns, "link", "set", self.server_if, "mtu", str(self.mtu))
        run(*ns, "addr", "add", f"{self.server_ip}/30", "dev", self.server_if)
        run(*ns, "link", "set", self.server_if, "up")
        self.shape(self.mbit)
        return self

    def shape(self, mbit: float) -> None:
        """The server side's egress: tbf at ``mbit``, or no qdisc at all (``mbit`` <= 0: unshaped)."""
        tc = ("ip", "netns", "exec", self.netns, "tc", "qdisc")
        if mbit > 0:
            run(
                *tc, "replace", "dev", self.server_if, "root", "tbf",
                "rate", f"{mbit:g}mbit", "burst", str(self.burst), "latency", f"{self.latency_ms:g}ms",
            )  # fmt: skip
        else:
            run(*tc, "del", "dev", self.server_if, "root", check=False)
        qdisc = run(*tc, "show", "dev", self.server_if).strip()
        log(f"bucket link: {self.server_if} in netns {self.netns} ({self.server_ip}) -> {self.host_if}: {qdisc}")

    def tx_bytes(self) -> int:
        """Bytes the server's veth has sent (bucket -> clients), from its own namespace."""
        (dev,) = json.loads(run("ip", "-n", self.netns, "-j", "-s", "link", "show", "dev", self.server_if))
        return int(dev["stats64"]["tx"]["bytes"])

    def host_rx_bytes(self) -> int:
        """The same bytes as the host's end received them (a cross-check of ``tx_bytes``)."""
        return int(Path(f"/sys/class/net/{self.host_if}/statistics/rx_bytes").read_text())

    def inside(self) -> contextlib.AbstractContextManager[None]:
        """This thread in the server's namespace (for starting the server: its children stay there)."""
        return netsim.inside(self.netns)

    def down(self) -> None:
        """The netns (with its veth end, which takes the host end and the qdisc with it)."""
        if not self.created:
            return
        self.created = False
        run("ip", "netns", "del", self.netns, check=False)
        if Path(f"/sys/class/net/{self.host_if}").exists():
            run("ip", "link", "del", self.host_if, check=False)


def remove_stale_links() -> None:
    """Namespaces a killed earlier run left behind (its pid is gone)."""
    for line in run("ip", "netns", "list", check=False).splitlines():
        name = line.split()[0] if line.split() else ""
        if name.startswith("dsfanout-") and name[len("dsfanout-") :].isdigit():
            pid = int(name[len("dsfanout-") :])
            if not Path(f"/proc/{pid}").exists():
                log(f"removing {name}, left behind by an earlier run (pid {pid} is gone)")
                Link(0, 0, 0, tag=str(pid), created=True).down()


# --- the dataset ---------------------------------------------------------------------------------


def make_dataset(large_count: int, large_size: int, small_count: int, small_size: int) -> dict[str, bytes]:
    """{key: body}: large/ objects and small/ ones spread over 20 dirs, each body distinct."""
    block = os.urandom(max(large_size, small_size))
    files: dict[str, bytes] = {}
    for i in range(large_count):
        files[f"{PREFIX}/large/blob{i:03d}.bin"] = i.to_bytes(8, "little") + b"L" + block[9:large_size]
    for i in range(small_count):
        files[f"{PREFIX}/small/d{i % 20:02d}/f{i:05d}.bin"] = i.to_bytes(8, "little") + b"S" + block[9:small_size]
    return files


def upload(server: S3Server, files: dict[str, bytes]) -> None:
    client = server.client()  # type: ignore[no-untyped-call]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        for f in [pool.submit(client.put_object, Bucket=BUCKET, Key=k, Body=v) for k, v in files.items()]:
            f.result()


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def verify_copy(cache_dir: str, revision: str, want: dict[str, str], summary: dict[str, Any], node: str) -> None:
    """Every byte of the node's copy is the source's, and its summary names the revision and count."""
    data = contract.data_dir(cache_dir, revision)
    got = {}
    for root, _dirs, names in os.walk(data):
        for name in names:
            p = os.path.join(root, name)
            got[os.path.relpath(p, data)] = sha256_file(p)
    if got != want:
        bad = sorted(set(got) ^ set(want) | {k for k in got if got.get(k) != want.get(k)})[:5]
        raise RuntimeError(f"{node}: the copy differs from the source ({len(got)} files, {len(want)} wanted): {bad}")
    if not os.path.exists(contract.complete_path(cache_dir, revision)):
        raise RuntimeError(f"{node}: the copy is not marked complete")
    if (summary.get("revision"), summary.get("objects"), summary.get("warm")) != (revision, len(want), False):
        raise RuntimeError(f"{node}: unexpected summary {summary}")


def drop_page_cache() -> None:
    """Both phases start from the same memory state: the server reads the source from disk."""
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("1")


# --- the cluster: kube-apiserver, agents -----------------------------------------------------------


def start_cluster(work: Path, nodes: int = NODES) -> tuple[KubeAPI, list[NodeAgent], Path]:
    kube = KubeAPI(workdir=work / "kube")
    _children.append(kube.stop)
    kube.start()
    kube.apply_yaml_docs(load_yaml_docs(REPO / "crds" / "datasetcache.yaml"))
    for ns in (OPERATOR_NS, NS):
        kube.namespace(ns)
    token_file = work / "agent-token"
    token_file.write_text(secrets.token_hex(16) + "\n")
    agents = []
    for i in range(nodes):
        agent = NodeAgent(kube, f"fanout-node-{i}", work / "agents" / f"node-{i}", token_file, tls=TLS)
        _children.append(agent.stop)
        agents.append(agent.start())
    log(f"{nodes} node agents on {', '.join(a.url for a in agents)}")
    return kube, agents, token_file


def stager_path() -> str:
    return shutil.which("dscache-stage") or str(Path(sys.executable).parent / "dscache-stage")


def has_peer_flag() -> bool:
    out = subprocess.run([stager_path(), "sync", "--help"], capture_output=True, text=True).stdout
    return "--peer-token-file" in out


def stage_env(server: S3Server) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_") and k != contract.ENV_POD_UID}
    ca = {contract.peers.PEER_CA_ENV: TLS[0].read_text()} if TLS else {}  # --tls on: the stagers trust it
    return {**env, **server.env, **ca, "PYTHONUNBUFFERED": "1"}


def revision_of(server: S3Server, uri: str) -> dict[str, Any]:
    out = subprocess.run(
        [stager_path(), "revision", uri, "--endpoint-url", server.endpoint],
        env=stage_env(server),
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    info: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return info


# --- one phase -------------------------------------------------------------------------------------


@dataclass
class Phase:
    name: str
    round: int
    cache: str
    all_ready_s: float
    bucket_bytes: int
    host_rx_bytes: int
    per_node_s: dict[str, float]
    summaries: dict[str, dict[str, Any]]
    #: each stager's CPU seconds (user + sys, its rusage) and its agent's during the run (/proc)
    cpu_s: dict[str, float] = field(default_factory=dict)
    agent_cpu_s: dict[str, float] = field(default_factory=dict)

    @property
    def stager_bucket_bytes(self) -> int:
        return sum(int(s.get("bucket_bytes", s.get("fetched_bytes", 0))) for s in self.summaries.values())

    @property
    def stager_peer_bytes(self) -> int:
        return sum(int(s.get("peer_bytes", 0)) for s in self.summaries.values())

    def to_dict(self) -> dict[str, Any]:
        return {
            "phase": self.name,
            "round": self.round,
            "all_ready_s": round(self.all_ready_s, 3),
            "bucket_bytes": self.bucket_bytes,
            "host_rx_bytes": self.host_rx_bytes,
            "stager_bucket_bytes": self.stager_bucket_bytes,
            "peer_bytes": self.stager_peer_bytes,
            "per_node_s": {k: round(v, 3) for k, v in self.per_node_s.items()},
            "cpu_s": {k: round(v, 3) for k, v in sorted(self.cpu_s.items())},
            "agent_cpu_s": {k: round(v, 3) for k, v in sorted(self.agent_cpu_s.items())},
            "per_node": {
                node: {"bucket_bytes": s.get("bucket_bytes", s.get("fetched_bytes")), "peer_bytes": s.get("peer_bytes")}
                for node, s in sorted(self.summaries.items())
            },
        }


def agent_cpu(agent: NodeAgent) -> float:
    return fanout_scale.proc_cpu_s(agent.proc.pid) if agent.proc is not None else 0.0


def run_phase(
    name: str,
    round_no: int,
    with_peers: bool,
    agents: list[NodeAgent],
    server: S3Server,
    link: Link,
    token_file: Path,
    uri: str,
    revision: str,
    dataset_bytes: int,
    want: dict[str, str],
    work: Path,
    stagger: float = 0.0,
) -> Phase:
    cache = f"{name}-{round_no}"
    logs = work / "logs"
    logs.mkdir(exist_ok=True)
    argvs = {}
    for agent in agents:
        argv = [
            stager_path(), "sync", uri, contract.cache_dir(str(agent.cache_root), NS, cache),
            "--revision", revision, "--endpoint-url", server.endpoint,
            "--agent", agent.url, "--cache", f"{NS}/{cache}", "--bytes", str(dataset_bytes),
            "--progress-interval", "60",
        ]  # fmt: skip
        if with_peers:
            peer_token = work / f"peer-token-{cache}-{agent.node}"
            peer_token.write_text(agent.peer_token(NS, cache))  # its node's stager pod's token (issue 29)
            argv += ["--peer-token-file", str(peer_token)]
            if len(agents) > 1:
                argv.append("--cohort")  # nodes that start together, as the webhook marks a gang's pods
        argvs[agent.node] = argv
    env = stage_env(server)
    drop_page_cache()
    tx0, rx0 = link.tx_bytes(), link.host_rx_bytes()
    agent_cpu0 = {agent.node: agent_cpu(agent) for agent in agents}
    ends: dict[str, float] = {}
    cpu: dict[str, float] = {}
    outs: dict[str, str] = {}
    procs: dict[str, subprocess.Popen[str]] = {}
    t0 = time.perf_counter()
    for i, (node, argv) in enumerate(argvs.items()):
        if i and stagger:
            time.sleep(stagger)  # pods on different nodes start apart (e2e/test_40 saw 1-2 s)
        err = open(logs / f"{cache}-{node}.log", "w")  # noqa: SIM115 (closed after the wait)
        procs[node] = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
        _procs.append(procs[node])
        err.close()

    def wait(node: str) -> None:
        # Its stdout to the end, then its own rusage (os.wait4 reaps it: Popen is told the status).
        proc = procs[node]
        assert proc.stdout is not None
        outs[node] = proc.stdout.read()
        proc.stdout.close()
        _, status, ru = os.wait4(proc.pid, 0)
        ends[node] = time.perf_counter()
        proc.returncode = os.waitstatus_to_exitcode(status)
        cpu[node] = ru.ru_utime + ru.ru_stime

    threads = [threading.Thread(target=wait, args=(node,)) for node in procs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    all_ready = max(ends.values()) - t0
    agents_cpu = {agent.node: agent_cpu(agent) - agent_cpu0[agent.node] for agent in agents}
    time.sleep(0.2)  # the last ACKed segments are counted by now
    tx, rx = link.tx_bytes() - tx0, link.host_rx_bytes() - rx0
    for node, proc in procs.items():
        if proc.returncode != 0:
            tail = (logs / f"{cache}-{node}.log").read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{name}: the stager on {node} exited {proc.returncode}:\n{tail}")
    summaries = {node: json.loads(out.strip().splitlines()[-1]) for node, out in outs.items()}
    for agent in agents:
        verify_copy(
            contract.cache_dir(str(agent.cache_root), NS, cache), revision, want, summaries[agent.node], agent.node
        )
    phase = Phase(
        name, round_no, cache, all_ready, tx, rx, {n: e - t0 for n, e in ends.items()}, summaries, cpu, agents_cpu
    )
    log(
        f"{name} round {round_no}: all ready in {all_ready:.2f}s; the bucket sent {tx / 1e6:.1f} MB "
        f"({tx / dataset_bytes:.2f}x the dataset); stagers say bucket {phase.stager_bucket_bytes / 1e6:.1f} MB, "
        f"peers {phase.stager_peer_bytes / 1e6:.1f} MB; stager CPU {sum(cpu.values()):.2f}s; "
        f"every byte of {len(agents)} copies verified"
    )
    for agent in agents:
        code, text = agent.wipe(contract.WipeRequest(NS, cache, all_revisions=True))
        if code != 200:
            raise RuntimeError(f"wipe of {NS}/{cache} on {agent.node}: HTTP {code} {text}")
    return phase


# --- clean-up, whatever happens -----------------------------------------------------------------------

_children: list[Any] = []  # stop() callables: agents, the kube API, the server (reverse order)
_procs: list[subprocess.Popen[str]] = []  # the stagers
_links: list[Any] = []  # Link, netsim.Net: anything with down()


def cleanup() -> None:
    for p in _procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    _procs.clear()
    while _children:
        stop = _children.pop()
        try:
            stop()
        except Exception as e:  # clean up the rest whatever one does
            log(f"clean-up: {e}")
    while _links:
        _links.pop().down()


def on_signal(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


# --- fan-out at scale (issue 30): a network namespace per node ---------------------------------------


def run_scale_phases(kube: KubeAPI, token_file: Path, work: Path, node_counts: list[int], args: Any) -> dict[str, Any]:
    net = netsim.Net(
        max([*node_counts, args.small_files_nodes if args.small_files > 0 else 1]),
        args.node_mbit,
        args.scale_bucket_mbit,
        burst=args.tbf_burst,
        latency_ms=args.tbf_latency_ms,
        mtu=args.mtu,
    )
    _links.append(net)
    s = fanout_scale.Scale(
        kube, work, stager_path(), stage_env, verify_copy, drop_page_cache, log, net, token_file, procs=_procs
    )
    s.up(_children)
    return fanout_scale.run_scale(s, node_counts, args, revision_of)


# --- main --------------------------------------------------------------------------------------------


def median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a smaller dataset (16 x 4 MiB + 200 x 64 KiB)")
    ap.add_argument("--rounds", type=int, default=1, help="rounds of both phases (medians are reported)")
    ap.add_argument("--large-count", type=int, help="large objects (default 64, quick 16)")
    ap.add_argument("--large-size", type=int, default=4 << 20)
    ap.add_argument("--small-count", type=int, help="small objects (default 500, quick 200)")
    ap.add_argument("--small-size", type=int, default=64 << 10)
    ap.add_argument("--bucket-mbit", type=float, default=200.0, help="the bucket link's rate (tbf)")
    ap.add_argument("--tbf-burst", type=int, default=256 << 10, help="tbf burst, bytes")
    ap.add_argument("--tbf-latency-ms", type=float, default=50.0, help="tbf latency (its queue), ms")
    ap.add_argument("--mtu", type=int, default=1500, help="the veth pair's MTU")
    ap.add_argument(
        "--phases", default="independent,fanout,lone", help="comma list (fanout and lone need --peer-token-file)"
    )
    ap.add_argument(
        "--lone-mbit", type=float, default=0.0, help="the link for the lone pair's extra run (default 0: unshaped)"
    )
    ap.add_argument(
        "--stagger", type=float, default=0.0, help="seconds between the fanout stagers' starts (default 0: together)"
    )
    ap.add_argument("--tls", choices=("on", "off"), default="off", help="agents serve TLS (the chart's default)")
    ap.add_argument("--workdir", type=Path, help="default: a temp dir under build/ (removed at the end)")
    scale = ap.add_argument_group("fan-out at scale (issue 30; bench/fanout_scale.py): a netns per node")
    scale.add_argument("--nodes", default="", help="comma list of node counts, e.g. 4,8,16,32 (default: none)")
    scale.add_argument("--node-mbit", type=float, default=16.0, help="each node's link, both ways (tbf)")
    scale.add_argument("--scale-bucket-mbit", type=float, default=16.0, help="the S3 server's link, both ways")
    scale.add_argument("--skew-max-s", type=float, default=5.0, help="each node starts 0..this late (seeded)")
    scale.add_argument("--skew-seed", type=int, default=30)
    scale.add_argument("--scale-large-count", type=int, default=8)
    scale.add_argument("--scale-large-size", type=int, default=1 << 20)
    scale.add_argument("--scale-small-count", type=int, default=256)
    scale.add_argument("--scale-small-size", type=int, default=32 << 10)
    scale.add_argument("--one-rounds", type=int, default=1, help="runs of one node alone (median)")
    scale.add_argument("--small-files", type=int, default=100_000, help="small-file profile objects (0: skip)")
    scale.add_argument("--small-files-size", type=int, default=16 << 10)
    scale.add_argument("--small-files-nodes", type=int, default=4)
    args = ap.parse_args()
    phases = [p for p in args.phases.split(",") if p]
    node_counts = sorted({int(n) for n in args.nodes.split(",") if n.strip()})
    if not set(phases) <= {"independent", "fanout", "lone"} or not (phases or node_counts):
        ap.error("--phases: any of independent, fanout, lone (none only with --nodes)")
    if node_counts and (min(node_counts) < 1 or max(node_counts) > 200):
        ap.error("--nodes: 1..200")
    if os.geteuid() != 0:
        ap.error("needs root (a network namespace, a veth pair and tc)")
    if ({"fanout", "lone"} & set(phases) or node_counts) and not has_peer_flag():
        ap.error("this dscache-stage has no --peer-token-file yet: run --phases=independent")
    large_count = args.large_count if args.large_count is not None else (16 if args.quick else 64)
    small_count = args.small_count if args.small_count is not None else (200 if args.quick else 500)

    signal.signal(signal.SIGTERM, on_signal)
    atexit.register(cleanup)
    remove_stale_links()
    netsim.remove_stale(log)
    (REPO / "build").mkdir(exist_ok=True)
    work = args.workdir.resolve() if args.workdir else Path(tempfile.mkdtemp(prefix="fanout-", dir=REPO / "build"))
    if args.tls == "on":
        global TLS
        from tests.support.tlscerts import agent_certs

        TLS = agent_certs(work / "agent-tls")
    work.mkdir(parents=True, exist_ok=True)
    load: dict[str, list[float]] = {"start": loadavg()}
    runs: dict[str, list[Phase]] = {}  # by phase name: lone runs as "lone" and "lone-peers" (+ "-open")
    ran: list[Phase] = []  # in the order they ran
    scaled: dict[str, Any] = {}
    dataset_bytes, want = 0, {}
    try:
        if phases:
            link = Link(args.bucket_mbit, args.tbf_burst, args.tbf_latency_ms, args.mtu)
            _links.append(link)
            link.up()
            server = S3Server(root=work / "s3root", host=link.server_ip, port=S3_PORT)
            _children.append(server.stop)
            with link.inside():
                server.start()
            server.make_bucket(BUCKET)
            files = make_dataset(large_count, args.large_size, small_count, args.small_size)
            dataset_bytes = sum(len(b) for b in files.values())
            want = {k[len(PREFIX) + 1 :]: hashlib.sha256(v).hexdigest() for k, v in files.items()}
            t = time.perf_counter()
            upload(server, files)
            del files
            log(
                f"uploaded {large_count} x {args.large_size} B + {small_count} x {args.small_size} B "
                f"({dataset_bytes / 2**20:.0f} MiB) in {time.perf_counter() - t:.1f}s (the upload is not shaped)"
            )
            uri = f"s3://{BUCKET}/{PREFIX}/"
            info = revision_of(server, uri)
            revision = info["revision"]
            if info.get("objects") != len(want):
                raise RuntimeError(f"the revision lists {info.get('objects')} objects, {len(want)} uploaded")
            _kube, agents, token_file = start_cluster(work)
            one_copy_s = dataset_bytes * 8 / (args.bucket_mbit * 1e6)
            log(f"revision {revision}; one copy through {args.bucket_mbit:g} mbit takes >= {one_copy_s:.1f}s")

            def stage(name: str, r: int, with_peers: bool, nodes: list[NodeAgent]) -> None:
                phase = run_phase(
                    name,
                    r,
                    with_peers,
                    nodes,
                    server,
                    link,
                    token_file,
                    uri,
                    revision,
                    dataset_bytes,
                    want,
                    work,
                    args.stagger if name == "fanout" else 0.0,
                )
                runs.setdefault(name, []).append(phase)
                ran.append(phase)

            def lone_pair(r: int, suffix: str = "") -> None:
                # One node, nobody else staging: without and with the peer token, the first of the
                # two alternating from round to round (neither always gets the other's leftovers).
                pair = [(f"lone{suffix}", False), (f"lone-peers{suffix}", True)]
                for name, with_peers in pair if r % 2 == 0 else pair[::-1]:
                    stage(name, r, with_peers, agents[:1])

            for r in range(args.rounds):
                for name in phases:
                    if name == "lone":
                        lone_pair(r)
                    else:
                        stage(name, r, name == "fanout", agents)
                load[f"round{r}"] = loadavg()
            if "lone" in phases:
                # Again with the link opened (the shaped link hides a small cost in wall time), as many
                # rounds, alternating too: the first run of a lone pair was the slower one either way.
                link.shape(args.lone_mbit)
                try:
                    for r in range(args.rounds):
                        lone_pair(r, "-open")
                finally:
                    link.shape(args.bucket_mbit)
                load["lone-open"] = loadavg()
        if node_counts:
            for a in agents if phases else []:
                a.stop()  # the 3-node phases are over: their agents' CPU is not the scale runs'
            if not phases:
                _kube, _, token_file = start_cluster(work, nodes=0)
            scaled = run_scale_phases(_kube, token_file, work, node_counts, args)
            load["scale"] = loadavg()
    finally:
        cleanup()
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    load["end"] = loadavg()

    out: dict[str, Any] = {
        "nodes": NODES,
        "dataset_bytes": dataset_bytes,
        "dataset_objects": len(want),
        "bucket_mbit": args.bucket_mbit,
        "tbf_burst_bytes": args.tbf_burst,
        "tbf_latency_ms": args.tbf_latency_ms,
        "mtu": args.mtu,
        "peers_link": "127.0.0.1, unshaped",
        "rounds": args.rounds,
        "native": _native_installed(),
    }
    if "independent" in runs:
        ind = runs["independent"]
        out["independent_all_ready_s"] = round(median([p.all_ready_s for p in ind]), 3)
        out["independent_bucket_bytes"] = round(median([p.bucket_bytes for p in ind]))
        out["independent_bucket_ratio"] = round(out["independent_bucket_bytes"] / dataset_bytes, 3)
        out["independent_link_mbit"] = round(median([p.bucket_bytes * 8 / 1e6 / p.all_ready_s for p in ind]), 1)
        # The counter's own check: three independent copies must all have crossed it.
        low = [p.bucket_bytes for p in ind if p.bucket_bytes < NODES * dataset_bytes]
        if low:
            raise RuntimeError(f"the server's veth counted {low} B for {NODES} full copies of {dataset_bytes} B")
    if "fanout" in runs:
        fan = runs["fanout"]
        out["all_ready_s"] = round(median([p.all_ready_s for p in fan]), 3)
        out["bucket_bytes"] = round(median([p.bucket_bytes for p in fan]))
        out["bucket_ratio"] = round(out["bucket_bytes"] / dataset_bytes, 3)
        out["peer_bytes"] = round(median([p.stager_peer_bytes for p in fan]))
        out["stager_bucket_bytes"] = round(median([p.stager_bucket_bytes for p in fan]))
        out["per_node_s"] = {n: round(median([p.per_node_s[n] for p in fan]), 3) for n in fan[0].per_node_s}
    if "independent" in runs and "fanout" in runs:
        out["speedup"] = round(out["independent_all_ready_s"] / out["all_ready_s"], 2)
        out["targets"] = {"bucket_ratio_max": TARGET_BUCKET_RATIO, "speedup_min": TARGET_SPEEDUP}
        out["targets_met"] = {
            "bucket_ratio": out["bucket_ratio"] <= TARGET_BUCKET_RATIO,
            "speedup": out["speedup"] >= TARGET_SPEEDUP,
        }
        log(
            f"fanout: the bucket sent {out['bucket_ratio']:.2f}x the dataset (target <= {TARGET_BUCKET_RATIO}; "
            f"independent {out['independent_bucket_ratio']:.2f}x); all ready in {out['all_ready_s']}s against "
            f"{out['independent_all_ready_s']}s: {out['speedup']}x (target >= {TARGET_SPEEDUP})"
        )
    if "lone" in runs:

        def med(name: str, of: str) -> float:
            ps = runs[name]
            return round(median([p.all_ready_s if of == "s" else sum(getattr(p, of).values()) for p in ps]), 3)

        for tag, suffix in (("lone", ""), ("lone_open", "-open")):
            out[f"{tag}_s"] = med(f"lone{suffix}", "s")
            out[f"{tag}_peers_s"] = med(f"lone-peers{suffix}", "s")
            out[f"{tag}_ratio"] = round(out[f"{tag}_peers_s"] / out[f"{tag}_s"], 3)
            out[f"{tag}_cpu_s"] = med(f"lone{suffix}", "cpu_s")
            out[f"{tag}_peers_cpu_s"] = med(f"lone-peers{suffix}", "cpu_s")
            if not suffix:
                out["lone_agent_cpu_s"] = med("lone", "agent_cpu_s")
                out["lone_peers_agent_cpu_s"] = med("lone-peers", "agent_cpu_s")
        out["lone_open_mbit"] = args.lone_mbit
        log(
            f"lone node: {out['lone_s']}s without peers, {out['lone_peers_s']}s with ({out['lone_ratio']}x; "
            f"stager CPU {out['lone_cpu_s']}s vs {out['lone_peers_cpu_s']}s); link opened "
            f"({args.lone_mbit:g} mbit, 0: unshaped): {out['lone_open_s']}s vs {out['lone_open_peers_s']}s "
            f"({out['lone_open_ratio']}x; CPU {out['lone_open_cpu_s']}s vs {out['lone_open_peers_cpu_s']}s)"
        )
    out.update(scaled)  # by_nodes, small_files, ... (issue 30)
    out["runs"] = [p.to_dict() for p in ran]
    out["loadavg"] = load
    log(f"load averages (1, 5, 15 min): {load} (noise from other work on the machine)")
    print(json.dumps({"fanout": out}), flush=True)
    from bench.results import write  # the docs' figures are rendered from this file

    write("fanout", {"fanout": out}, quick=args.quick)
    return 0


def _native_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("dscache_native") is not None


if __name__ == "__main__":
    raise SystemExit(main())
