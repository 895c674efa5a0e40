"""A real kube-apiserver + etcd for integration tests (no kubelet, no controllers).

Binaries come from ``e2e/tools/tools.sh`` (built through the Go module proxy,
cached outside the repo). Certificates are made with openssl. The API server
authenticates us with an admin client certificate and calls webhooks over TLS.

Without a kubelet or controller-manager, tests play those roles themselves:
they patch pod and Job status as those components would.
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import socket
import ssl
import subprocess
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .s3server import free_port
from .tools import tool_bin


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def make_ca(d: Path, name: str = "ca") -> None:
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
        "-keyout",
        f"{name}.key",
        "-out",
        f"{name}.crt",
        "-days",
        "3",
        "-subj",
        f"/CN=dscache-test-{name}",
        cwd=d,
    )


def make_cert(
    d: Path, name: str, subject: str, *, ca: str = "ca", sans: str | None = None, usage: str = "serverAuth"
) -> None:
    ext = [f"extendedKeyUsage={usage}", "basicConstraints=CA:FALSE", "keyUsage=digitalSignature,keyEncipherment"]
    if sans:
        ext.append(f"subjectAltName={sans}")
    (d / f"{name}.ext").write_text("\n".join(ext) + "\n")
    _openssl(
        "req",
        "-new",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
        "-keyout",
        f"{name}.key",
        "-out",
        f"{name}.csr",
        "-subj",
        subject,
        cwd=d,
    )
    _openssl(
        "x509",
        "-req",
        "-in",
        f"{name}.csr",
        "-CA",
        f"{ca}.crt",
        "-CAkey",
        f"{ca}.key",
        "-CAcreateserial",
        "-out",
        f"{name}.crt",
        "-days",
        "3",
        "-extfile",
        f"{name}.ext",
        cwd=d,
    )


class ApiError(Exception):
    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body[:2000]}")
        self.status = status
        self.body = body


@dataclass
class KubeAPI:
    """kube-apiserver + etcd in ``workdir``; ``api()`` speaks JSON to it as admin."""

    workdir: Path
    port: int = 0
    etcd_port: int = 0
    procs: list[subprocess.Popen] = field(default_factory=list, repr=False)

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    @property
    def audit_log(self) -> Path:
        """JSON lines, one audit event per request of the operator's ServiceAccounts."""
        return self.workdir / "audit.log"

    def audit_events(self) -> list[dict[str, Any]]:
        if not self.audit_log.exists():
            return []
        return [json.loads(line) for line in self.audit_log.read_text().splitlines() if line.strip()]

    @property
    def kubeconfig(self) -> Path:
        return self.workdir / "kubeconfig"

    @property
    def certs(self) -> Path:
        return self.workdir / "pki"

    # --- lifecycle ---------------------------------------------------------------

    def start(self) -> KubeAPI:
        pki = self.certs
        pki.mkdir(parents=True, exist_ok=True)
        make_ca(pki)
        make_cert(
            pki,
            "apiserver",
            "/CN=kube-apiserver",
            sans="IP:127.0.0.1,DNS:localhost,DNS:kubernetes.default.svc,IP:10.96.0.1",
        )
        make_cert(pki, "admin", "/O=system:masters/CN=dscache-test-admin", usage="clientAuth")
        make_cert(pki, "webhook", "/CN=dscache-webhook", sans="IP:127.0.0.1,DNS:localhost")
        _openssl("genrsa", "-out", "sa.key", "2048", cwd=pki)
        _openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=pki)

        self.etcd_port = free_port()
        peer = free_port()
        etcd_log = open(self.workdir / "etcd.log", "wb")  # noqa: SIM115 (the daemon keeps it open)
        self.procs.append(
            subprocess.Popen(
                [
                    str(tool_bin("etcd") / "etcd"),
                    "--data-dir",
                    str(self.workdir / "etcd"),
                    "--listen-client-urls",
                    f"http://127.0.0.1:{self.etcd_port}",
                    "--advertise-client-urls",
                    f"http://127.0.0.1:{self.etcd_port}",
                    "--listen-peer-urls",
                    f"http://127.0.0.1:{peer}",
                    "--initial-advertise-peer-urls",
                    f"http://127.0.0.1:{peer}",
                    "--initial-cluster",
                    f"default=http://127.0.0.1:{peer}",
                    "--unsafe-no-fsync",
                    "--log-level",
                    "warn",
                ],
                stdout=etcd_log,
                stderr=subprocess.STDOUT,
            )
        )

        self.port = free_port()
        # Audit: every request of the operator's two ServiceAccounts, at Metadata
        # level, so tests can assert what each process did (e.g. the webhook never writes).
        (self.workdir / "audit-policy.yaml").write_text(
            json.dumps(
                {
                    "apiVersion": "audit.k8s.io/v1",
                    "kind": "Policy",
                    "omitStages": ["RequestReceived"],
                    "rules": [
                        {
                            "level": "Metadata",
                            "users": [
                                f"system:serviceaccount:{OPERATOR_NS}:dscache-webhook",
                                f"system:serviceaccount:{OPERATOR_NS}:dscache-controller",
                            ],
                        },
                        {"level": "None"},
                    ],
                }
            )
        )
        api_log = open(self.workdir / "kube-apiserver.log", "wb")  # noqa: SIM115 (the daemon keeps it open)
        self.procs.append(
            subprocess.Popen(
                [
                    str(tool_bin("kube-apiserver") / "kube-apiserver"),
                    f"--etcd-servers=http://127.0.0.1:{self.etcd_port}",
                    "--bind-address=127.0.0.1",
                    f"--secure-port={self.port}",
                    "--advertise-address=127.0.0.1",
                    f"--cert-dir={self.workdir / 'apiserver-certs'}",
                    f"--tls-cert-file={pki / 'apiserver.crt'}",
                    f"--tls-private-key-file={pki / 'apiserver.key'}",
                    f"--client-ca-file={pki / 'ca.crt'}",
                    f"--service-account-key-file={pki / 'sa.pub'}",
                    f"--service-account-signing-key-file={pki / 'sa.key'}",
                    "--service-account-issuer=https://kubernetes.default.svc",
                    "--service-cluster-ip-range=10.96.0.0/24",
                    "--authorization-mode=Node,RBAC",
                    # No controller-manager creates the 'default' ServiceAccount here.
                    "--disable-admission-plugins=ServiceAccount",
                    "--allow-privileged=true",
                    "--profiling=false",
                    # ConfigMaps bypass the watch cache, so a watch from a compacted
                    # resourceVersion reaches etcd and gets a real 410 Gone (the
                    # informer test); nothing of the operator watches ConfigMaps.
                    "--watch-cache-sizes=configmaps#0",
                    f"--audit-policy-file={self.workdir / 'audit-policy.yaml'}",
                    f"--audit-log-path={self.audit_log}",
                    "--audit-log-format=json",
                    "--audit-log-mode=blocking",
                    "--v=1",
                ],
                stdout=api_log,
                stderr=subprocess.STDOUT,
            )
        )

        self.kubeconfig.write_text(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "current-context": "test",
                    "clusters": [
                        {
                            "name": "test",
                            "cluster": {"server": self.server, "certificate-authority": str(pki / "ca.crt")},
                        }
                    ],
                    "users": [
                        {
                            "name": "admin",
                            "user": {
                                "client-certificate": str(pki / "admin.crt"),
                                "client-key": str(pki / "admin.key"),
                            },
                        }
                    ],
                    "contexts": [{"name": "test", "context": {"cluster": "test", "user": "admin"}}],
                }
            )
        )
        self._wait_ready()
        return self

    def _wait_ready(self, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"{p.args[0]} exited with {p.returncode}; see {self.workdir}/*.log")
            try:
                # The default namespace appears once the bootstrap controller ran.
                if (
                    self.request("GET", "/readyz", raw=True) == "ok"
                    and self.get("/api/v1/namespaces/default") is not None
                ):
                    return
            except (OSError, ApiError) as e:
                last = e
            time.sleep(0.3)
        raise RuntimeError(f"kube-apiserver not ready within {timeout}s: {last}")

    def stop(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
        for p in reversed(self.procs):
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    # --- a tiny JSON client ----------------------------------------------------------

    def _ssl(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(self.certs / "ca.crt"))
        ctx.load_cert_chain(str(self.certs / "admin.crt"), str(self.certs / "admin.key"))
        return ctx

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        content_type: str = "application/json",
        raw: bool = False,
        params: dict[str, str] | None = None,
    ) -> Any:
        if params:
            path += "?" + urllib.parse.urlencode(params)
        conn = http.client.HTTPSConnection("127.0.0.1", self.port, context=self._ssl(), timeout=30)
        try:
            data = None if body is None else (body if isinstance(body, (bytes, str)) else json.dumps(body))
            headers = {"Accept": "application/json"}
            if data is not None:
                headers["Content-Type"] = content_type
            conn.request(method, path, body=data, headers=headers)
            resp = conn.getresponse()
            text = resp.read().decode()
        finally:
            conn.close()
        if resp.status >= 400:
            raise ApiError(resp.status, text)
        if raw:
            return text
        return json.loads(text) if text else None

    def get(self, path: str) -> Any:
        try:
            return self.request("GET", path)
        except ApiError as e:
            if e.status == 404:
                return None
            raise

    def create(self, path: str, obj: dict[str, Any]) -> Any:
        return self.request("POST", path, obj)

    def merge_patch(self, path: str, patch: dict[str, Any]) -> Any:
        return self.request("PATCH", path, patch, content_type="application/merge-patch+json")

    def delete(self, path: str) -> Any:
        try:
            return self.request("DELETE", path)
        except ApiError as e:
            if e.status == 404:
                return None
            raise

    def apply_yaml_docs(self, docs: list[dict[str, Any]]) -> None:
        """Create (or replace) plain manifests through their REST paths."""
        for doc in docs:
            path = rest_path(doc, collection=True)
            try:
                self.create(path, doc)
            except ApiError as e:
                if e.status != 409:
                    raise
                current = self.get(rest_path(doc))
                doc = {
                    **doc,
                    "metadata": {**doc["metadata"], "resourceVersion": current["metadata"]["resourceVersion"]},
                }
                self.request("PUT", rest_path(doc), doc)

    def namespace(self, name: str, labels: dict[str, str] | None = None) -> str:
        self.create(
            "/api/v1/namespaces",
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels or {}}},
        )
        return name

    def ca_bundle(self, name: str = "ca") -> str:
        return base64.b64encode((self.certs / f"{name}.crt").read_bytes()).decode()

    def wait_for(self, fn, timeout: float = 30, interval: float = 0.2, what: str = "condition"):
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            last = fn()
            if last:
                return last
            time.sleep(interval)
        raise AssertionError(f"timed out after {timeout}s waiting for {what}; last: {last!r}")


_CORE = {
    "Namespace": "namespaces",
    "Pod": "pods",
    "Secret": "secrets",
    "ServiceAccount": "serviceaccounts",
    "Service": "services",
    "ConfigMap": "configmaps",
}


def rest_path(doc: dict[str, Any], collection: bool = False) -> str:
    api = doc["apiVersion"]
    kind = doc["kind"]
    base = f"/api/{api}" if "/" not in api else f"/apis/{api}"
    plural = (
        _CORE.get(kind)
        or {
            "CustomResourceDefinition": "customresourcedefinitions",
            "MutatingWebhookConfiguration": "mutatingwebhookconfigurations",
            "ClusterRole": "clusterroles",
            "ClusterRoleBinding": "clusterrolebindings",
            "Role": "roles",
            "RoleBinding": "rolebindings",
            "Job": "jobs",
            "Deployment": "deployments",
            "DatasetCache": "datasetcaches",
        }.get(kind)
        or kind.lower() + "s"
    )
    ns = doc["metadata"].get("namespace")
    path = f"{base}/namespaces/{ns}/{plural}" if ns else f"{base}/{plural}"
    return path if collection else f"{path}/{doc['metadata']['name']}"


def wait_port(host: str, port: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host, port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"{host}:{port} not listening after {timeout}s")


def env_with(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(extra)
    return env


# --- the operator, deployed as the manifests say, run as local processes -------------

REPO = Path(__file__).resolve().parents[2]
OPERATOR_NS = "dscache-system"


def load_yaml_docs(path: Path) -> list[dict[str, Any]]:
    import yaml

    return [d for d in yaml.safe_load_all(path.read_text()) if d]


@dataclass
class Operator:
    """The controller and the webhook as subprocesses, each with its own
    ServiceAccount token (so the shipped RBAC is what the tests exercise)."""

    kube: KubeAPI
    workdir: Path
    extra_env: dict[str, str] = field(default_factory=dict)
    webhook_port: int = 0
    metrics_ports: dict[str, int] = field(default_factory=dict)
    health_ports: dict[str, int] = field(default_factory=dict)
    procs: dict[str, subprocess.Popen] = field(default_factory=dict, repr=False)

    def install(self) -> Operator:
        k = self.kube
        k.apply_yaml_docs(load_yaml_docs(REPO / "crds" / "datasetcache.yaml"))
        k.wait_for(
            lambda: any(
                c["type"] == "Established" and c["status"] == "True"
                for c in (
                    k.get("/apis/apiextensions.k8s.io/v1/customresourcedefinitions/datasetcaches.dscache.io").get(
                        "status"
                    )
                    or {}
                ).get("conditions")
                or []
            ),
            what="CRD established",
        )
        k.apply_yaml_docs(load_yaml_docs(REPO / "operator" / "deploy" / "rbac.yaml"))
        self.webhook_port = free_port()
        self.metrics_ports = {"controller": free_port(), "webhook": free_port()}
        self.health_ports = {"controller": free_port(), "webhook": free_port()}
        (mwc,) = load_yaml_docs(REPO / "operator" / "deploy" / "webhook.yaml")
        for hook in mwc["webhooks"]:
            path = hook["clientConfig"]["service"]["path"]
            hook["clientConfig"] = {"url": f"https://127.0.0.1:{self.webhook_port}{path}", "caBundle": k.ca_bundle()}
        k.apply_yaml_docs([mwc])
        for role in ("controller", "webhook"):
            self._kubeconfig(role)
        return self

    def _kubeconfig(self, role: str) -> Path:
        token = self.kube.create(
            f"/api/v1/namespaces/{OPERATOR_NS}/serviceaccounts/dscache-{role}/token",
            {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {"expirationSeconds": 86400}},
        )["status"]["token"]
        path = self.workdir / f"kubeconfig-{role}"
        path.write_text(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "current-context": role,
                    "clusters": [
                        {
                            "name": "test",
                            "cluster": {
                                "server": self.kube.server,
                                "certificate-authority": str(self.kube.certs / "ca.crt"),
                            },
                        }
                    ],
                    "users": [{"name": role, "user": {"token": token}}],
                    "contexts": [{"name": role, "context": {"cluster": "test", "user": role}}],
                }
            )
        )
        return path

    def env(self, role: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "KUBECONFIG", "DSCACHE_"))}
        env.update(
            {
                "KUBECONFIG": str(self.workdir / f"kubeconfig-{role}"),
                "AWS_EC2_METADATA_DISABLED": "true",
                "DSCACHE_NAMESPACE": OPERATOR_NS,
                "DSCACHE_CACHE_ROOT": "/var/lib/dscache-test",
                "DSCACHE_STAGER_IMAGE": "dscache-stager:test",
                "DSCACHE_RECONCILE_INTERVAL": "1",
                "DSCACHE_SOURCE_RETRY_INTERVAL": "3",
                "DSCACHE_HEALTH_PORT": str(self.health_ports.get(role, 0)),
                "DSCACHE_METRICS_PORT": str(self.metrics_ports.get(role, 0)),
                "DSCACHE_WEBHOOK_ADDR": "127.0.0.1",
                "DSCACHE_WEBHOOK_PORT": str(self.webhook_port),
                "DSCACHE_WEBHOOK_CERT": str(self.kube.certs / "webhook.crt"),
                "DSCACHE_WEBHOOK_KEY": str(self.kube.certs / "webhook.key"),
                "PYTHONUNBUFFERED": "1",
            }
        )
        env.update(self.extra_env)
        return env

    def start(self, role: str) -> subprocess.Popen:
        import sys

        log = open(self.workdir / f"{role}.log", "ab")  # noqa: SIM115 (the process keeps it open)
        proc = subprocess.Popen(
            [sys.executable, "-m", "dscache_operator", role],
            env=self.env(role),
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
        )
        self.procs[role] = proc
        if role == "webhook":
            wait_port("127.0.0.1", self.webhook_port)
        return proc

    def stop(self, role: str, kill: bool = False) -> None:
        proc = self.procs.pop(role, None)
        if proc is None or proc.poll() is not None:
            return
        if kill:
            proc.kill()
        else:
            proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def alive(self, role: str) -> bool:
        proc = self.procs.get(role)
        return proc is not None and proc.poll() is None

    def metrics(self, role: str) -> str:
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_ports[role]}/metrics", timeout=5) as r:
            return r.read().decode()

    def healthz(self, role: str) -> int:
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{self.health_ports[role]}/healthz", timeout=5) as r:
            return r.status

    def log(self, role: str) -> str:
        return (self.workdir / f"{role}.log").read_text(errors="replace")
