"""The Helm chart against a real kube-apiserver + etcd (no kubelet).

- `helm install` is accepted by a real API server (schemas, the webhook's CEL
  matchConditions, RBAC objects), and the generated certificate survives
  `helm upgrade` byte for byte, with a caBundle that keeps matching it.
- Near expiry, an upgrade renews it and trusts the old and new CA meanwhile.
- The operator runs with the chart's own ServiceAccounts, RBAC (here the
  namespace-scoped mode) and environment: the controller reconciles a
  DatasetCache with a Secret, and the webhook serves the chart's certificate
  and admits an annotated pod, verified against the chart's caBundle.
- The pre-delete hook's objects are accepted by the API server, and its Job's
  command, run as its ServiceAccount with its RBAC while the controller runs,
  deletes the DatasetCaches and waits for the controller to release them (and
  fails, naming it, when one cannot go). There is no kubelet here to run the
  Job itself, so `helm uninstall` runs with --no-hooks; e2e/test_99_uninstall.py
  runs the real hook on kind.

Its own API server (not the session's `kube_api`), so that the chart's
cluster-scoped objects never meet those of operator/deploy/ used elsewhere.
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import re
import socket
import ssl
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.kubeapi import KubeAPI, wait_port
from tests.support.s3server import ACCESS_KEY, SECRET_KEY, free_port
from tests.support.tools import tool_bin

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "dscache"
NS = "dscache-system"
SECRET = f"/api/v1/namespaces/{NS}/secrets/dscache-webhook-tls"
AGENT_TLS = f"/api/v1/namespaces/{NS}/secrets/dscache-agent-tls"
MWC = "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations/dscache"


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory):
    # An API server of its own, not the session's kube_api: there the operator
    # fixture has already installed the CRD and RBAC, which helm would refuse to adopt.
    k = KubeAPI(workdir=tmp_path_factory.mktemp("chart-kubeapi")).start()
    yield k
    k.stop()


@pytest.fixture(scope="module")
def helm(api: KubeAPI, tmp_path_factory: pytest.TempPathFactory):
    home = tmp_path_factory.mktemp("helm-home")
    env = {
        **os.environ,
        "KUBECONFIG": str(api.kubeconfig),
        "HELM_CACHE_HOME": str(home / "cache"),
        "HELM_CONFIG_HOME": str(home / "config"),
        "HELM_DATA_HOME": str(home / "data"),
    }
    binary = str(tool_bin("helm") / "helm")

    def run(*args: str) -> str:
        proc = subprocess.run([binary, *args], env=env, capture_output=True, text=True)
        assert proc.returncode == 0, f"helm {' '.join(args)}:\n{proc.stderr}"
        return proc.stdout

    return run


def tls_state(api: KubeAPI) -> tuple[dict[str, bytes], list[bytes]]:
    """The Secret's PEMs, and the caBundle of every webhook entry."""
    secret = api.get(SECRET)
    data = {k: base64.b64decode(v) for k, v in secret["data"].items()}
    bundles = [base64.b64decode(h["clientConfig"]["caBundle"]) for h in api.get(MWC)["webhooks"]]
    return data, bundles


def pems(bundle: bytes) -> list[bytes]:
    end = b"-----END CERTIFICATE-----"
    return [p.strip() + b"\n" + end + b"\n" for p in bundle.split(end) if p.strip()]


def verify(tmp: Path, ca_bundle: bytes, cert: bytes) -> None:
    (tmp / "bundle.pem").write_bytes(ca_bundle)
    (tmp / "cert.pem").write_bytes(cert)
    subprocess.run(
        ["openssl", "verify", "-CAfile", str(tmp / "bundle.pem"), str(tmp / "cert.pem")],
        check=True,
        capture_output=True,
    )


def test_install_and_certificates_survive_upgrade(api: KubeAPI, helm, tmp_path: Path):
    # The server validates every object (dry run), then the real install.
    helm(
        "install",
        "dscache",
        str(CHART),
        "-n",
        NS,
        "--create-namespace",
        "--set",
        "cacheRoot=/mnt/nvme/dscache",
        "--dry-run=server",
    )
    helm("install", "dscache", str(CHART), "-n", NS, "--create-namespace", "--set", "cacheRoot=/mnt/nvme/dscache")
    data, bundles = tls_state(api)
    # Four entries inject pods ({jobs, pods} x {CSI volume, emptyDir}); the fifth gives new
    # DatasetCaches their finalizer.
    assert len(bundles) == 5 and all(b == data["ca.crt"] for b in bundles)
    verify(tmp_path, data["ca.crt"], data["tls.crt"])
    assert api.get("/apis/apiextensions.k8s.io/v1/customresourcedefinitions/datasetcaches.dscache.io")
    # No shared agent token any more (issue 29); the agents' serving certificate, signed by its CA.
    assert api.get(f"/api/v1/namespaces/{NS}/secrets/dscache-agent-token") is None
    agents = api.get(AGENT_TLS)["data"]
    verify(tmp_path, base64.b64decode(agents["ca.crt"]), base64.b64decode(agents["tls.crt"]))

    # Upgrades (changed values, and --reuse-values) keep the certificates as they are.
    helm("upgrade", "dscache", str(CHART), "-n", NS, "--reuse-values", "--set", "webhook.timeoutSeconds=7")
    helm("upgrade", "dscache", str(CHART), "-n", NS, "--set", "cacheRoot=/mnt/nvme/dscache")
    data2, bundles2 = tls_state(api)
    assert data2 == data
    assert bundles2 == bundles
    assert api.get(AGENT_TLS)["data"] == agents
    assert api.get(MWC)["webhooks"][0]["timeoutSeconds"] == 5  # the last upgrade reset it

    # Near expiry: renewed, and the bundle trusts old and new CA until the next upgrade.
    soon = str(int(time.time()) + 86400)
    api.merge_patch(SECRET, {"metadata": {"annotations": {"dscache.io/tls-not-after": soon}}})
    helm("upgrade", "dscache", str(CHART), "-n", NS, "--reuse-values")
    data3, bundles3 = tls_state(api)
    assert data3["tls.crt"] != data["tls.crt"] and data3["ca.crt"] != data["ca.crt"]
    assert all(pems(b) == pems(data3["ca.crt"]) + pems(data["ca.crt"]) for b in bundles3)
    verify(tmp_path, bundles3[0], data3["tls.crt"])  # pods that already reloaded
    verify(tmp_path, bundles3[0], data["tls.crt"])  # pods still serving the old one
    helm("upgrade", "dscache", str(CHART), "-n", NS, "--reuse-values")
    data4, bundles4 = tls_state(api)
    assert data4 == data3 and all(b == data3["ca.crt"] for b in bundles4)
    assert api.get(AGENT_TLS)["data"] == agents
    # Renewing the agents' certificate: delete the Secret, upgrade (then restart the agents).
    api.delete(AGENT_TLS)
    helm("upgrade", "dscache", str(CHART), "-n", NS, "--reuse-values")
    assert api.get(AGENT_TLS)["data"]["tls.crt"] != agents["tls.crt"]

    # Uninstall: the CRD stays (deleting it would delete every DatasetCache). No kubelet
    # here to run the pre-delete hook's Job: test_operator_runs_with_the_charts_rbac runs its command.
    helm("uninstall", "dscache", "-n", NS, "--no-hooks")
    assert api.get("/apis/apiextensions.k8s.io/v1/customresourcedefinitions/datasetcaches.dscache.io")
    assert api.get(MWC) is None


# --- the operator with the chart's identities -------------------------------------------------


def sa_kubeconfig(api: KubeAPI, sa: str, path: Path) -> Path:
    token = api.create(
        f"/api/v1/namespaces/{NS}/serviceaccounts/{sa}/token",
        {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {"expirationSeconds": 3600}},
    )["status"]["token"]
    path.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": sa,
                "clusters": [
                    {"name": "c", "cluster": {"server": api.server, "certificate-authority": str(api.certs / "ca.crt")}}
                ],
                "users": [{"name": sa, "user": {"token": token}}],
                "contexts": [{"name": sa, "context": {"cluster": "c", "user": sa}}],
            }
        )
    )
    return path


def chart_env(api: KubeAPI, name: str) -> dict[str, str]:
    """The environment the chart gives a Deployment's container (fieldRefs resolved)."""
    deploy = api.get(f"/apis/apps/v1/namespaces/{NS}/deployments/{name}")
    (c,) = deploy["spec"]["template"]["spec"]["containers"]
    env = {}
    for e in c["env"]:
        if "value" in e:
            env[e["name"]] = e["value"]
        elif e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "metadata.namespace":
            env[e["name"]] = NS
    return env


def start(role: str, env: dict[str, str], log: Path) -> subprocess.Popen:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "KUBECONFIG", "DSCACHE_"))}
    return subprocess.Popen(
        [sys.executable, "-m", "dscache_operator", role],
        env={**base, **env, "AWS_EC2_METADATA_DISABLED": "true"},
        cwd=REPO,
        stdout=open(log, "wb"),
        stderr=subprocess.STDOUT,
    )


def review(port: int, path: str, ca: bytes, host: str, obj: dict[str, Any], ns: str) -> dict[str, Any]:
    """POST an AdmissionReview the way the API server does, trusting only the chart's caBundle
    and checking the certificate against the Service's DNS name."""
    ctx = ssl.create_default_context(cadata=ca.decode())
    body = json.dumps(
        {
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": str(uuid.uuid4()),
                "kind": {"group": "", "version": "v1", "kind": "Pod"},
                "resource": {"group": "", "version": "v1", "resource": "pods"},
                "requestKind": {"group": "", "version": "v1", "kind": "Pod"},
                "requestResource": {"group": "", "version": "v1", "resource": "pods"},
                "namespace": ns,
                "operation": "CREATE",
                "userInfo": {"username": "test"},
                "object": obj,
                "oldObject": None,
                "dryRun": False,
                "options": None,
            },
        }
    )
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    conn = http.client.HTTPSConnection(host, port, context=ctx, timeout=10)
    conn.sock = ctx.wrap_socket(sock, server_hostname=host)
    conn.request("POST", path, body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    return json.loads(resp.read())["response"]


def test_operator_runs_with_the_charts_rbac(api: KubeAPI, helm, s3_server, bucket, tmp_path: Path):
    s3_server.put_tree(bucket, {"data/a.bin": b"a" * 10, "data/b.bin": b"b" * 20})
    api.namespace("ml-team", {"dscache.io/injection": "enabled"})
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump({"watchNamespaces": ["ml-team"], "rbac": {"scopeToWatchNamespaces": True}}))
    helm("upgrade", "--install", "dscache", str(CHART), "-n", NS, "--create-namespace", "-f", str(values))
    # No cluster-wide grant except the read-only discovery (CRDs, namespaces, nodes) and the
    # node agents' own (each patches its Node and watches its node's pods in every namespace).
    crbs = api.get("/apis/rbac.authorization.k8s.io/v1/clusterrolebindings")["items"]
    assert sorted(
        b["metadata"]["name"]
        for b in crbs
        if b["metadata"].get("labels", {}).get("app.kubernetes.io/instance") == "dscache"
    ) == ["dscache-discovery", "dscache-node"]

    # The API server's RBAC authorizer sees new bindings through its own informer, a
    # moment after they are created: wait until it grants them, so a 403 in the logs
    # below means a missing rule, not a binding still in flight.
    def granted() -> bool:
        user = f"system:serviceaccount:{NS}:dscache-controller"
        checks = [
            {"verb": "list", "group": "jobset.x-k8s.io", "resource": "jobsets", "namespace": "ml-team"},
            # Pre-stage pods, in the watched namespace (no more wipe helpers in its own).
            {"verb": "create", "resource": "pods", "namespace": "ml-team"},
            # Its node view: cluster-scoped, granted by the discovery ClusterRole in scoped mode.
            {"verb": "watch", "resource": "nodes"},
            {"verb": "get", "resource": "secrets", "namespace": "ml-team"},
        ]
        return all(
            api.create(
                "/apis/authorization.k8s.io/v1/subjectaccessreviews",
                {
                    "apiVersion": "authorization.k8s.io/v1",
                    "kind": "SubjectAccessReview",
                    "spec": {"user": user, "groups": ["system:serviceaccounts"], "resourceAttributes": c},
                },
            )["status"].get("allowed")
            for c in checks
        )

    api.wait_for(granted, 30, what="the chart's RBAC in effect")

    procs: list[subprocess.Popen] = []
    try:
        env = chart_env(api, "dscache-controller")
        health = free_port()
        env.update(
            KUBECONFIG=str(sa_kubeconfig(api, "dscache-controller", tmp_path / "kc-controller")),
            DSCACHE_HEALTH_PORT=str(health),
            DSCACHE_METRICS_PORT="0",
            DSCACHE_RECONCILE_INTERVAL="1",
        )
        procs.append(start("controller", env, tmp_path / "controller.log"))

        # Source check with the chart's per-namespace Secret RoleBinding.
        api.create(
            "/api/v1/namespaces/ml-team/secrets",
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": {"name": "s3-keys"},
                "stringData": {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY},
            },
        )
        api.create(
            "/apis/dscache.io/v1alpha1/namespaces/ml-team/datasetcaches",
            {
                "apiVersion": "dscache.io/v1alpha1",
                "kind": "DatasetCache",
                "metadata": {"name": "ds"},
                "spec": {
                    "mountPath": "/data",
                    "source": {
                        "uri": f"s3://{bucket}/data/",
                        "endpoint": s3_server.endpoint,
                        "region": "us-east-1",
                        "addressingStyle": "path",
                        "credentials": {"secretRef": {"name": "s3-keys"}},
                    },
                },
            },
        )

        def ready():
            c = api.get("/apis/dscache.io/v1alpha1/namespaces/ml-team/datasetcaches/ds")
            return c if (c.get("status") or {}).get("phase") == "Ready" else None

        try:
            cache = api.wait_for(ready, 60, what="DatasetCache ml-team/ds Ready")
        except Exception as e:
            raise AssertionError((tmp_path / "controller.log").read_text()[-4000:]) from e
        assert cache["status"]["objects"] == 2

        # The webhook with the chart's certificate files, env and ServiceAccount.
        data, bundles = tls_state(api)
        (tmp_path / "tls.crt").write_bytes(data["tls.crt"])
        (tmp_path / "tls.key").write_bytes(data["tls.key"])
        env = chart_env(api, "dscache-webhook")
        port = free_port()
        env.update(
            KUBECONFIG=str(sa_kubeconfig(api, "dscache-webhook", tmp_path / "kc-webhook")),
            DSCACHE_HEALTH_PORT=str(free_port()),
            DSCACHE_METRICS_PORT="0",
            DSCACHE_WEBHOOK_ADDR="127.0.0.1",
            DSCACHE_WEBHOOK_PORT=str(port),
            DSCACHE_WEBHOOK_CERT=str(tmp_path / "tls.crt"),
            DSCACHE_WEBHOOK_KEY=str(tmp_path / "tls.key"),
        )
        procs.append(start("webhook", env, tmp_path / "webhook.log"))
        wait_port("127.0.0.1", port)
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "train", "namespace": "ml-team", "annotations": {"dscache.io/cache": "ds"}},
            "spec": {"containers": [{"name": "train", "image": "trainer:1"}]},
        }
        resp = review(port, "/dscache-hostpath", bundles[0], f"dscache-webhook.{NS}.svc", pod, "ml-team")
        assert resp["allowed"] is True, resp
        patch = json.loads(base64.b64decode(resp["patch"]))
        assert "dscache-stage" in json.dumps(patch)
        assert "/mnt/nvme" not in json.dumps(patch) and "/var/lib/dscache/ml-team/ds" in json.dumps(patch)
        run_uninstall_hook(api, helm, tmp_path)
        for role in ("controller", "webhook"):
            log = (tmp_path / f"{role}.log").read_text()
            # Timestamps carry milliseconds (",403"): drop them, then look for a status 403.
            assert not re.search(r"\b403\b|Forbidden", re.sub(r"\d{2}:\d{2}:\d{2},\d{3}", "", log)), log[-4000:]
    finally:
        for p in procs:
            p.terminate()
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
        helm("uninstall", "dscache", "-n", NS, "--no-hooks")


def run_uninstall_hook(api: KubeAPI, helm, tmp_path: Path) -> None:
    """The release's pre-delete hook as the API server and the running controller see it:
    its ServiceAccount and (namespaced) RBAC created as Helm would, its Job accepted (server
    dry run), then the Job's own command and env run here as that ServiceAccount."""
    from tests.support.kubeapi import rest_path

    hooks = [d for d in yaml.safe_load_all(helm("get", "hooks", "dscache", "-n", NS)) if d]
    assert sorted(d["kind"] for d in hooks) == ["ClusterRole", "Job", "RoleBinding", "ServiceAccount"]
    (job,) = [d for d in hooks if d["kind"] == "Job"]
    api.apply_yaml_docs([d for d in hooks if d["kind"] != "Job"])
    api.request("POST", rest_path(job, collection=True), job, params={"dryRun": "All"})
    caches = "/apis/dscache.io/v1alpha1/namespaces/ml-team/datasetcaches"
    # A cache someone else holds (a foreign finalizer): the hook must wait for it, then give up naming it.
    api.create(
        caches,
        {
            "apiVersion": "dscache.io/v1alpha1",
            "kind": "DatasetCache",
            "metadata": {"name": "held", "finalizers": ["example.com/hold"]},
            # A port nothing listens on: its source check fails at once, which is all it needs.
            "spec": {
                "mountPath": "/data",
                "source": {"uri": "s3://held/data/", "endpoint": "http://127.0.0.1:9", "addressingStyle": "path"},
            },
        },
    )

    def granted() -> bool:
        review = {
            "apiVersion": "authorization.k8s.io/v1",
            "kind": "SubjectAccessReview",
            "spec": {
                "user": f"system:serviceaccount:{NS}:dscache-uninstall",
                "groups": ["system:serviceaccounts"],
                "resourceAttributes": {
                    "verb": "delete",
                    "group": "dscache.io",
                    "resource": "datasetcaches",
                    "namespace": "ml-team",
                },
            },
        }
        return bool(api.create("/apis/authorization.k8s.io/v1/subjectaccessreviews", review)["status"].get("allowed"))

    api.wait_for(granted, 30, what="the hook's RBAC in effect")
    (c,) = job["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env == {"DSCACHE_WATCH_NAMESPACES": "ml-team"}
    base = {k: v for k, v in os.environ.items() if not k.startswith(("KUBECONFIG", "DSCACHE_"))}
    env.update(KUBECONFIG=str(sa_kubeconfig(api, "dscache-uninstall", tmp_path / "kc-uninstall")))

    def hook(timeout: str) -> subprocess.CompletedProcess:
        args = [*c["args"][:-1], timeout, "--interval", "0.5"]  # the Job's arguments, a shorter wait
        assert c["command"] == ["python", "-m", "dscache_operator"] and c["args"][:2] == ["uninstall", "--timeout"]
        return subprocess.run(
            [sys.executable, "-m", "dscache_operator", *args],
            env={**base, **env},
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )

    held = hook("10")
    assert held.returncode == 1, held.stdout + held.stderr
    # ds went (the controller, with the chart's RBAC, wiped and released it); held is named with why.
    assert api.get(f"{caches}/ds") is None, held.stderr
    assert "ml-team/held (other finalizers example.com/hold)" in held.stderr, held.stderr
    assert "deleting 2 DatasetCache(s) in ml-team" in held.stderr, held.stderr
    api.merge_patch(f"{caches}/held", {"metadata": {"finalizers": None}})
    done = hook("60")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "done in" in done.stderr and api.request("GET", caches)["items"] == [], done.stderr
