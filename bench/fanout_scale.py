"""Fan-out past three nodes (issue 30): ``bench/fanout.py --nodes 4,8,16,32`` and its small-file profile.

Each simulated node is a network namespace on a shared bridge with its own tbf-shaped link
(bench/netsim.py), running a real node agent (``python -m dscache_node``) and, per run, a
real stager (``dscache-stage sync``) as processes inside it. The S3 server (versitygw) has a
namespace and a shaped link of its own. The agents find each other as in a cluster: each
Node object (in the bench's real kube-apiserver) carries its namespace's address as its
InternalIP, and the agent labels it with its port; the agents answer "who stages this
revision" from those labels.

Per N (the first N nodes): the N stagers start with a seeded skew each (0..--skew-max-s,
printed), all with the cache's peer token. Measured:
 - ``bucket_ratio``: bytes the server's veth sent during the run over the dataset's bytes
   (the server's link counter, not the stagers' report; the host end's rx is a cross-check);
 - ``all_ready_over_one``: the slowest node's own time (its start to its stager's exit 0)
   over ``one_alone_s``: node 0 staging alone, peers on, the same links and dataset; the wall
   span (first start to last ready, the skew in it) is ``all_ready_span_s``;
 - ``p99_object_s``: bench/fanout_stats.py ``propagation``, p99 over every (node, object);
 - ``agent_cpu_s``: the N agents' user+sys seconds during the run (/proc/<pid>/stat);
 - ``cpu_floor_s``: every process's CPU in the run (agents, stagers, S3 server, kube-apiserver,
   etcd, the bench) over the machine's cores: on one machine the span cannot be shorter.
Every byte of every copy is checked (sha256) before the copies are wiped through the agents.

``small_files``: ``--small-files`` objects of ``--small-files-size`` on ``--small-files-nodes``
nodes, every link unshaped, started together: once with the peer token (``peers_all_ready_s``)
and once without it, every node reading the bucket itself (``bucket_alone_s``).
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import re
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import dscache_contract as contract
from bench import netsim
from bench.fanout_stats import (
    access_get,
    birth_and_mtime,
    bucket_reads,
    percentile,
    predict,
    propagation,
    ratio,
)
from bench.procstat import cpu_seconds
from tests.support.kubeapi import KubeAPI
from tests.support.nodeagent import NodeAgent, register_node
from tests.support.s3server import S3Server

AGENT_PORT = 9478
S3_PORT = 9000
NS = "fanout-bench"
TARGET_BUCKET_RATIO = 1.1
TARGET_ALL_READY_OVER_ONE = 1.3  # at the largest N (the issue: N = 32)
#: The project's own packages (their bytecode is compiled before the run, as in the images).
REQUESTS_LINE = re.compile(
    r'^dscache_node_requests_total\{code="(?P<code>[^"]*)",route="(?P<route>[^"]*)",state="(?P<state>[^"]*)"\} '
    r"(?P<n>\S+)$",
    re.M,
)
PACKAGES = ("init-container/dscache_stager", "node-agent/dscache_node", "contract/dscache_contract")


@dataclass
class NetnsAgent(NodeAgent):
    """A node agent in a namespace: its Node's InternalIP is the namespace's address."""

    host: netsim.Host | None = None

    @property
    def url(self) -> str:
        assert self.host is not None
        return f"http://{self.host.ip}:{self.port}"

    def env(self) -> dict[str, str]:
        env = super().env()
        # The product's scan interval, not the integration tests' 1 s.
        env.pop("DSCACHE_NODE_SCAN_INTERVAL", None)
        return env

    def start(self, wait: bool = True) -> NetnsAgent:
        assert self.host is not None
        register_node(self.kube, self.node)
        self.kube.merge_patch(
            f"/api/v1/nodes/{self.node}/status",
            {"status": {"addresses": [{"type": "InternalIP", "address": self.host.ip}]}},
        )
        log = open(self.log_path, "ab")  # noqa: SIM115 (the process keeps it open)
        self.proc = subprocess.Popen(
            self.host.argv(os.environ.get("PYTHON", "") or _python(), "-m", "dscache_node"),
            env=self.env(),
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=Path(__file__).resolve().parents[1],
        )
        self.starts += 1
        if wait:
            self.wait_ready()
        return self


def _python() -> str:
    import sys

    return sys.executable


def proc_cpu_s(pid: int) -> float:
    """User + sys CPU seconds of a running process so far (/proc/<pid>/stat; 0 if it is gone)."""
    try:
        return cpu_seconds(pid)
    except OSError:
        return 0.0


@dataclass
class Counters:
    """The agents' /metrics counters summed: requests by kind, bytes served per node, TokenReviews
    and local token checks."""

    requests: dict[str, float] = field(default_factory=dict)
    served: dict[str, float] = field(default_factory=dict)
    reviews: float = 0.0
    local_checks: float = 0.0


@dataclass
class StageRun:
    name: str
    nodes: list[str]
    skew_s: dict[str, float]
    starts: dict[str, float] = field(default_factory=dict)  # epoch
    ends: dict[str, float] = field(default_factory=dict)
    cpu_s: dict[str, float] = field(default_factory=dict)
    agent_cpu_s: dict[str, float] = field(default_factory=dict)
    summaries: dict[str, dict[str, Any]] = field(default_factory=dict)
    bucket_bytes: int = 0
    bucket_host_rx_bytes: int = 0
    latencies: list[float] = field(default_factory=list)
    writes: list[float] = field(default_factory=list)
    loadavg: list[float] = field(default_factory=list)
    objects: int = 0  # in the dataset
    rx_bytes: dict[str, int] = field(default_factory=dict)  # each node's veth, during the run
    served_bytes: dict[str, float] = field(default_factory=dict)  # each agent's /metrics, during the run
    bucket: dict[str, Any] = field(default_factory=dict)  # fanout_stats.bucket_reads, from the server's log
    #: user+sys seconds during the run per process class: agents, stagers, kube-apiserver, etcd,
    #: versitygw, and the bench itself (its threads relay the agents' API connections)
    class_cpu_s: dict[str, float] = field(default_factory=dict)
    #: the agents' requests during the run, "<route> <status>" -> count (their /metrics), in all
    requests: dict[str, int] = field(default_factory=dict)
    #: TokenReviews the agents sent the API server during the run, and the tokens they checked
    #: themselves against its published keys (each agent checks each stager's token once)
    token_reviews: int = 0
    token_local_checks: int = 0

    @property
    def own_s(self) -> dict[str, float]:
        return {n: self.ends[n] - self.starts[n] for n in self.nodes}

    @property
    def slowest_s(self) -> float:
        return max(self.own_s.values())

    @property
    def span_s(self) -> float:
        return max(self.ends.values()) - min(self.starts.values())


@dataclass
class Scale:
    kube: KubeAPI
    work: Path
    stager: str
    stage_env: Callable[[S3Server], dict[str, str]]
    verify: Callable[[str, str, dict[str, str], dict[str, Any], str], None]
    drop_cache: Callable[[], None]
    log: Callable[[str], None]
    net: netsim.Net
    token_file: Path
    #: every stager started, for the bench's clean-up to kill if it ends early
    procs: list[subprocess.Popen[str]] = field(default_factory=list)
    agents: list[NetnsAgent] = field(default_factory=list)
    sizes: dict[str, int] = field(default_factory=dict)  # rel path -> bytes, of the dataset being staged
    server: S3Server | None = None
    fwd: netsim.KubeForwarder | None = None

    @property
    def access_log(self) -> Path:
        return (self.work / "s3-access.log").resolve()

    def daemons_cpu_s(self) -> dict[str, float]:
        """CPU so far of the shared processes: the API server, etcd, the S3 server, this bench."""
        out: dict[str, float] = {}
        for cls, proc in (
            ("etcd", self.kube.procs[0] if self.kube.procs else None),
            ("kube_apiserver", self.kube.procs[1] if len(self.kube.procs) > 1 else None),
            ("versitygw", self.server.proc if self.server else None),
        ):
            out[cls] = proc_cpu_s(proc.pid) if proc is not None else 0.0
        t = os.times()
        out["bench"] = t.user + t.system
        return out

    def counters(self, agents: list[NetnsAgent]) -> Counters:
        """The agents' counters so far (one /metrics read each)."""
        c = Counters()
        for a in agents:
            text = a.metrics()
            for m in REQUESTS_LINE.finditer(text):
                key = " ".join(x for x in (m.group("route"), m.group("code"), m.group("state")) if x)
                c.requests[key] = c.requests.get(key, 0.0) + float(m.group("n"))
            m = re.search(r"^dscache_node_peer_served_bytes_total (\S+)$", text, re.M)
            c.served[a.node] = float(m.group(1)) if m else 0.0
            m = re.search(r"^dscache_node_token_reviews_total (\S+)$", text, re.M)
            c.reviews += float(m.group(1)) if m else 0.0
            m = re.search(r"^dscache_node_token_local_checks_total (\S+)$", text, re.M)
            c.local_checks += float(m.group(1)) if m else 0.0
        return c

    def up(self, stops: list[Callable[[], None]]) -> None:
        """The namespaces, the server in its own, the forwarder and an agent per node."""
        # The images compile their bytecode when they are built (compileall); a checkout run with
        # PYTHONDONTWRITEBYTECODE would compile the project's modules in every stager it starts.
        root = Path(__file__).resolve().parents[1]
        subprocess.run(
            [_python(), "-m", "compileall", "-q", *(str(root / d) for d in PACKAGES)],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        self.net.up()
        assert self.net.server is not None
        self.server = S3Server(root=self.work / "s3root-scale", host=self.net.server.ip, port=S3_PORT)
        stops.append(self.server.stop)
        # The server's own access log says which node (by address) read which key from the bucket.
        self.access_log.touch()
        os.environ["VGW_ACCESS_LOG"] = str(self.access_log)
        try:
            with netsim.inside(self.net.server.netns):
                self.server.start()
        finally:
            del os.environ["VGW_ACCESS_LOG"]
        self.fwd = netsim.KubeForwarder(self.kube.port)
        stops.append(self.fwd.close)
        for i, h in enumerate(self.net.hosts):
            self.fwd.serve(h.netns)
            a = NetnsAgent(self.kube, f"sim-node-{i:02d}", self.work / "sim" / f"n{i}", self.token_file)
            a.port, a.host = AGENT_PORT, h
            stops.append(a.stop)
            self.agents.append(a.start(wait=False))
        for a in self.agents:
            a.wait_ready(timeout=180)
        self.log(f"{len(self.agents)} agents in their namespaces; links: {self.net.qdiscs()}")

    def link_check(self, nbytes: int = 4 << 20) -> dict[str, float]:
        """The same file over plain HTTP, from the server's namespace and from a peer's, to node 0:
        both paths must carry it at the same rate (the harness favours neither)."""
        assert self.net.server is not None and len(self.net.hosts) >= 2
        d = self.work / "linkcheck"
        d.mkdir(exist_ok=True)
        (d / "blob").write_bytes(os.urandom(nbytes))
        port = 9555
        servers = [
            subprocess.Popen(
                h.argv(_python(), "-m", "http.server", str(port), "--bind", h.ip, "--directory", str(d)),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            for h in (self.net.server, self.net.hosts[1])
        ]
        try:
            out = {}
            for label, h in (("from_bucket_ns_mbit", self.net.server), ("from_peer_ns_mbit", self.net.hosts[1])):
                url = f"http://{h.ip}:{port}/blob"
                argv = self.net.hosts[0].argv(
                    "curl", "-sS", "--retry", "20", "--retry-connrefused", "--retry-delay", "0", "-o", "/dev/null",
                    "-w", "%{speed_download}", url,
                )  # fmt: skip
                bps = float(subprocess.run(argv, capture_output=True, text=True, check=True).stdout)
                out[label] = round(bps * 8 / 1e6, 2)
            self.log(f"link check, {nbytes} B to node 0 over plain HTTP: {out}")
            return out
        finally:
            for p in servers:
                p.terminate()
                p.wait()

    def upload(self, files: dict[str, bytes], bucket: str) -> None:
        """Unshaped (the upload is not measured), then every link shaped again."""
        assert self.server is not None and self.net.server is not None
        self.net.shape_host(self.net.server, 0)
        try:
            self.server.make_bucket(bucket)
            client = self.server.client()  # type: ignore[no-untyped-call]
            with concurrent.futures.ThreadPoolExecutor(16) as pool:
                for f in [pool.submit(client.put_object, Bucket=bucket, Key=k, Body=v) for k, v in files.items()]:
                    f.result()
        finally:
            self.net.shape_host(self.net.server, self.net.bucket_mbit)

    def stage(
        self,
        name: str,
        agents: list[NetnsAgent],
        uri: str,
        revision: str,
        dataset_bytes: int,
        want: dict[str, str],
        with_peers: bool,
        skew: list[float],
    ) -> StageRun:
        assert self.server is not None and self.net.server is not None
        logs = self.work / "logs"
        logs.mkdir(exist_ok=True)
        r = StageRun(name, [a.node for a in agents], {a.node: s for a, s in zip(agents, skew, strict=True)})
        r.objects = len(want)
        argvs: dict[str, list[str]] = {}
        for a in agents:
            assert a.host is not None
            argv = [
                self.stager, "sync", uri, contract.cache_dir(str(a.cache_root), NS, name),
                "--revision", revision, "--endpoint-url", self.server.endpoint,
                "--agent", a.url, "--cache", f"{NS}/{name}", "--bytes", str(dataset_bytes),
                "--progress-interval", "60",
            ]  # fmt: skip
            if with_peers:
                tok = self.work / f"peer-token-{name}-{a.node}"
                tok.write_text(a.peer_token(NS, name))  # its node's stager pod's token (issue 29)
                argv += ["--peer-token-file", str(tok)]
                if len(agents) > 1:
                    argv.append("--cohort")  # nodes that start together, as the webhook marks a gang's pods
            argvs[a.node] = a.host.argv(*argv)
        env = self.stage_env(self.server)
        self.drop_cache()
        tx0, rx0 = self.net.server.tx_bytes(), self.net.server.host_rx_bytes()
        cpu0 = {a.node: proc_cpu_s(a.proc.pid) if a.proc else 0.0 for a in agents}
        daemons0 = self.daemons_cpu_s()
        node_rx0 = {a.node: a.host.rx_bytes() for a in agents if a.host}
        counters0 = self.counters(agents)
        log_at = self.access_log.stat().st_size
        outs: dict[str, str] = {}
        codes: dict[str, int] = {}
        assert self.net.server is not None
        links = netsim.LinkTimeline({"bucket": self.net.server, **{a.node: a.host for a in agents if a.host}})
        t0 = time.time()

        def one(node: str) -> None:
            time.sleep(max(0.0, t0 + r.skew_s[node] - time.time()))
            with open(logs / f"{name}-{node}.log", "w") as err:
                r.starts[node] = time.time()
                p = subprocess.Popen(argvs[node], env=env, stdout=subprocess.PIPE, stderr=err, text=True)
                self.procs.append(p)
            assert p.stdout is not None
            outs[node] = p.stdout.read()
            p.stdout.close()
            _, status, ru = os.wait4(p.pid, 0)
            r.ends[node] = time.time()
            p.returncode = codes[node] = os.waitstatus_to_exitcode(status)
            r.cpu_s[node] = ru.ru_utime + ru.ru_stime

        threads = [threading.Thread(target=one, args=(n,)) for n in r.nodes]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        r.agent_cpu_s = {a.node: (proc_cpu_s(a.proc.pid) if a.proc else 0.0) - cpu0[a.node] for a in agents}
        r.class_cpu_s = {
            "agents": sum(r.agent_cpu_s.values()),
            "stagers": sum(r.cpu_s.values()),
            **{k: v - daemons0[k] for k, v in self.daemons_cpu_s().items()},
        }
        r.loadavg = [round(x, 2) for x in os.getloadavg()]
        time.sleep(0.2)  # the last segments are counted
        # Every link's counters over the run, kept with the logs (bench/fanout_tail.py reads them).
        (logs / f"{name}-links.json").write_text(json.dumps(links.stop()))
        r.bucket_bytes = self.net.server.tx_bytes() - tx0
        r.bucket_host_rx_bytes = self.net.server.host_rx_bytes() - rx0
        r.rx_bytes = {a.node: a.host.rx_bytes() - node_rx0[a.node] for a in agents if a.host}
        counters = self.counters(agents)
        r.served_bytes = {n: v - counters0.served[n] for n, v in counters.served.items()}
        r.requests = {
            k: int(v - counters0.requests.get(k, 0.0))
            for k, v in sorted(counters.requests.items())
            if v > counters0.requests.get(k, 0.0)
        }
        r.token_reviews = int(counters.reviews - counters0.reviews)
        r.token_local_checks = int(counters.local_checks - counters0.local_checks)
        with open(self.access_log, "rb") as f:
            f.seek(log_at)
            lines = f.read().decode(errors="replace").splitlines()
        gets = [g for g in map(access_get, lines) if g is not None]
        prefix = uri.split("/", 3)[3]
        sizes = {f"{prefix}{rel}": size for rel, size in self.sizes.items()}
        r.bucket = bucket_reads(gets, {a.host.ip: a.node for a in agents if a.host}, sizes)
        for node, code in codes.items():
            if code != 0:
                tail = (logs / f"{name}-{node}.log").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{name}: the stager on {node} exited {code}:\n{tail}")
        r.summaries = {n: json.loads(o.strip().splitlines()[-1]) for n, o in outs.items()}
        arrivals: dict[str, dict[str, float]] = {}
        for a in agents:
            c = contract.cache_dir(str(a.cache_root), NS, name)
            self.verify(c, revision, want, r.summaries[a.node], a.node)
            data = contract.data_dir(c, revision)
            arrivals[a.node] = {}
            for rel in want:
                born, mtime = birth_and_mtime(os.path.join(data, rel))
                arrivals[a.node][rel] = mtime
                if born:
                    r.writes.append(max(0.0, mtime - born))
        r.latencies = propagation(arrivals, r.starts)
        # Every (node, object) arrival and every node's start (epoch seconds), kept with the logs:
        # what a tail is made of (which node had which object whole when) is read from them.
        (logs / f"{name}-arrivals.json").write_text(
            json.dumps({"starts": r.starts, "ends": r.ends, "arrivals": arrivals})
        )
        for a in agents:
            code2, text = a.wipe(contract.WipeRequest(NS, name, all_revisions=True))
            if code2 != 200:
                raise RuntimeError(f"wipe of {NS}/{name} on {a.node}: HTTP {code2} {text}")
        self.log(
            f"{name}: {len(agents)} nodes; slowest node {r.slowest_s:.2f}s (span {r.span_s:.2f}s); the bucket sent "
            f"{r.bucket_bytes / 1e6:.1f} MB ({r.bucket_bytes / dataset_bytes:.3f}x); stagers say bucket "
            f"{sum(int(s.get('bucket_bytes', 0)) for s in r.summaries.values()) / 1e6:.1f} MB, peers "
            f"{sum(int(s.get('peer_bytes', 0)) for s in r.summaries.values()) / 1e6:.1f} MB; p99 object "
            f"{percentile(r.latencies, 0.99):.2f}s; agents CPU {sum(r.agent_cpu_s.values()):.1f}s; "
            f"stagers CPU {sum(r.cpu_s.values()):.1f}s; CPU by class "
            f"{ {k: round(v, 1) for k, v in r.class_cpu_s.items()} }; agents' requests {r.requests}; load {r.loadavg}; every byte verified; the server's log: "
            f"{len(r.bucket.get('per_node') or {})} nodes read the bucket, {r.bucket.get('keys_read_twice_or_more')} "
            f"keys by more than one ({r.bucket.get('extra_bytes', 0) / 1e6:.1f} MB extra)"
        )
        return r


def run_to_dict(r: StageRun, dataset_bytes: int) -> dict[str, Any]:
    return {
        "nodes": len(r.nodes),
        "skew_s": r.skew_s,
        "own_s": {n: round(v, 3) for n, v in r.own_s.items()},
        "bucket_bytes": r.bucket_bytes,
        "bucket_host_rx_bytes": r.bucket_host_rx_bytes,
        "per_node": {
            n: {
                "bucket_bytes": s.get("bucket_bytes", s.get("fetched_bytes")),
                "peer_bytes": s.get("peer_bytes"),
                "cpu_s": round(r.cpu_s[n], 3),
                "agent_cpu_s": round(r.agent_cpu_s[n], 3),
                "rx_mbit": round(r.rx_bytes.get(n, 0) * 8 / 1e6 / r.own_s[n], 2),
                "served_bytes": int(r.served_bytes.get(n, 0)),
                "bucket_objects_by_server_log": (r.bucket.get("per_node") or {}).get(n, {}).get("objects", 0),
            }
            for n, s in sorted(r.summaries.items())
        },
        "p50_object_s": round(percentile(r.latencies, 0.5), 3),
        "p99_write_s": round(percentile(r.writes, 0.99), 3),
        "loadavg": r.loadavg,
        "bucket_reads": r.bucket,
    }


def by_n_entry(r: StageRun, one_s: float, dataset_bytes: int) -> dict[str, Any]:
    return {
        "bucket_ratio": ratio(r.bucket_bytes, dataset_bytes),
        "all_ready_over_one": ratio(r.slowest_s, one_s),
        "p99_object_s": round(percentile(r.latencies, 0.99), 3),
        "agent_cpu_s": round(sum(r.agent_cpu_s.values()), 3),
        "all_ready_s": round(r.slowest_s, 3),
        "all_ready_span_s": round(r.span_s, 3),
        "stager_cpu_s": round(sum(r.cpu_s.values()), 3),
        "cpu_s_by_class": {k: round(v, 3) for k, v in r.class_cpu_s.items()},
        # The least the span could be on this machine: every process's CPU over its cores. Where it
        # nears all_ready_span_s, the run is bound by the one machine's CPU, not by the protocol.
        "cpu_floor_s": round(sum(r.class_cpu_s.values()) / len(os.sched_getaffinity(0)), 3),
        "agent_requests": r.requests,
        # One check per (agent, stager) pair that met, its own node's stager too: N x N at most (16
        # at N = 4), each with a pod GET (what the API server's CPU in cpu_s_by_class grows with, the
        # 256-node prediction): local while the agents can read the API server's keys, else a
        # TokenReview.
        "token_reviews": r.token_reviews,
        "token_local_checks": r.token_local_checks,
        "stager_bucket_bytes": sum(int(s.get("bucket_bytes", 0)) for s in r.summaries.values()),
        "peer_bytes": sum(int(s.get("peer_bytes", 0)) for s in r.summaries.values()),
        "nodes_reading_bucket": sum(1 for s in r.summaries.values() if int(s.get("bucket_bytes", 0)) > 0),
        # Where the load went: the nodes that served peers, the busiest one's bytes, and the nodes
        # the server's log saw read every object (each is a whole extra copy from the bucket).
        "serving_nodes": sum(1 for v in r.served_bytes.values() if v > 0),
        "top_served_bytes": int(max(r.served_bytes.values(), default=0)),
        "whole_dataset_readers": sorted(
            n for n, d in (r.bucket.get("per_node") or {}).items() if d.get("objects") == r.objects
        ),
        "run": run_to_dict(r, dataset_bytes),
    }


def make_files(prefix: str, count: int, size: int, tag: bytes) -> dict[str, bytes]:
    block = os.urandom(size)
    return {f"{prefix}/d{i % 50:02d}/f{i:06d}.bin": i.to_bytes(8, "little") + tag + block[9:size] for i in range(count)}


def run_scale(s: Scale, ns_list: list[int], args: Any, revision_of: Callable[..., dict[str, Any]]) -> dict[str, Any]:
    """The N sweep and the small-file profile; returns the fields the ``fanout`` object gains."""
    assert s.server is not None
    bucket = "scale"
    files = make_files("ds/large", args.scale_large_count, args.scale_large_size, b"L")
    files |= make_files("ds/small", args.scale_small_count, args.scale_small_size, b"S")
    dataset_bytes = sum(len(b) for b in files.values())
    want = {k[len("ds/") :]: hashlib.sha256(v).hexdigest() for k, v in files.items()}
    s.sizes = {k[len("ds/") :]: len(v) for k, v in files.items()}
    s.upload(files, bucket)
    del files
    check = s.link_check() if len(s.net.hosts) >= 2 else {}
    uri = f"s3://{bucket}/ds/"
    info = revision_of(s.server, uri)
    rev = info["revision"]
    if info.get("objects") != len(want):
        raise RuntimeError(f"the revision lists {info.get('objects')} objects, {len(want)} uploaded")
    s.log(
        f"scale dataset: {len(want)} objects, {dataset_bytes / 2**20:.1f} MiB; node links {args.node_mbit:g} mbit, "
        f"bucket link {args.scale_bucket_mbit:g} mbit; one copy through a node's link >= "
        f"{dataset_bytes * 8 / (args.node_mbit * 1e6):.1f}s"
    )
    ones = [
        s.stage(f"one-{i}", s.agents[:1], uri, rev, dataset_bytes, want, True, [0.0]) for i in range(args.one_rounds)
    ]
    one_s = sorted(r.slowest_s for r in ones)[len(ones) // 2]
    out: dict[str, Any] = {
        "scale_dataset_bytes": dataset_bytes,
        "scale_dataset_objects": len(want),
        "node_mbit": args.node_mbit,
        "scale_bucket_mbit": args.scale_bucket_mbit,
        "skew_max_s": args.skew_max_s,
        "skew_seed": args.skew_seed,
        "link_check": check,
        "one_alone_s": round(one_s, 3),
        "one_alone_runs": [run_to_dict(r, dataset_bytes) for r in ones],
        "one_alone_bucket_ratio": ratio(ones[0].bucket_bytes, dataset_bytes),
    }
    by_nodes: dict[int, dict[str, Any]] = {}
    for n in ns_list:
        skew = netsim.skews(n, args.skew_max_s, args.skew_seed)
        s.log(f"N={n}: start skew (s, seed {args.skew_seed}): {skew}")
        r = s.stage(f"scale-{n}", s.agents[:n], uri, rev, dataset_bytes, want, True, skew)
        by_nodes[n] = by_n_entry(r, one_s, dataset_bytes)
    out["by_nodes"] = {str(n): v for n, v in by_nodes.items()}
    top = max(ns_list)
    out["scale_targets"] = {"bucket_ratio_max": TARGET_BUCKET_RATIO, "all_ready_over_one_max_at_32": 1.3}
    out["scale_targets_met"] = {
        "bucket_ratio_every_n": all(v["bucket_ratio"] <= TARGET_BUCKET_RATIO for v in by_nodes.values()),
        "all_ready_over_one_at_32": (by_nodes[32]["all_ready_over_one"] <= TARGET_ALL_READY_OVER_ONE)
        if 32 in by_nodes
        else None,
    }
    out["predicted_256"] = {
        k: predict({n: v for n, v in by_nodes.items()}, k, 256)
        for k in ("bucket_ratio", "all_ready_over_one", "p99_object_s", "agent_cpu_s")
    }
    out["predicted_256_from"] = sorted(by_nodes)[-2:] if len(by_nodes) >= 2 else []
    s.log(f"largest N {top}: {by_nodes[top]['bucket_ratio']}x bucket, {by_nodes[top]['all_ready_over_one']}x one")
    if args.small_files > 0:
        out["small_files"] = run_small(s, args, revision_of)
    return out


def run_small(s: Scale, args: Any, revision_of: Callable[..., dict[str, Any]]) -> dict[str, Any]:
    assert s.server is not None and s.net.server is not None
    bucket = "smallfiles"
    files = make_files("sf", args.small_files, args.small_files_size, b"F")
    nbytes = sum(len(b) for b in files.values())
    want = {k[len("sf/") :]: hashlib.sha256(v).hexdigest() for k, v in files.items()}
    s.sizes = {k[len("sf/") :]: len(v) for k, v in files.items()}
    t = time.time()
    s.upload(files, bucket)
    del files
    s.log(f"small files: uploaded {len(want)} x {args.small_files_size} B in {time.time() - t:.0f}s")
    uri = f"s3://{bucket}/sf/"
    rev = revision_of(s.server, uri)["revision"]
    agents = s.agents[: args.small_files_nodes]
    s.net.shape_all(0, 0)  # every link unshaped, both runs alike
    try:
        zero = [0.0] * len(agents)
        via_peers = s.stage("small-peers", agents, uri, rev, nbytes, want, True, zero)
        alone = s.stage("small-bucket", agents, uri, rev, nbytes, want, False, zero)
    finally:
        s.net.shape_all(s.net.mbit, s.net.bucket_mbit)
    return {
        "objects": len(want),
        "object_size": args.small_files_size,
        "nodes": len(agents),
        "link": "unshaped (both runs)",
        "peers_all_ready_s": round(via_peers.slowest_s, 3),
        "bucket_alone_s": round(alone.slowest_s, 3),
        "peers_bucket_ratio": ratio(via_peers.bucket_bytes, nbytes),
        "bucket_alone_bucket_ratio": ratio(alone.bucket_bytes, nbytes),
        "peers_p99_object_s": round(percentile(via_peers.latencies, 0.99), 3),
        "peers_agent_cpu_s": round(sum(via_peers.agent_cpu_s.values()), 3),
        "peers_stager_cpu_s": round(sum(via_peers.cpu_s.values()), 3),
        "bucket_alone_stager_cpu_s": round(sum(alone.cpu_s.values()), 3),
        "target_met": via_peers.slowest_s <= alone.slowest_s,
        "runs": {"peers": run_to_dict(via_peers, nbytes), "bucket_alone": run_to_dict(alone, nbytes)},
    }
