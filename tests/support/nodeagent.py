"""The node agent (``dscache-node``) as a real process per fake Node, for the integration tier.

There is no kubelet: a test registers a Node object (InternalIP 127.0.0.1, Ready)
and runs ``python -m dscache_node`` for it, with its own cacheRoot in a temp dir
and its own port. The agent talks to the test's kube-apiserver out of cluster
(DSCACHE_KUBE_SERVER/CA and the admin client certificate, or a token file), labels
its Node with its port, and the controller sends wipes to 127.0.0.1:<port> with the
token both of them read from the same file.

Tests stage "copies" on the agent's disk by hand (``stage_copy``), exactly as the
stager leaves them, and assert on that disk and on the Node.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import dscache_contract as contract

from .agentauth import controller_token, stager_token
from .kubeapi import OPERATOR_NS, REPO, ApiError, KubeAPI
from .s3server import free_port

MiB = 1 << 20


def register_node(k: KubeAPI, node: str, labels: dict[str, str] | None = None) -> dict:
    """A Node as a kubelet registers it: InternalIP 127.0.0.1 (where its agent listens), Ready."""
    try:
        k.create(
            "/api/v1/nodes",
            {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {"name": node, "labels": {"kubernetes.io/hostname": node, **(labels or {})}},
            },
        )
    except ApiError as e:
        if e.status != 409:
            raise
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return k.merge_patch(
        f"/api/v1/nodes/{node}/status",
        {
            "status": {
                "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}, {"type": "Hostname", "address": node}],
                "conditions": [
                    {
                        "type": "Ready",
                        "status": "True",
                        "reason": "KubeletReady",
                        "message": "a test plays the kubelet",
                        "lastHeartbeatTime": now,
                        "lastTransitionTime": now,
                    }
                ],
            }
        },
    )


def create_ignoring_conflict(k: KubeAPI, path: str, body: dict[str, Any]) -> None:
    try:
        k.create(path, body)
    except ApiError as e:
        if e.status != 409:
            raise


def service_account_token(k: KubeAPI, sa: str, path: Path) -> Path:
    """A token of ServiceAccount ``sa`` in the operator's namespace (made if missing), in ``path``:
    an agent started with it has exactly that account's permissions."""
    create_ignoring_conflict(
        k,
        f"/api/v1/namespaces/{OPERATOR_NS}/serviceaccounts",
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": sa}},
    )
    token = k.create(
        f"/api/v1/namespaces/{OPERATOR_NS}/serviceaccounts/{sa}/token",
        {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {"expirationSeconds": 3600}},
    )["status"]["token"]
    path.write_text(token)
    return path


def node_labels(k: KubeAPI, node: str) -> dict[str, str]:
    return ((k.get(f"/api/v1/nodes/{node}") or {}).get("metadata") or {}).get("labels") or {}


def warm_labels(k: KubeAPI, node: str) -> set[str]:
    return {key for key in node_labels(k, node) if key.startswith(contract.WARM_LABEL_PREFIX)}


def inventory(k: KubeAPI, node: str) -> contract.Inventory | None:
    ann = ((k.get(f"/api/v1/nodes/{node}") or {}).get("metadata") or {}).get("annotations") or {}
    text = ann.get(contract.INVENTORY_ANNOTATION)
    return contract.Inventory.from_json(text) if text else None


def stage_copy(
    root: Path,
    ns: str,
    cache: str,
    rev: str,
    files: dict[str, bytes] | None = None,
    leases: tuple[str, ...] = (),
    released_at: float | None = None,
) -> Path:
    """A complete revision as the stager leaves it: data/, meta/manifest.jsonl, then
    meta/complete ({"objects", "bytes", ...}); ``leases``: pod UIDs under leases/<rev>/;
    ``released_at``: the mtime of the lease dir and the marker (the agent's LRU clock).
    Returns C."""
    files = {"a.bin": b"a" * 10, "sub/b.bin": b"b" * 25} if files is None else files
    c = Path(contract.cache_dir(str(root), ns, cache))
    data = Path(contract.data_dir(str(c), rev))
    data.mkdir(parents=True, exist_ok=True)
    lines = []
    for path in sorted(files):
        (data / path).parent.mkdir(parents=True, exist_ok=True)
        (data / path).write_bytes(files[path])
        etag = hashlib.md5(files[path]).hexdigest()
        lines.append(contract.ManifestEntry(key=f"prefix/{path}", path=path, size=len(files[path]), etag=etag))
    meta = Path(contract.meta_dir(str(c), rev))
    meta.mkdir(parents=True, exist_ok=True)
    (meta / contract.MANIFEST_NAME).write_text("".join(e.to_json() + "\n" for e in lines))
    total = sum(len(b) for b in files.values())
    (meta / contract.COMPLETE_NAME).write_text(
        json.dumps({"objects": len(files), "bytes": total, "skipped": 0, "fetched_bytes": total, "seconds": 0.1})
    )
    lease_dir = Path(contract.lease_dir(str(c), rev))
    lease_dir.mkdir(parents=True, exist_ok=True)
    for uid in leases:
        (lease_dir / uid).write_text("{}")
    if released_at is not None:
        os.utime(meta / contract.COMPLETE_NAME, (released_at, released_at))
        os.utime(lease_dir, (released_at, released_at))
    return c


def revision_on_disk(root: Path, ns: str, cache: str, rev: str) -> bool:
    return os.path.lexists(contract.revision_dir(contract.cache_dir(str(root), ns, cache), rev))


@dataclass
class NodeAgent:
    """One ``dscache-node`` process for one Node; its cacheRoot is ``workdir/root``."""

    kube: KubeAPI
    node: str
    workdir: Path
    #: Unused since issue 29 (no shared key: the agent checks Kubernetes tokens); kept so callers
    #: that still pass it positionally keep working.
    token_file: Path | None = None
    env_extra: dict[str, str] = field(default_factory=dict)
    #: The agent's own credentials for the API server: "cert" (the admin client
    #: certificate) or a path to a bearer-token file (a ServiceAccount's token).
    kube_token_file: Path | None = None
    port: int = 0
    #: (ca.crt, tls.crt, tls.key) (tests.support.tlscerts): serve TLS with that certificate.
    tls: tuple[Path, Path, Path] | None = None
    proc: subprocess.Popen | None = field(default=None, repr=False)
    starts: int = 0
    _tokens: dict[tuple[str, str], str] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.cache_root.mkdir(parents=True, exist_ok=True)
        if not self.port:
            self.port = free_port()

    @property
    def cache_root(self) -> Path:
        return self.workdir / "root"

    @property
    def log_path(self) -> Path:
        return self.workdir / "agent.log"

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "KUBECONFIG", "DSCACHE_"))}
        certs = self.kube.certs
        env.update(
            {
                "DSCACHE_NODE_NAME": self.node,
                "DSCACHE_CACHE_ROOT": str(self.cache_root),
                "DSCACHE_AGENT_PORT": str(self.port),
                "DSCACHE_NAMESPACE": OPERATOR_NS,
                "DSCACHE_KUBE_SERVER": self.kube.server,
                "DSCACHE_KUBE_CA": str(certs / "ca.crt"),
                # The host's disk is shared with everything else: no headroom, so that a
                # full host disk never makes the agent evict what a test staged.
                "DSCACHE_NODE_HEADROOM": "0",
                "DSCACHE_NODE_SCAN_INTERVAL": "1",
                "PYTHONUNBUFFERED": "1",
            }
        )
        if self.kube_token_file is None:
            env.update({"DSCACHE_KUBE_CERT": str(certs / "admin.crt"), "DSCACHE_KUBE_KEY": str(certs / "admin.key")})
        else:
            env["DSCACHE_KUBE_TOKEN_FILE"] = str(self.kube_token_file)
        if self.tls is not None:
            env.update({"DSCACHE_AGENT_TLS_CERT": str(self.tls[1]), "DSCACHE_AGENT_TLS_KEY": str(self.tls[2])})
        env.update(self.env_extra)
        return env

    def start(self, wait: bool = True) -> NodeAgent:
        register_node(self.kube, self.node)
        log = open(self.log_path, "ab")  # noqa: SIM115 (the process keeps it open)
        log.write(f"--- start {self.starts} ---\n".encode())
        log.flush()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dscache_node"], env=self.env(), stdout=log, stderr=subprocess.STDOUT, cwd=REPO
        )
        self.starts += 1
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self, timeout: float = 30) -> None:
        """Serving, and its Node names its port (the controller finds it by that label)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"dscache-node for {self.node} exited {self.proc.returncode}:\n{self.log()[-3000:]}")
            if self.healthz() == 200 and node_labels(self.kube, self.node).get(contract.AGENT_LABEL) == str(self.port):
                return
            time.sleep(0.1)
        raise RuntimeError(f"dscache-node for {self.node} not ready within {timeout}s:\n{self.log()[-3000:]}")

    def stop(self, kill: bool = False) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def wipes(self, ns: str, cache: str) -> list[str]:
        """The wipe requests of ``ns/cache`` this agent served (one INFO line each, across restarts)."""
        return re.findall(rf"^.* wipe {re.escape(ns)}/{re.escape(cache)} .*$", self.log(), re.M)

    # --- its HTTP API -----------------------------------------------------------------------

    def _http(self, method: str, path: str, body: str | None = None, headers: dict | None = None) -> tuple[int, str]:
        req = urllib.request.Request(
            self.url + path, data=body.encode() if body is not None else None, method=method, headers=headers or {}
        )
        ctx = None
        if self.tls is not None:  # its CA, for the name on its certificate (not 127.0.0.1)
            ctx = ssl.create_default_context(cafile=str(self.tls[0]))
            ctx.check_hostname = False
        try:
            with urllib.request.urlopen(req, timeout=60, context=ctx) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def healthz(self) -> int | None:
        try:
            return self._http("GET", "/healthz")[0]
        except OSError:
            return None

    def metrics(self) -> str:
        return self._http("GET", "/metrics")[1]

    def peer_token(self, ns: str, cache: str) -> str:
        """A token of a stager of ``ns/cache`` on this node (a pod naming the cache, its bound token)."""
        key = (ns, cache)
        if key not in self._tokens:
            self._tokens[key] = stager_token(self.kube, ns, cache, self.node)
        return self._tokens[key]

    def reserve(self, ns: str, cache: str, rev: str, nbytes: int, token: str | None = None) -> tuple[int, Any]:
        code, text = self._http(
            "POST",
            contract.RESERVE_PATH,
            contract.ReserveRequest(ns, cache, rev, nbytes).to_json(),
            {
                "Content-Type": "application/json",
                "Authorization": f"Bearer {self.peer_token(ns, cache) if token is None else token}",
            },
        )
        return code, contract.ReserveAnswer.from_json(text) if code == 200 else text

    def wipe(self, req: contract.WipeRequest, token: str | None = None) -> tuple[int, str]:
        token = controller_token(self.kube, self.node) if token is None else token
        return self._http(
            "POST",
            contract.WIPE_PATH,
            req.to_json(),
            {"Content-Type": "application/json", "Authorization": f"Bearer {token}"},
        )


class NodeAgents:
    """The agents a test started, one per Node name; all stopped when the test ends."""

    def __init__(self, kube: KubeAPI, workdir: Path, token_file: Path | None = None) -> None:
        self.kube, self.workdir, self.token_file = kube, workdir, token_file
        self.agents: dict[str, NodeAgent] = {}

    def __getitem__(self, node: str) -> NodeAgent:
        return self.agents[node]

    def start(self, node: str, **kw: Any) -> NodeAgent:
        """Register ``node`` and start its agent (a fresh, empty cacheRoot)."""
        assert node not in self.agents, f"{node} already has an agent in this test"
        agent = NodeAgent(self.kube, node, self.workdir / node, self.token_file, **kw)
        self.agents[node] = agent
        return agent.start()

    def stop_all(self) -> None:
        for agent in self.agents.values():
            agent.stop()
