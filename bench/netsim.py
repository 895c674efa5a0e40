"""Simulated nodes on one machine (issue 30): a network namespace per node, a shared bridge, tbf links.

Each simulated node is its own network namespace with one veth pair to a bridge in the
host namespace; the S3 server gets a namespace and a veth pair of its own, the same way.
Both ends of every veth pair are shaped with ``tc`` ``tbf`` (``netem`` is not available on
these kernels): the host end's egress is what the node receives (from the bucket and from
peers alike), the namespace end's egress is what it sends (to peers, or the bucket's
bodies). So the bucket path and the peer path cross exactly the same kind of link: a byte
from the bucket to node A crosses the server's link and A's link; a byte from node B to
node A crosses B's link and A's link.

The agents reach the kube-apiserver (bound to 127.0.0.1 in the host namespace, its
certificate naming 127.0.0.1) through ``KubeForwarder``: a listening socket made inside
each node's namespace at 127.0.0.1:<port>, whose connections the bench relays to the
real API server. That is control-plane traffic only (labels, Node lists), on no shaped
link; no byte of an object crosses it.

Everything made here is named ``dsn<pid>...`` and removed by ``Net.down`` (deleting a
namespace deletes its veth ends, their peers and their qdiscs; then the bridge).
``remove_stale`` removes what a killed earlier run (its pid gone) left. Nothing else on
the machine (the kind cluster's docker bridge and veths) is touched.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import random
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CLONE_NEWNET = 0x40000000
PREFIX = "dsn"


def run(*argv: str, check: bool = True) -> str:
    p = subprocess.run(argv, capture_output=True, text=True)
    if check and p.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {p.returncode}: {p.stderr.strip()}")
    return p.stdout


def skews(n: int, max_s: float, seed: int) -> list[float]:
    """Each node's start delay, uniform in [0, max_s], the same for a given seed and n."""
    rng = random.Random(f"{seed}:{n}")
    return [round(rng.uniform(0.0, max_s), 3) for _ in range(n)]


def tbf_args(mbit: float, burst: int, latency_ms: float) -> list[str]:
    """The tbf qdisc's arguments (``mbit`` > 0)."""
    return ["tbf", "rate", f"{mbit:g}mbit", "burst", str(burst), "latency", f"{latency_ms:g}ms"]


@dataclass
class Host:
    """One namespace (a node, or the S3 server) and its veth pair to the bridge."""

    netns: str
    host_if: str  # in the host namespace, enslaved to the bridge
    ns_if: str  # inside the namespace
    ip: str

    def tx_bytes(self) -> int:
        """Bytes this namespace sent on its link (counted by its own veth end)."""
        (dev,) = json.loads(run("ip", "-n", self.netns, "-j", "-s", "link", "show", "dev", self.ns_if))
        return int(dev["stats64"]["tx"]["bytes"])

    def rx_bytes(self) -> int:
        """Bytes this namespace received (its own veth end)."""
        (dev,) = json.loads(run("ip", "-n", self.netns, "-j", "-s", "link", "show", "dev", self.ns_if))
        return int(dev["stats64"]["rx"]["bytes"])

    def host_counters(self) -> tuple[int, int]:
        """Its link's bytes as the bridge side counts them: (sent to it, received from it)."""
        stats = Path("/sys/class/net") / self.host_if / "statistics"
        return int((stats / "tx_bytes").read_text()), int((stats / "rx_bytes").read_text())

    def host_rx_bytes(self) -> int:
        """What the bridge side received from it (a cross-check of ``tx_bytes``)."""
        return self.host_counters()[1]

    def argv(self, *cmd: str) -> list[str]:
        """``cmd`` run inside this namespace (``ip netns exec`` execs it: the pid is the command's)."""
        return ["ip", "netns", "exec", self.netns, *cmd]


@dataclass
class Net:
    """A bridge, the S3 server's namespace and ``nodes`` node namespaces, every link shaped alike."""

    nodes: int
    mbit: float
    bucket_mbit: float
    burst: int = 256 << 10
    latency_ms: float = 50.0
    mtu: int = 1500
    tag: str = field(default_factory=lambda: str(os.getpid()))
    hosts: list[Host] = field(default_factory=list)
    server: Host | None = None
    bridge_up: bool = False

    @property
    def bridge(self) -> str:
        return f"{PREFIX}{self.tag}b"[:15]

    @property
    def subnet(self) -> str:
        return f"10.232.{16 + int(self.tag) % 200}"

    @property
    def bridge_ip(self) -> str:
        return f"{self.subnet}.1"

    def up(self) -> Net:
        if self.nodes > 200:
            raise ValueError("at most 200 simulated nodes in one /24")
        run("ip", "link", "add", self.bridge, "type", "bridge")
        self.bridge_up = True
        run("ip", "addr", "add", f"{self.bridge_ip}/24", "dev", self.bridge)
        run("ip", "link", "set", self.bridge, "up")
        self.server = self._host("s", f"{self.subnet}.2", self.bucket_mbit)
        for i in range(self.nodes):
            self.hosts.append(self._host(f"n{i}", f"{self.subnet}.{10 + i}", self.mbit))
        self.pin_neighbours()
        return self

    def pin_neighbours(self) -> None:
        """Every namespace knows every other's MAC (permanent neighbour entries), and so does the bridge.

        At N=32 on 2 cores, stagers got "No route to host" from peers now and then (issue 30's fourth
        round: 8-14 times a run): neighbour resolution that timed out while the links were full (tbf
        queues ARP behind data, and drops what waits past its latency). peers.py writes such a peer off
        for the run, as it would a dead node, and its objects came from the bucket: bucket_ratio 3-5
        in those runs. The simulation's nodes do not move, so their addresses are pinned; what is
        measured is then the protocol, not ARP on a starved machine.
        """
        assert self.server is not None
        hosts = [self.server, *self.hosts]
        macs = {h.ip: self._mac(h) for h in hosts}
        bridge_mac = json.loads(run("ip", "-j", "link", "show", "dev", self.bridge))[0]["address"]
        for h in hosts:
            lines = [
                f"neigh replace {ip} lladdr {mac} dev {h.ns_if} nud permanent" for ip, mac in macs.items() if ip != h.ip
            ]
            lines.append(f"neigh replace {self.bridge_ip} lladdr {bridge_mac} dev {h.ns_if} nud permanent")
            subprocess.run(["ip", "-n", h.netns, "-batch", "-"], input="\n".join(lines) + "\n", text=True, check=True)
        lines = [f"neigh replace {ip} lladdr {mac} dev {self.bridge} nud permanent" for ip, mac in macs.items()]
        subprocess.run(["ip", "-batch", "-"], input="\n".join(lines) + "\n", text=True, check=True)

    @staticmethod
    def _mac(h: Host) -> str:
        return str(json.loads(run("ip", "-n", h.netns, "-j", "link", "show", "dev", h.ns_if))[0]["address"])

    def _host(self, name: str, ip: str, mbit: float) -> Host:
        netns = f"{PREFIX}-{self.tag}-{name}"
        h = Host(netns, f"{PREFIX}{self.tag}{name}"[:15], "eth0", ip)
        run("ip", "netns", "add", netns)
        self_ns = ("ip", "-n", netns)
        run("ip", "link", "add", h.host_if, "type", "veth", "peer", "name", h.ns_if, "netns", netns)
        run("ip", "link", "set", h.host_if, "mtu", str(self.mtu), "master", self.bridge, "up")
        run(*self_ns, "link", "set", "lo", "up")
        run(*self_ns, "link", "set", h.ns_if, "mtu", str(self.mtu))
        run(*self_ns, "addr", "add", f"{ip}/24", "dev", h.ns_if)
        run(*self_ns, "link", "set", h.ns_if, "up")
        self.shape_host(h, mbit)
        return h

    def shape_host(self, h: Host, mbit: float) -> None:
        """Both directions of ``h``'s link at ``mbit``; no qdisc at all when ``mbit`` <= 0."""
        for ns, dev in (("", h.host_if), (h.netns, h.ns_if)):
            tc = ["tc", "qdisc"] if not ns else ["ip", "netns", "exec", ns, "tc", "qdisc"]
            if mbit > 0:
                run(*tc, "replace", "dev", dev, "root", *tbf_args(mbit, self.burst, self.latency_ms))
            else:
                run(*tc, "del", "dev", dev, "root", check=False)

    def shape_all(self, mbit: float, bucket_mbit: float) -> None:
        assert self.server is not None
        self.shape_host(self.server, bucket_mbit)
        for h in self.hosts:
            self.shape_host(h, mbit)

    def qdiscs(self) -> str:
        """What tc says of one node's two ends and the server's (for the log: the shaping is there)."""
        assert self.server is not None
        out = []
        for h in (self.server, *self.hosts[:1]):
            out.append(run("tc", "qdisc", "show", "dev", h.host_if).strip())
            out.append(run("ip", "netns", "exec", h.netns, "tc", "qdisc", "show", "dev", h.ns_if).strip())
        return "; ".join(out)

    @contextlib.contextmanager
    def inside(self, netns: str) -> Iterator[None]:
        with inside(netns):
            yield

    def down(self) -> None:
        for h in [*self.hosts, *([self.server] if self.server else [])]:
            run("ip", "netns", "del", h.netns, check=False)
            if Path(f"/sys/class/net/{h.host_if}").exists():
                run("ip", "link", "del", h.host_if, check=False)
        self.hosts.clear()
        self.server = None
        if self.bridge_up:
            run("ip", "link", "del", self.bridge, check=False)
            self.bridge_up = False


class LinkTimeline:
    """Every ``interval_s``, the byte counters of some hosts' links, at their bridge ends (tx: what
    the namespace received, rx: what it sent), on a thread of its own until ``stop``: where a run's
    time went on each link, e.g. whether the bucket's link was full and what the nodes still lacked
    when it fell idle (bench/fanout_tail.py). Reading two sysfs files per link costs the run
    next to nothing."""

    def __init__(self, hosts: dict[str, Host], interval_s: float = 0.1) -> None:
        self.hosts, self.interval_s = hosts, interval_s
        self.rows: list[tuple[float, dict[str, tuple[int, int]]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        try:
            row = {name: h.host_counters() for name, h in self.hosts.items()}
        except OSError:
            return  # a link going away: this moment is left out
        self.rows.append((time.time(), row))

    def _run(self) -> None:
        self._sample()
        while not self._stop.wait(self.interval_s):
            self._sample()
        self._sample()

    def stop(self) -> dict[str, Any]:
        """The timeline: sample times (epoch s), and per host its cumulative bytes received
        (``down``) and sent (``up``) at each."""
        self._stop.set()
        self._thread.join()
        names = list(self.hosts)
        return {
            "interval_s": self.interval_s,
            "t": [round(t, 3) for t, _ in self.rows],
            "down": {n: [row[n][0] for _, row in self.rows] for n in names},
            "up": {n: [row[n][1] for _, row in self.rows] for n in names},
        }


@contextlib.contextmanager
def inside(netns: str) -> Iterator[None]:
    """This thread in ``netns`` (a socket made meanwhile stays in it; children started meanwhile too)."""
    libc = ctypes.CDLL(None, use_errno=True)
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    target = os.open(f"/run/netns/{netns}", os.O_RDONLY)
    try:
        if libc.setns(target, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {netns}")
        try:
            yield
        finally:
            if libc.setns(own, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns back to the host namespace")
    finally:
        os.close(own)
        os.close(target)


def stale_tags(netns_names: list[str], alive: set[int] | None = None) -> set[str]:
    """Tags (pids) of ``dsn-<pid>-...`` namespaces whose run is gone (``alive``: pids to keep)."""
    out = set()
    for name in netns_names:
        parts = name.split("-")
        if len(parts) == 3 and parts[0] == PREFIX and parts[1].isdigit():
            pid = int(parts[1])
            gone = pid not in alive if alive is not None else not Path(f"/proc/{pid}").exists()
            if gone:
                out.add(parts[1])
    return out


def remove_stale(log: object = print) -> None:
    names = [line.split()[0] for line in run("ip", "netns", "list", check=False).splitlines() if line.split()]
    for tag in stale_tags(names):
        log(f"removing the namespaces and bridge of an earlier run (pid {tag} is gone)")  # type: ignore[operator]
        for name in names:
            if name.startswith(f"{PREFIX}-{tag}-"):
                run("ip", "netns", "del", name, check=False)
        bridge = f"{PREFIX}{tag}b"[:15]
        if Path(f"/sys/class/net/{bridge}").exists():
            run("ip", "link", "del", bridge, check=False)


class KubeForwarder:
    """127.0.0.1:<port> inside each namespace, relayed to 127.0.0.1:<port> of the host namespace
    (the API server). One thread per direction and connection: the agents keep few connections."""

    def __init__(self, port: int) -> None:
        self.port = port
        self._listeners: list[socket.socket] = []
        self._stop = threading.Event()

    def serve(self, netns: str) -> None:
        with inside(netns):
            ls = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        ls.bind(("127.0.0.1", self.port))
        ls.listen(64)
        self._listeners.append(ls)
        threading.Thread(target=self._accept, args=(ls,), daemon=True, name=f"kubefwd-{netns}").start()

    def _accept(self, ls: socket.socket) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = ls.accept()
            except OSError:
                return
            try:
                up = socket.create_connection(("127.0.0.1", self.port), timeout=10)
            except OSError:
                conn.close()
                continue
            up.settimeout(None)
            for a, b in ((conn, up), (up, conn)):
                threading.Thread(target=_pump, args=(a, b), daemon=True).start()

    def close(self) -> None:
        self._stop.set()
        for ls in self._listeners:
            with contextlib.suppress(OSError):
                ls.close()
        self._listeners.clear()


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(1 << 16):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        # Either side gone: end both directions; each pump closes the socket it read from.
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
        src.close()
