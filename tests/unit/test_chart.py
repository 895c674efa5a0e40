"""The Helm chart (charts/dscache): `helm lint`, golden `helm template` output,
and targeted checks that the chart templates exactly what the operator's plain
manifests (operator/deploy/*.yaml) and settings (DSCACHE_* variables) say.

Goldens live in tests/golden/chart/<value set>.yaml, with the generated
certificates replaced by placeholders. Regenerate them after a deliberate
chart change with:

    UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/unit/test_chart.py

(the same run also re-copies crds/datasetcache.yaml into the chart). That run
FAILS for every golden it had to rewrite: a regeneration is never a pass. Review
`git diff tests/golden`, then run again without UPDATE_GOLDEN.
No cluster is needed: `helm template` runs offline.
"""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml

from dscache_contract.peers import AGENT_TLS_NAME
from tests.support.tools import tool_bin

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "dscache"
GOLDEN = REPO / "tests" / "golden" / "chart"
DEPLOY = REPO / "operator" / "deploy"
UPDATE = os.environ.get("UPDATE_GOLDEN") == "1"
# The Kubernetes version the e2e cluster runs; `helm template` needs it because
# Chart.yaml's kubeVersion is checked against it.
KUBE_VERSION = "1.34.4"
NS = "dscache-system"

# Value sets rendered to goldens: name -> (namespace, values, extra helm args).
VALUE_SETS: dict[str, tuple[str, dict[str, Any], list[str]]] = {
    # The install command of the product brief, as is (no -n: namespace "default").
    "product-command": ("default", {"cacheRoot": "/mnt/nvme/dscache"}, []),
    "defaults": (NS, {}, []),
    "watch-namespaces": (
        NS,
        {
            "watchNamespaces": ["ml-team", "research"],
            "sourceCheck": {"secretNamespaces": ["shared-data"]},
            "rbac": {"scopeToWatchNamespaces": True},
            "stager": {
                "image": {"repository": "registry.example/dscache-stager", "tag": "1.2.3", "pullPolicy": "Always"},
                "concurrency": 64,
                "resources": {"requests": {"cpu": "2", "memory": "1Gi"}, "limits": {"memory": "4Gi"}},
            },
            "nodeAgent": {
                "port": 19477,
                "budget": "500Gi",
                "headroom": "20%",
                "maxLabels": 8,
                "nodeSelector": {"dscache.io/cache-node": "true"},
                "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                "priorityClassName": "",
            },
            "placement": {"weight": 50},
            "metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "prom"}}},
            "controller": {
                "serviceAccount": {
                    "annotations": {"eks.amazonaws.com/role-arn": "arn:aws:iam::123456789012:role/dscache"}
                }
            },
            "webhook": {"replicas": 3, "timeoutSeconds": 10},
            "imagePullSecrets": [{"name": "regcred"}],
        },
        ["--api-versions", "monitoring.coreos.com/v1/ServiceMonitor"],
    ),
    "cert-manager": (NS, {"certManager": {"enabled": True}}, ["--api-versions", "cert-manager.io/v1"]),
    # The cache dir as a hostPath (the product before the CSI driver): restricted namespaces get emptyDir.
    "host-path": (NS, {"volume": {"type": "hostPath"}}, []),
    # Secret reading narrowed to two namespaces, and turned off.
    "secret-namespaces": (NS, {"sourceCheck": {"secretNamespaces": ["ml", "shared-data"]}}, []),
    "no-secrets": (NS, {"sourceCheck": {"readSecrets": False}}, []),
    "minimal": (
        "ops",
        {
            "fullnameOverride": "dsc",
            "crds": {"install": False},
            "metrics": {"enabled": False},
            "webhook": {"podDisruptionBudget": {"enabled": False}},
            "nodeAgent": {"enabled": False},
            "certManager": {
                "enabled": True,
                "issuerRef": {"name": "corp-ca", "kind": "ClusterIssuer", "group": "cert-manager.io"},
            },
        },
        ["--api-versions", "cert-manager.io/v1"],
    ),
}


@pytest.fixture(scope="module")
def helm() -> str:
    return str(tool_bin("helm") / "helm")


def run_helm(helm: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [helm, *args],
        capture_output=True,
        text=True,
        env={
            **os.environ,
            "HELM_CACHE_HOME": tempfile.gettempdir() + "/dscache-helm-cache",
            "HELM_CONFIG_HOME": tempfile.gettempdir() + "/dscache-helm-config",
        },
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}")
    return proc


def template(
    helm: str,
    namespace: str = NS,
    values: dict[str, Any] | None = None,
    extra: list[str] | None = None,
    check: bool = True,
    kube_version: str = KUBE_VERSION,
) -> subprocess.CompletedProcess:
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
        yaml.safe_dump(values or {}, f)
        f.flush()
        return run_helm(
            helm,
            "template",
            "dscache",
            str(CHART),
            "--namespace",
            namespace,
            "--kube-version",
            kube_version,
            "-f",
            f.name,
            *(extra or []),
            check=check,
        )


def docs_of(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if d]


def find(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]


def one(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = find(docs, kind, name)
    assert len(found) == 1, f"expected one {kind} {name or ''}, got {len(found)}"
    return found[0]


def normalise(text: str) -> str:
    """Replace what is random in every render (generated keys and certificates)."""
    text = re.sub(r"(caBundle|ca\.crt|tls\.crt|tls\.key): \S+", r"\1: <GENERATED>", text)
    text = re.sub(r"(?m)^  token: \S+$", "  token: <GENERATED>", text)
    return re.sub(r'(dscache\.io/tls-not-after): "\d+"', r'\1: "<GENERATED>"', text)


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def refresh(path: Path, content: str) -> None:
    """UPDATE_GOLDEN=1: rewrite ``path`` if it is stale, and fail the test that did it.

    Writing the expected output from the actual one and then comparing them
    would pass by construction; a rewritten golden is reported as a failure so
    the run that produced it is never green. The next run (without the
    variable) compares against the reviewed file as usual."""
    if not UPDATE:
        return
    old = path.read_text() if path.exists() else None
    if old == content:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(content)
    pytest.fail(
        f"UPDATE_GOLDEN: {path.relative_to(REPO)} was {'stale' if old is not None else 'missing'} "
        "and has been rewritten; review `git diff` and run again without UPDATE_GOLDEN"
    )


@pytest.fixture(scope="module")
def default_docs(helm: str) -> list[dict[str, Any]]:
    return docs_of(template(helm).stdout)


# --- lint and goldens -----------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_lint_strict(helm: str, name: str, tmp_path: Path):
    namespace, values, _ = VALUE_SETS[name]
    vf = tmp_path / "values.yaml"
    vf.write_text(yaml.safe_dump(values))
    for strict in ([], ["--strict"]):
        out = run_helm(
            helm, "lint", str(CHART), "--namespace", namespace, "--kube-version", KUBE_VERSION, "-f", str(vf), *strict
        )
        assert "0 chart(s) failed" in out.stdout, out.stdout
        assert "[WARNING]" not in out.stdout and "[ERROR]" not in out.stdout, out.stdout


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_template_matches_golden(helm: str, name: str):
    namespace, values, extra = VALUE_SETS[name]
    rendered = normalise(template(helm, namespace, values, extra).stdout)
    golden = GOLDEN / f"{name}.yaml"
    refresh(golden, rendered)
    assert golden.exists(), f"{golden} is missing; create it with UPDATE_GOLDEN=1"
    assert rendered == golden.read_text(), (
        f"`helm template` output for value set {name!r} differs from {golden.relative_to(REPO)}; "
        "if the change is intended, regenerate with UPDATE_GOLDEN=1 and review the diff"
    )


def test_chart_crd_is_the_generated_one():
    """The chart renders files/datasetcache.yaml; it must be crds/datasetcache.yaml."""
    source, copy = REPO / "crds" / "datasetcache.yaml", CHART / "files" / "datasetcache.yaml"
    refresh(copy, source.read_text())
    assert copy.read_text() == source.read_text(), (
        "charts/dscache/files/datasetcache.yaml differs from crds/datasetcache.yaml; "
        "run `cp crds/datasetcache.yaml charts/dscache/files/` (or UPDATE_GOLDEN=1)"
    )


# --- the admission webhook ------------------------------------------------------------------


def test_webhook_entries_are_operator_deploy_webhook_yaml(default_docs):
    """Same entries, in the same order, as operator/deploy/webhook.yaml; only the
    Service's name/namespace and the caBundle are the chart's."""
    (expected,) = docs_of((DEPLOY / "webhook.yaml").read_text())
    rendered = one(default_docs, "MutatingWebhookConfiguration", "dscache")
    assert [h["name"] for h in rendered["webhooks"]] == [h["name"] for h in expected["webhooks"]]

    def canon(hook: dict[str, Any]) -> dict[str, Any]:
        hook = json.loads(json.dumps(hook))
        hook["clientConfig"].pop("caBundle", None)
        for cond in hook.get("matchConditions", []):
            cond["expression"] = " ".join(cond["expression"].split())
        return hook

    for got, want in zip(rendered["webhooks"], expected["webhooks"], strict=True):
        assert canon(got) == canon(want), got["name"]


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_webhook_safety_settings(helm: str, name: str):
    namespace, values, extra = VALUE_SETS[name]
    docs = docs_of(template(helm, namespace, values, extra).stdout)
    (mwc,) = find(docs, "MutatingWebhookConfiguration")
    (svc,) = [s for s in find(docs, "Service") if s["spec"]["ports"][0]["port"] == 443]
    *injection, caches = mwc["webhooks"]
    # {jobs, pods} x {csi, emptyDir}; hostPath: x {hostPath, emptyDir, emptyDir for Pod Security}.
    assert len(injection) == (6 if values.get("volume", {}).get("type") == "hostPath" else 4)
    # New DatasetCaches: their finalizer, never a refusal (the controller adds it if this is down).
    assert (
        caches["name"] == "datasetcaches.dscache.io" and caches["clientConfig"]["service"]["path"] == "/dscache-caches"
    )
    assert caches["rules"] == [
        {
            "operations": ["CREATE"],
            "apiGroups": ["dscache.io"],
            "apiVersions": ["v1alpha1"],
            "resources": ["datasetcaches"],
            "scope": "Namespaced",
        }
    ]
    assert (caches["failurePolicy"], caches["sideEffects"]) == ("Ignore", "None")
    for hook in injection:
        exprs = hook["namespaceSelector"]["matchExpressions"]
        assert {"key": "dscache.io/injection", "operator": "In", "values": ["enabled"]} in exprs
        assert hook["failurePolicy"] == "Fail"
        assert hook["sideEffects"] == "None"
        assert 1 <= hook["timeoutSeconds"] <= 10
        assert hook["reinvocationPolicy"] == "IfNeeded"
        assert hook["rules"][0]["operations"] == ["CREATE"]
        assert "dscache.io/cache" in hook["matchConditions"][0]["expression"]
        ref = hook["clientConfig"]["service"]
        assert (ref["name"], ref["namespace"], ref["port"]) == (svc["metadata"]["name"], namespace, 443)
        assert ref["path"] in ("/dscache-csi", "/dscache-hostpath", "/dscache-emptydir")


def test_generated_certificate_is_consistent(default_docs, tmp_path: Path):
    """caBundle == the Secret's ca.crt, which signed tls.crt, valid for the Service's DNS names."""
    secret = one(default_docs, "Secret", "dscache-webhook-tls")
    assert secret["type"] == "kubernetes.io/tls"
    data = {k: base64.b64decode(v) for k, v in secret["data"].items()}
    mwc = one(default_docs, "MutatingWebhookConfiguration")
    bundles = {h["clientConfig"]["caBundle"] for h in mwc["webhooks"]}
    assert len(bundles) == 1
    assert base64.b64decode(bundles.pop()) == data["ca.crt"]
    for key, blob in data.items():
        (tmp_path / key).write_bytes(blob)
    subprocess.run(
        ["openssl", "verify", "-CAfile", str(tmp_path / "ca.crt"), str(tmp_path / "tls.crt")],
        check=True,
        capture_output=True,
    )
    text = subprocess.run(
        ["openssl", "x509", "-in", str(tmp_path / "tls.crt"), "-noout", "-text"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    for dns in ("dscache-webhook.dscache-system.svc", "dscache-webhook.dscache-system.svc.cluster.local"):
        assert f"DNS:{dns}" in text
    # The key matches the certificate.
    pub = [
        subprocess.run(["openssl", *args], check=True, capture_output=True).stdout
        for args in (
            ["x509", "-in", str(tmp_path / "tls.crt"), "-noout", "-pubkey"],
            ["pkey", "-in", str(tmp_path / "tls.key"), "-pubout"],
        )
    ]
    assert pub[0] == pub[1]
    # The webhook pods mount this Secret and point the process at it.
    deploy = one(default_docs, "Deployment", "dscache-webhook")
    (vol,) = [v for v in deploy["spec"]["template"]["spec"]["volumes"] if v["name"] == "tls"]
    assert vol["secret"]["secretName"] == "dscache-webhook-tls"
    env = env_of(deploy["spec"]["template"]["spec"]["containers"][0])
    assert env["DSCACHE_WEBHOOK_CERT"].endswith("/tls.crt") and env["DSCACHE_WEBHOOK_KEY"].endswith("/tls.key")


def test_cert_manager_mode(helm: str):
    namespace, values, extra = VALUE_SETS["cert-manager"]
    docs = docs_of(template(helm, namespace, values, extra).stdout)
    assert not find(docs, "Secret", "dscache-webhook-tls"), "cert-manager writes the serving Secret, not the chart"
    assert not find(docs, "Secret"), "cert-manager writes the agents' Secret too"
    agents = one(docs, "Certificate", "dscache-agent-tls")["spec"]
    assert (agents["secretName"], agents["dnsNames"]) == ("dscache-agent-tls", [AGENT_TLS_NAME])
    assert agents["issuerRef"]["name"] == "dscache-ca"
    mwc = one(docs, "MutatingWebhookConfiguration")
    assert mwc["metadata"]["annotations"]["cert-manager.io/inject-ca-from"] == f"{NS}/dscache-webhook"
    assert all("caBundle" not in h["clientConfig"] for h in mwc["webhooks"]), (
        "an empty caBundle in the template would erase the injected one on every upgrade"
    )
    cert = one(docs, "Certificate", "dscache-webhook")
    assert cert["spec"]["secretName"] == "dscache-webhook-tls"
    assert "dscache-webhook.dscache-system.svc" in cert["spec"]["dnsNames"]
    assert cert["spec"]["issuerRef"]["name"] == "dscache-ca"
    ca = one(docs, "Certificate", "dscache-webhook-ca")
    assert ca["spec"]["isCA"] is True
    assert one(docs, "Issuer", "dscache-ca")["spec"]["ca"]["secretName"] == ca["spec"]["secretName"]
    # An existing issuer: no chart PKI.
    namespace, values, extra = VALUE_SETS["minimal"]
    docs = docs_of(template(helm, namespace, values, extra).stdout)
    assert not find(docs, "Issuer")
    for name in ("dsc-webhook", "dsc-agent-tls"):
        assert one(docs, "Certificate", name)["spec"]["issuerRef"]["kind"] == "ClusterIssuer"
    # Without cert-manager in the cluster: a clear refusal.
    proc = template(helm, NS, {"certManager": {"enabled": True}}, check=False)
    assert proc.returncode != 0 and "does not serve cert-manager.io/v1" in proc.stderr


# --- workloads ------------------------------------------------------------------------------


def test_controller_deployment(default_docs):
    deploy = one(default_docs, "Deployment", "dscache-controller")
    spec = deploy["spec"]
    # Issue 29: two replicas, one leading by Lease; overlap in a rollout is safe.
    assert spec["replicas"] == 2
    assert spec["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}}
    pod = spec["template"]["spec"]
    (term,) = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    assert term["podAffinityTerm"]["labelSelector"]["matchLabels"] == spec["selector"]["matchLabels"]
    pdb = one(default_docs, "PodDisruptionBudget", "dscache-controller")
    assert pdb["spec"]["maxUnavailable"] == 1 and pdb["spec"]["selector"] == spec["selector"]
    env = env_of(pod["containers"][0])
    assert env["DSCACHE_POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert env["DSCACHE_IMAGE_PULL_SECRETS"] == ""
    # The Lease it elects on is the one its Role lets it get and update, in the release namespace only.
    role = one(default_docs, "Role", "dscache-controller-leader-election")
    assert role["metadata"]["namespace"] == NS
    assert [(r["verbs"], r.get("resourceNames")) for r in role["rules"]] == [
        (["create"], None),
        (["get", "update"], [env["DSCACHE_LEASE_NAME"]]),
    ]
    assert all(r["apiGroups"] == ["coordination.k8s.io"] and r["resources"] == ["leases"] for r in role["rules"])
    binding = one(default_docs, "RoleBinding", "dscache-controller-leader-election")
    assert binding["metadata"]["namespace"] == NS
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "dscache-controller", "namespace": NS}]
    assert pod["serviceAccountName"] == "dscache-controller"
    (c,) = pod["containers"]
    assert c["command"] + c["args"] == ["python", "-m", "dscache_operator", "controller"]
    env = env_of(c)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["health"] == int(env["DSCACHE_HEALTH_PORT"]) == 8080
    assert ports["metrics"] == int(env["DSCACHE_METRICS_PORT"]) == 9090
    for probe in ("livenessProbe", "readinessProbe"):
        assert c[probe]["httpGet"] == {"path": "/healthz", "port": "health"}


def test_webhook_deployment_pdb_and_service(default_docs):
    deploy = one(default_docs, "Deployment", "dscache-webhook")
    assert deploy["spec"]["replicas"] == 2
    assert deploy["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    pod = deploy["spec"]["template"]
    labels = pod["metadata"]["labels"]
    (c,) = pod["spec"]["containers"]
    assert c["command"] + c["args"] == ["python", "-m", "dscache_operator", "webhook"]
    env = env_of(c)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["https"] == int(env["DSCACHE_WEBHOOK_PORT"]) == 9443
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert c["readinessProbe"]["tcpSocket"] == {"port": "https"}

    pdb = one(default_docs, "PodDisruptionBudget", "dscache-webhook")
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    svc = one(default_docs, "Service", "dscache-webhook")
    assert svc["spec"]["selector"].items() <= labels.items()
    assert svc["spec"]["ports"] == [{"name": "https", "port": 443, "targetPort": "https", "protocol": "TCP"}]
    # The controller pod is not behind the webhook Service.
    controller = one(default_docs, "Deployment", "dscache-controller")["spec"]["template"]["metadata"]["labels"]
    assert not svc["spec"]["selector"].items() <= controller.items()


def test_env_names_are_the_operator_settings(default_docs):
    """Every DSCACHE_* variable the chart sets is one settings.py reads, and the
    chart sets every one except those with no chart meaning."""
    known = set(
        re.findall(r'"(DSCACHE_[A-Z_]+)"', (REPO / "operator" / "dscache_operator" / "settings.py").read_text())
    )
    assert len(known) > 10
    webhook_only = {
        "DSCACHE_WEBHOOK_ADDR",
        "DSCACHE_WEBHOOK_PORT",
        "DSCACHE_WEBHOOK_CERT",
        "DSCACHE_WEBHOOK_KEY",
        "DSCACHE_PLACEMENT_WEIGHT",
    }
    controller_only = {
        "DSCACHE_SERVICE_ACCOUNT",  # the webhook never calls an agent: it asks for no token
        "DSCACHE_LEASE_NAME",  # leader election and pre-stage pods are the controller's
        "DSCACHE_POD_NAME",
        "DSCACHE_IMAGE_PULL_SECRETS",
    }
    optional = {"DSCACHE_STAGER_CONCURRENCY"}  # set only when given
    unused: set[str] = {"DSCACHE_LEADER_ELECTION"}  # the chart always elects (its default)
    for name, wanted, never in (
        ("dscache-controller", known - webhook_only - optional - unused, webhook_only | unused),
        ("dscache-webhook", known - controller_only - optional - unused, controller_only | unused),
    ):
        (c,) = one(default_docs, "Deployment", name)["spec"]["template"]["spec"]["containers"]
        env = env_of(c)
        assert set(env) <= known, set(env) - known
        assert wanted <= set(env), wanted - set(env)
        assert not set(env) & never, set(env) & never
        assert env["DSCACHE_CACHE_ROOT"] == "/var/lib/dscache"
        assert env["DSCACHE_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
        assert json.loads(env["DSCACHE_STAGER_RESOURCES"]) == {
            "requests": {"cpu": "500m", "memory": "256Mi"},
            "limits": {"memory": "1Gi"},
        }
        assert env["DSCACHE_AGENT_PORT"] == "9477"
        assert env["DSCACHE_STAGER_IMAGE"] == "dscache-stager:0.1.0"


def test_values_reach_the_env(helm: str):
    namespace, values, extra = VALUE_SETS["watch-namespaces"]
    docs = docs_of(template(helm, namespace, values, extra).stdout)
    for name in ("dscache-controller", "dscache-webhook"):
        (c,) = one(docs, "Deployment", name)["spec"]["template"]["spec"]["containers"]
        env = env_of(c)
        assert env["DSCACHE_WATCH_NAMESPACES"] == "ml-team,research"
        assert env["DSCACHE_STAGER_IMAGE"] == "registry.example/dscache-stager:1.2.3"
        assert env["DSCACHE_STAGER_PULL_POLICY"] == "Always"
        assert env["DSCACHE_STAGER_CONCURRENCY"] == "64"
        assert json.loads(env["DSCACHE_STAGER_RESOURCES"])["limits"] == {"memory": "4Gi"}
        assert env["DSCACHE_AGENT_PORT"] == "19477"
    (c,) = one(docs, "Deployment", "dscache-webhook")["spec"]["template"]["spec"]["containers"]
    assert env_of(c)["DSCACHE_PLACEMENT_WEIGHT"] == "50"
    agent = one(docs, "DaemonSet", "dscache-node")["spec"]["template"]["spec"]
    (c,) = agent["containers"]
    env = env_of(c)
    assert (env["DSCACHE_AGENT_PORT"], env["DSCACHE_NODE_BUDGET"], env["DSCACHE_NODE_HEADROOM"]) == (
        "19477",
        "500Gi",
        "20%",
    )
    assert env["DSCACHE_NODE_MAX_LABELS"] == "8"
    assert c["ports"] == [{"name": "http", "containerPort": 19477, "protocol": "TCP"}]
    assert (c["image"], c["imagePullPolicy"]) == ("registry.example/dscache-stager:1.2.3", "Always")
    assert agent["nodeSelector"] == {"dscache.io/cache-node": "true"}
    assert agent["tolerations"] == values["nodeAgent"]["tolerations"]
    assert "priorityClassName" not in agent
    assert agent["imagePullSecrets"] == [{"name": "regcred"}]
    # ...and their names reach the controller for its pre-stage pods (issue 29).
    (c,) = one(docs, "Deployment", "dscache-controller")["spec"]["template"]["spec"]["containers"]
    assert env_of(c)["DSCACHE_IMAGE_PULL_SECRETS"] == "regcred"
    assert one(docs, "Deployment", "dscache-webhook")["spec"]["replicas"] == 3
    assert one(docs, "ServiceMonitor")["metadata"]["labels"]["release"] == "prom"
    # product command: cacheRoot as given.
    docs = docs_of(template(helm, "default", {"cacheRoot": "/mnt/nvme/dscache/"}).stdout)
    (c,) = one(docs, "Deployment", "dscache-controller")["spec"]["template"]["spec"]["containers"]
    assert env_of(c)["DSCACHE_CACHE_ROOT"] == "/mnt/nvme/dscache"


def test_operator_pods_run_restricted(helm: str):
    for name, (namespace, values, extra) in VALUE_SETS.items():
        docs = docs_of(template(helm, namespace, values, extra).stdout)
        for deploy in find(docs, "Deployment"):
            pod = deploy["spec"]["template"]["spec"]
            assert pod["securityContext"]["runAsNonRoot"] is True
            assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
            for c in pod["containers"]:
                sc = c["securityContext"]
                assert sc["readOnlyRootFilesystem"] is True
                assert sc["allowPrivilegeEscalation"] is False
                assert sc["capabilities"]["drop"] == ["ALL"]
                assert "add" not in sc["capabilities"]
                assert "resources" in c and c["resources"]["limits"]["memory"]
            for vol in pod.get("volumes", []):
                assert "hostPath" not in vol, f"{name}: operator pods never mount host paths"


# --- RBAC -----------------------------------------------------------------------------------


def _rules(doc: dict[str, Any]) -> list[tuple]:
    return sorted(
        (tuple(r.get("apiGroups", [])), tuple(r.get("resources") or r["nonResourceURLs"]), tuple(sorted(r["verbs"])))
        + ((tuple(r["resourceNames"]),) if "resourceNames" in r else ())
        for r in doc["rules"]
    )


def operator_identities(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The operator's own objects: not the tenants' aggregated roles nor the uninstall hook's."""
    return [
        d
        for d in docs
        if "helm.sh/hook" not in (d["metadata"].get("annotations") or {})
        and not any(k.startswith("rbac.authorization.k8s.io/aggregate-to-") for k in d["metadata"].get("labels") or {})
    ]


def test_rbac_rules_are_operator_deploy_rbac_yaml(default_docs):
    """The default render == rbac.yaml + the cluster-wide Secret `get` binding (the
    operator's identities; the tenants' aggregated roles and the uninstall hook have their own tests)."""
    expected = docs_of((DEPLOY / "rbac.yaml").read_text()) + docs_of(
        (DEPLOY / "rbac-secrets-clusterwide.yaml").read_text()
    )
    default_docs = operator_identities(default_docs)
    for kind in ("ClusterRole", "Role"):
        want = {d["metadata"]["name"]: _rules(d) for d in find(expected, kind)}
        got = {d["metadata"]["name"]: _rules(d) for d in find(default_docs, kind)}
        assert got == want, kind
    for kind in ("ClusterRoleBinding", "RoleBinding"):
        want = {
            (d["metadata"]["name"], d["roleRef"]["name"], tuple((s["name"], s["namespace"]) for s in d["subjects"]))
            for d in find(expected, kind)
        }
        got = {
            (d["metadata"]["name"], d["roleRef"]["name"], tuple((s["name"], s["namespace"]) for s in d["subjects"]))
            for d in find(default_docs, kind)
        }
        assert got == want, kind


def test_rbac_least_privilege(helm: str):
    for name, (namespace, values, extra) in VALUE_SETS.items():
        docs = docs_of(template(helm, namespace, values, extra).stdout)
        roles = {(d["kind"], d["metadata"]["name"]): d for d in find(docs, "ClusterRole") + find(docs, "Role")}
        for doc in roles.values():
            for rule in doc["rules"]:
                what = rule.get("resources", []) + rule.get("nonResourceURLs", [])
                assert "*" not in rule["verbs"] and "*" not in what and "/*" not in str(what), (name, rule)
                if "secrets" in rule.get("resources", []):
                    # Reading by name only; no Secret is written (no peer tokens since issue 29).
                    assert rule["verbs"] == ["get"], (name, rule)
        # Secrets cluster-wide only in the cluster-wide default (readSecrets, no
        # secretNamespaces): never when Secret reading is narrowed, off, or scoped.
        sc = values.get("sourceCheck", {})
        clusterwide_ok = (
            sc.get("readSecrets", True) and not sc.get("secretNamespaces") and not values.get("watchNamespaces")
        )
        for crb in find(docs, "ClusterRoleBinding"):
            role = roles[("ClusterRole", crb["roleRef"]["name"])]
            if any("secrets" in r.get("resources", []) for r in role["rules"]):
                assert clusterwide_ok, (name, crb)
                assert [(s["kind"], s["name"]) for s in crb["subjects"]] == [
                    (
                        "ServiceAccount",
                        "dscache-controller"
                        if "fullnameOverride" not in values
                        else f"{values['fullnameOverride']}-controller",
                    )
                ], (name, crb)
        # Pod writes: the controller's pre-stage pods, in the namespaces it serves
        # (cluster-wide only when it serves the whole cluster); nobody else writes pods.
        watched = values.get("watchNamespaces", [])
        for binding in find(docs, "RoleBinding") + find(docs, "ClusterRoleBinding"):
            ref = binding["roleRef"]
            role = roles.get((ref["kind"], ref["name"]))
            if role and any(
                set(r["verbs"]) - {"get", "list", "watch"} and "pods" in r["resources"] for r in role["rules"]
            ):
                assert [s["name"] for s in binding["subjects"]] == [
                    f"{values.get('fullnameOverride', 'dscache')}-controller"
                ]
                if binding["kind"] == "RoleBinding":
                    assert binding["metadata"]["namespace"] in watched, (name, binding)
                else:
                    assert not watched, (name, binding)


def test_rbac_watch_namespaces(helm: str):
    namespace, values, extra = VALUE_SETS["watch-namespaces"]
    docs = docs_of(template(helm, namespace, values, extra).stdout)
    # sourceCheck.secretNamespaces narrows Secret reading to exactly the namespaces listed.
    secret_ns = sorted(rb["metadata"]["namespace"] for rb in find(docs, "RoleBinding", "dscache-source-check"))
    assert secret_ns == ["shared-data"]
    # Scoped: the operator's rules are bound in the watched namespaces only...
    for sa in ("dscache-controller", "dscache-webhook"):
        assert sorted(rb["metadata"]["namespace"] for rb in find(docs, "RoleBinding", sa)) == ["ml-team", "research"]
        assert not find(docs, "ClusterRoleBinding", sa)
    # ...and only kopf's read-only discovery of cluster-scoped objects stays cluster-wide.
    # Nodes are cluster-scoped too: the controller's and the webhook's node views come from here.
    assert _rules(one(docs, "ClusterRole", "dscache-discovery")) == [
        (("",), ("namespaces",), ("list", "watch")),
        (("",), ("nodes",), ("get", "list", "watch")),
        (("apiextensions.k8s.io",), ("customresourcedefinitions",), ("list", "watch")),
    ]
    # Pre-stage pods in the watched namespaces only; the node agents stay cluster-wide.
    assert sorted(rb["metadata"]["namespace"] for rb in find(docs, "RoleBinding", "dscache-prestage")) == [
        "ml-team",
        "research",
    ]
    assert not find(docs, "ClusterRoleBinding", "dscache-prestage")
    assert sorted(b["metadata"]["name"] for b in find(docs, "ClusterRoleBinding")) == [
        "dscache-discovery",
        "dscache-node",
    ]
    # rbac.scopeToWatchNamespaces=false: the bindings of operator/deploy/rbac.yaml.
    docs = docs_of(
        template(helm, values={"watchNamespaces": ["ml-team"], "rbac": {"scopeToWatchNamespaces": False}}).stdout
    )
    for sa in ("dscache-controller", "dscache-webhook"):
        assert one(docs, "ClusterRoleBinding", sa)["roleRef"]["name"] == sa
        assert not find(docs, "RoleBinding", sa)
    assert not find(docs, "ClusterRole", "dscache-discovery")
    # Namespaced without secretNamespaces: Secret reading in the watched namespaces.
    assert one(docs, "RoleBinding", "dscache-source-check")["metadata"]["namespace"] == "ml-team"
    assert not find(docs, "ClusterRoleBinding", "dscache-source-check")


def test_secret_reading_values(helm: str):
    """The README path: by default the controller may `get` Secrets wherever it serves."""
    docs = docs_of(template(helm).stdout)
    crb = one(docs, "ClusterRoleBinding", "dscache-source-check")
    assert crb["roleRef"]["name"] == "dscache-source-check"
    assert _rules(one(docs, "ClusterRole", "dscache-source-check")) == [(("",), ("secrets",), ("get",))]
    assert not find(docs, "RoleBinding", "dscache-source-check")
    # Narrowed: RoleBindings in exactly the listed namespaces, nothing cluster-wide.
    namespace, values, extra = VALUE_SETS["secret-namespaces"]
    docs = docs_of(template(helm, namespace, values, extra).stdout)
    assert sorted(rb["metadata"]["namespace"] for rb in find(docs, "RoleBinding", "dscache-source-check")) == [
        "ml",
        "shared-data",
    ]
    assert not find(docs, "ClusterRoleBinding", "dscache-source-check")
    # Off: no binding to the Secret role anywhere, and NOTES say how to turn it on.
    namespace, values, extra = VALUE_SETS["no-secrets"]
    proc = template(helm, namespace, values, extra)
    docs = docs_of(proc.stdout)
    assert not find(docs, "RoleBinding", "dscache-source-check")
    assert not find(docs, "ClusterRoleBinding", "dscache-source-check")
    assert "--set sourceCheck.readSecrets=true" in render_notes(helm, {"sourceCheck": {"readSecrets": False}})
    assert "readSecrets" not in render_notes(helm, {})


def render_notes(helm: str, values: dict[str, Any]) -> str:
    """NOTES.txt as `helm install` prints it (`helm template` skips NOTES, so render a copy)."""
    import shutil

    with tempfile.TemporaryDirectory() as tmp:
        chart = Path(tmp, "dscache")
        shutil.copytree(CHART, chart)
        notes = chart / "templates" / "NOTES.txt"
        (chart / "templates" / "_notes.tpl").write_text(
            '{{- define "test.notes" -}}\n' + notes.read_text() + "\n{{- end }}\n"
        )
        notes.unlink()
        (chart / "templates" / "notes.yaml").write_text('notes: {{ include "test.notes" . | toJson }}\n')
        with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
            yaml.safe_dump(values, f)
            f.flush()
            out = run_helm(
                helm,
                "template",
                "dscache",
                str(chart),
                "--namespace",
                NS,
                "--kube-version",
                KUBE_VERSION,
                "-f",
                f.name,
                "--show-only",
                "templates/notes.yaml",
            ).stdout
        return yaml.safe_load(out)["notes"]


def test_secret_forbidden_upgrade_lines_render(helm: str):
    """The two `helm upgrade` fixes the SecretForbidden message gives do what it says."""
    # The flags exactly as the message gives them.
    flags = ["--set", "sourceCheck.readSecrets=false", "--set", "sourceCheck.readSecrets=true"]
    docs = docs_of(template(helm, extra=[*flags, "--set-json", "sourceCheck.secretNamespaces=[]"]).stdout)
    assert one(docs, "ClusterRoleBinding", "dscache-source-check")
    docs = docs_of(template(helm, extra=["--set", "sourceCheck.secretNamespaces={team-a,ml}"]).stdout)
    assert sorted(rb["metadata"]["namespace"] for rb in find(docs, "RoleBinding", "dscache-source-check")) == [
        "ml",
        "team-a",
    ]


def test_secret_forbidden_message_names_the_chart_values():
    """The SecretForbidden message points at sourceCheck, with a runnable upgrade line."""
    from dscache_operator.control.sourcecheck import secret_forbidden

    got = secret_forbidden("ml", "s3-keys", "dscache-system")
    assert (got.ok, got.reason) == (False, "SecretForbidden")
    assert "ml/s3-keys" in got.message
    assert "helm upgrade dscache charts/dscache -n dscache-system --reuse-values" in got.message
    assert "--set sourceCheck.readSecrets=true --set-json 'sourceCheck.secretNamespaces=[]'" in got.message
    assert "sourceCheck.secretNamespaces={<listed>,ml}" in got.message
    assert "watchNamespaces" not in got.message and "watched namespaces" not in got.message


# --- CRD ------------------------------------------------------------------------------------


def test_crd_rendered_from_the_generated_file(default_docs, helm: str):
    (want,) = docs_of((REPO / "crds" / "datasetcache.yaml").read_text())
    got = one(default_docs, "CustomResourceDefinition", "datasetcaches.dscache.io")
    assert got["spec"] == want["spec"]
    assert got["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    docs = docs_of(template(helm, values={"crds": {"install": False}}).stdout)
    assert not find(docs, "CustomResourceDefinition")
    assert not (CHART / "crds").exists(), "the CRD is a template (upgradable), not in Helm's crds/ dir"


# --- values.schema.json and input checks ----------------------------------------------------


@pytest.mark.parametrize(
    "values, message",
    [
        ({"cacheRoot": "relative/dir"}, "at '/cacheRoot': 'relative/dir' does not match pattern"),
        ({"cacheRoot": "/var/../etc"}, "at '/cacheRoot'"),
        ({"cacheRoot": "/"}, "at '/cacheRoot'"),
        ({"cacheRoot": 5}, "at '/cacheRoot'"),
        ({"cacheRoot": "/var"}, 'cacheRoot "/var" is a system directory'),
        ({"cacheRoot": "/var/lib/"}, 'cacheRoot "/var/lib/" is a system directory'),
        ({"webhook": {"timeoutSeconds": 30}}, "at '/webhook/timeoutSeconds': maximum: got 30, want 10"),
        ({"webhook": {"replicas": 0}}, "at '/webhook/replicas'"),
        ({"watchNamespaces": ["Not_A_Namespace"]}, "at '/watchNamespaces/0'"),
        ({"watchNamespaces": ["a", "a"]}, "at '/watchNamespaces'"),
        ({"stager": {"image": {"pullPolicy": "Sometimes"}}}, "at '/stager/image/pullPolicy'"),
        ({"stager": {"concurrency": 0}}, "at '/stager/concurrency'"),
        ({"nodeAgent": {"tolerations": [{"operator": "Maybe"}]}}, "at '/nodeAgent/tolerations/0/operator'"),
        ({"nodeAgent": {"budget": "lots"}}, "at '/nodeAgent/budget'"),
        ({"nodeAgent": {"budget": "180%"}}, "at '/nodeAgent/budget'"),
        ({"nodeAgent": {"headroom": -1}}, "at '/nodeAgent/headroom'"),
        ({"nodeAgent": {"maxLabels": 0}}, "at '/nodeAgent/maxLabels'"),
        ({"nodeAgent": {"port": 0}}, "at '/nodeAgent/port'"),
        ({"placement": {"weight": 0}}, "at '/placement/weight'"),
        ({"placement": {"weight": 101}}, "at '/placement/weight'"),
        ({"wipe": {"tolerations": []}}, "additional properties 'wipe' not allowed"),
        ({"metrics": {"port": 70000}}, "at '/metrics/port'"),
        ({"cacheroot": "/mnt/nvme"}, "additional properties 'cacheroot' not allowed"),
    ],
)
def test_bad_values_are_refused_clearly(helm: str, values: dict[str, Any], message: str):
    proc = template(helm, values=values, check=False)
    assert proc.returncode != 0, f"{values} was accepted"
    assert message in proc.stderr, proc.stderr


def test_kube_version_constraint(helm: str):
    proc = template(helm, kube_version="1.29.0", check=False)
    assert proc.returncode != 0 and "kubeVersion" in proc.stderr
    assert template(helm, kube_version="v1.34.2-eks-abcdef").returncode == 0


# --- issue 10: chart gaps ------------------------------------------------------------------


def test_service_monitor_renders_without_the_api_being_served(helm: str):
    """`helm template` (Argo CD, GitOps) has no cluster to ask: enabled means rendered."""
    docs = docs_of(template(helm, values={"metrics": {"serviceMonitor": {"enabled": True}}}).stdout)
    assert one(docs, "ServiceMonitor")["spec"]["endpoints"][0]["port"] == "metrics"
    assert not find(docs_of(template(helm).stdout), "ServiceMonitor")


def exported_series() -> set[str]:
    """Every series name the operator's registry and a node agent's export (labelled ones made once)."""
    from dscache_node.budget import Room
    from dscache_node.metrics import AgentMetrics
    from dscache_operator.metrics.registry import Metrics

    m = Metrics()
    m.set_cache("ml", "c", "Ready", ["Ready"])
    agent = AgentMetrics()
    agent.observe("n1", Room(budget=10, held=5, fs_room=5), [], 0)
    registries = (m.registry, agent.registry)
    return {s.name for r in registries for f in r.collect() for s in f.samples}


def test_prometheus_rule_and_dashboard_use_metrics_the_operator_exports(helm: str):
    """Every dscache_* name an alert or a panel queries is one the operator's or an agent's registry has."""
    exported = exported_series()
    values = {"metrics": {"prometheusRule": {"enabled": True}, "dashboard": {"enabled": True}}}
    docs = docs_of(template(helm, values=values).stdout)
    rules = [r for g in one(docs, "PrometheusRule")["spec"]["groups"] for r in g["rules"]]
    assert {r["alert"] for r in rules} == {
        "DscacheControllerDown",
        "DscacheControllerNoLeader",
        "DscacheWebhookDown",
        "DscacheNodeAgentDown",
        "DscacheNodeAgentsDown",
        "DscacheStagerFailing",
        "DscacheWipesFailing",
        "DscacheWebhookRefusing",
        "DscacheNodeCopiesRefused",
        "DscacheNodeCacheThrashing",
        "DscachePeerRequestsRefused",
    }
    dashboard = json.loads(one(docs, "ConfigMap", "dscache-dashboard")["data"]["dscache.json"])
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    exprs = [r["expr"] for r in rules] + [t["expr"] for p in panels for t in p["targets"]]
    used = {n for e in exprs for n in re.findall(r"\b(dscache_[a-z_]+)", e)}
    assert used and used <= exported, f"queried but never exported: {sorted(used - exported)}"
    # The agents' budget, evictions and peer bytes are on the dashboard and in the alerts.
    agent_series = {
        "dscache_node_budget_bytes",
        "dscache_node_bytes_held",
        "dscache_node_bytes_in_use",
        "dscache_node_evicted_bytes_total",
        "dscache_node_reservations_refused_total",
        "dscache_node_peer_served_bytes_total",
        "dscache_node_peer_refused_requests_total",
    }
    on_dashboard = {n for p in panels for t in p["targets"] for n in re.findall(r"\b(dscache_[a-z_]+)", t["expr"])}
    assert agent_series <= on_dashboard, agent_series - on_dashboard
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    assert not find(docs_of(template(helm).stdout), "PrometheusRule")


def test_down_alerts_read_the_service_monitors_targets(helm: str):
    """Controller down: no `up` of the ServiceMonitor's controller target equals 1 (or none exists).
    The job labels are the metrics Services' names, the component the pods' label (podTargetLabels)."""
    values = {"metrics": {"prometheusRule": {"enabled": True}, "serviceMonitor": {"enabled": True}}}
    docs = docs_of(template(helm, values=values).stdout)
    rules = {r["alert"]: r for g in one(docs, "PrometheusRule")["spec"]["groups"] for r in g["rules"]}
    monitor = one(docs, "ServiceMonitor")
    assert monitor["spec"]["podTargetLabels"] == ["app.kubernetes.io/component"]
    services = {d["metadata"]["name"] for d in find(docs, "Service")}
    for alert, job, component in (
        ("DscacheControllerDown", "dscache-metrics", "controller"),
        ("DscacheWebhookDown", "dscache-metrics", "webhook"),
        ("DscacheNodeAgentsDown", "dscache-node-metrics", None),
    ):
        expr = rules[alert]["expr"]
        assert expr.startswith("absent(up{") and expr.endswith("== 1)"), expr
        assert f'job="{job}"' in expr and job in services and f'namespace="{NS}"' in expr, expr
        if component:
            assert f'app_kubernetes_io_component="{component}"' in expr, expr
            pods = one(docs, "Deployment", f"dscache-{component}")["spec"]["template"]["metadata"]["labels"]
            assert pods["app.kubernetes.io/component"] == component
        assert rules[alert]["labels"]["severity"] == "critical"
    assert rules["DscacheNodeAgentDown"]["expr"] == f'up{{namespace="{NS}", job="dscache-node-metrics"}} == 0'
    # No agents: no agent alerts.
    values["nodeAgent"] = {"enabled": False}
    docs = docs_of(template(helm, values=values).stdout)
    alerts = {r["alert"] for g in one(docs, "PrometheusRule")["spec"]["groups"] for r in g["rules"]}
    assert "DscacheControllerDown" in alerts and not {a for a in alerts if "Node" in a or "Peer" in a}


def test_service_accounts_images_pull_secrets_and_spread(helm: str):
    digest = "sha256:" + "a" * 64
    values = {
        "image": {"registry": "ghcr.io/acme", "digest": digest},
        "stager": {"image": {"registry": "ghcr.io/acme/", "tag": "9.9"}},
        "imagePullSecrets": [{"name": "regcred"}],
        "controller": {"serviceAccount": {"create": False, "name": "platform-sa"}},
        "webhook": {
            "topologySpreadConstraints": [
                {"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone", "whenUnsatisfiable": "ScheduleAnyway"}
            ]
        },
        "logging": {"level": "DEBUG", "format": "json"},
    }
    docs = docs_of(template(helm, values=values).stdout)
    assert [d["metadata"]["name"] for d in find(docs, "ServiceAccount")] == [
        "dscache-webhook",
        "dscache-node",
        "dscache-uninstall",
    ]
    ctl = one(docs, "Deployment", "dscache-controller")["spec"]["template"]["spec"]
    assert ctl["serviceAccountName"] == "platform-sa"
    subjects = [s for d in find(docs, "ClusterRoleBinding") + find(docs, "RoleBinding") for s in d["subjects"]]
    assert {"kind": "ServiceAccount", "name": "platform-sa", "namespace": NS} in subjects
    assert not any(s["name"] == "dscache-controller" for s in subjects)
    (c,) = ctl["containers"]
    assert c["image"] == f"ghcr.io/acme/dscache-operator@{digest}"
    env = env_of(c)
    assert env["DSCACHE_STAGER_IMAGE"] == "ghcr.io/acme/dscache-stager:9.9"
    assert (env["DSCACHE_LOG_LEVEL"], env["DSCACHE_LOG_FORMAT"]) == ("DEBUG", "json")
    hook = one(docs, "Deployment", "dscache-webhook")["spec"]["template"]["spec"]
    (tsc,) = hook["topologySpreadConstraints"]
    assert tsc["topologyKey"] == "topology.kubernetes.io/zone"
    assert tsc["labelSelector"]["matchLabels"]["app.kubernetes.io/component"] == "webhook"
    bad = template(helm, values={"logging": {"format": "xml"}}, check=False)
    assert bad.returncode != 0 and "format" in bad.stderr


# --- issue 16: the node agent ---------------------------------------------------------------


def test_node_agent_daemonset(default_docs):
    ds = one(default_docs, "DaemonSet", "dscache-node")
    assert ds["metadata"]["labels"]["app.kubernetes.io/name"] == "dscache-node"
    assert ds["spec"]["updateStrategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1}}
    template = ds["spec"]["template"]
    assert ds["spec"]["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
    pod = template["spec"]
    assert pod["hostNetwork"] is True
    assert pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert pod["serviceAccountName"] == "dscache-node"
    assert pod["automountServiceAccountToken"] is True
    assert pod["terminationGracePeriodSeconds"] == 10
    assert pod["priorityClassName"] == "system-node-critical"
    # Tainted GPU nodes get an agent too.
    assert pod["tolerations"] == [{"operator": "Exists"}]
    assert "nodeSelector" not in pod
    (c,) = pod["containers"]
    assert c["command"] == ["dscache-node"]
    assert (c["image"], c["imagePullPolicy"]) == ("dscache-stager:0.1.0", "IfNotPresent")
    assert c["resources"] == {"requests": {"cpu": "10m", "memory": "64Mi"}, "limits": {"memory": "256Mi"}}
    assert c["ports"] == [{"name": "http", "containerPort": 9477, "protocol": "TCP"}]
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert c[probe]["httpGet"] == {"path": "/healthz", "port": "http", "scheme": "HTTPS"}, probe
    # The CSI driver: the one privileged pod of the product (bind mounts into the kubelet's pods).
    sc = c["securityContext"]
    assert (sc["privileged"], sc["runAsUser"], sc["readOnlyRootFilesystem"]) == (True, 0, True)
    env = env_of(c)
    assert (env["DSCACHE_CSI"], env["DSCACHE_KUBELET_DIR"], env["DSCACHE_STAGER_UID"]) == (
        "true",
        "/var/lib/kubelet",
        "65532",
    )
    assert env["DSCACHE_NODE_NAME"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert env["DSCACHE_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    assert env["DSCACHE_CACHE_ROOT"] == "/var/lib/dscache"
    assert env["DSCACHE_AGENT_PORT"] == "9477"
    assert (env["DSCACHE_NODE_BUDGET"], env["DSCACHE_NODE_HEADROOM"], env["DSCACHE_NODE_MAX_LABELS"]) == (
        "80%",
        "15%",
        "16",
    )
    assert env["DSCACHE_LOG_LEVEL"] == "INFO"
    # The host paths: cacheRoot, and the kubelet's directory (Bidirectional), each at the same path inside.
    host = [v for v in pod["volumes"] if "hostPath" in v]
    assert host == [
        {"name": "cache-root", "hostPath": {"path": "/var/lib/dscache", "type": "DirectoryOrCreate"}},
        {"name": "kubelet-dir", "hostPath": {"path": "/var/lib/kubelet", "type": "Directory"}},
    ]
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    assert mounts["cache-root"]["mountPath"] == "/var/lib/dscache" and "mountPropagation" not in mounts["cache-root"]
    assert mounts["kubelet-dir"] == {
        "name": "kubelet-dir",
        "mountPath": "/var/lib/kubelet",
        "mountPropagation": "Bidirectional",
    }
    driver = one(default_docs, "CSIDriver", "cache.dscache.io")["spec"]
    assert driver == {
        "attachRequired": False,
        "podInfoOnMount": True,
        "volumeLifecycleModes": ["Ephemeral"],
        "fsGroupPolicy": "None",
        "requiresRepublish": False,
        "storageCapacity": False,
    }


def test_node_agent_host_path_mode_has_no_privilege(helm: str):
    docs = docs_of(template(helm, values={"volume": {"type": "hostPath"}}).stdout)
    assert find(docs, "CSIDriver") == []
    pod = one(docs, "DaemonSet", "dscache-node")["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    # uid 0 with no capability at all: the owner of cacheRoot needs none.
    sc = c["securityContext"]
    assert sc["runAsUser"] == 0
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert "privileged" not in sc
    assert "DSCACHE_CSI" not in env_of(c)
    assert [v["name"] for v in pod["volumes"] if "hostPath" in v] == ["cache-root"]


def test_node_agent_env_is_what_the_agent_reads(default_docs):
    """Every DSCACHE_* the DaemonSet sets is one dscache_node/settings.py reads (no typo goes unnoticed)."""
    source = (REPO / "node-agent" / "dscache_node" / "settings.py").read_text()
    known = set(re.findall(r'"(DSCACHE_[A-Z_]+)"', source))
    (c,) = one(default_docs, "DaemonSet", "dscache-node")["spec"]["template"]["spec"]["containers"]
    env = set(env_of(c))
    assert env <= known, env - known
    # What the chart leaves at the agent's defaults: its internal timings.
    assert known - env <= {"DSCACHE_NODE_SCAN_INTERVAL", "DSCACHE_NODE_UNKNOWN_LEASE_GRACE"}, known - env


def test_node_agent_values(helm: str):
    docs = docs_of(
        template(
            helm,
            values={
                "cacheRoot": "/mnt/nvme/dscache/",
                "nodeAgent": {
                    "budget": 536870912000,
                    "tolerations": [],
                    "priorityClassName": "dscache-node",
                    "serviceAccount": {"create": False, "name": "node-sa"},
                },
            },
        ).stdout
    )
    pod = one(docs, "DaemonSet", "dscache-node")["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    # A number in a values file is a float to Helm: it still reaches the agent as an integer.
    assert env_of(c)["DSCACHE_NODE_BUDGET"] == "536870912000"
    assert env_of(c)["DSCACHE_CACHE_ROOT"] == "/mnt/nvme/dscache"
    assert pod["volumes"][0]["hostPath"]["path"] == "/mnt/nvme/dscache"
    assert "tolerations" not in pod
    assert pod["priorityClassName"] == "dscache-node"
    assert pod["serviceAccountName"] == "node-sa"
    assert [d["metadata"]["name"] for d in find(docs, "ServiceAccount")] == [
        "dscache-controller",
        "dscache-webhook",
        "dscache-uninstall",
    ]
    assert one(docs, "ClusterRoleBinding", "dscache-node")["subjects"] == [
        {"kind": "ServiceAccount", "name": "node-sa", "namespace": NS}
    ]


def test_no_shared_agent_key_and_the_agents_tls(default_docs, tmp_path: Path):
    """Issue 29: no token Secret shared by the nodes; the agents serve TLS with a certificate for
    AGENT_TLS_NAME that the generated CA signed; the controller and the webhook get ca.crt only."""
    assert not find(default_docs, "Secret", "dscache-agent-token")
    assert "DSCACHE_AGENT_TOKEN_FILE" not in json.dumps(default_docs)
    secret = one(default_docs, "Secret", "dscache-agent-tls")
    for key in ("ca.crt", "tls.crt", "tls.key"):
        (tmp_path / key).write_bytes(base64.b64decode(secret["data"][key]))
    subprocess.run(
        ["openssl", "verify", "-CAfile", str(tmp_path / "ca.crt"), str(tmp_path / "tls.crt")],
        check=True,
        capture_output=True,
    )
    text = subprocess.run(
        ["openssl", "x509", "-in", str(tmp_path / "tls.crt"), "-noout", "-text"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    assert f"DNS:{AGENT_TLS_NAME}" in text
    ds = one(default_docs, "DaemonSet", "dscache-node")["spec"]["template"]["spec"]
    (vol,) = [v for v in ds["volumes"] if v["name"] == "agent-tls"]
    assert vol["secret"] == {"secretName": "dscache-agent-tls", "defaultMode": 0o400}
    (c,) = ds["containers"]
    env = env_of(c)
    assert (env["DSCACHE_AGENT_TLS_CERT"], env["DSCACHE_AGENT_TLS_KEY"]) == (
        "/etc/dscache/agent-tls/tls.crt",
        "/etc/dscache/agent-tls/tls.key",
    )
    assert env["DSCACHE_CONTROLLER_SERVICE_ACCOUNT"] == "dscache-controller"
    for name in ("dscache-controller", "dscache-webhook"):
        pod = one(default_docs, "Deployment", name)["spec"]["template"]["spec"]
        (vol,) = [v for v in pod["volumes"] if v["name"] == "agent-ca"]
        assert vol["secret"] == {"secretName": "dscache-agent-tls", "items": [{"key": "ca.crt", "path": "ca.crt"}]}
        assert env_of(pod["containers"][0])["DSCACHE_AGENT_CA_FILE"] == "/etc/dscache/agent-ca/ca.crt", name
    controller = one(default_docs, "Deployment", "dscache-controller")["spec"]["template"]["spec"]
    assert env_of(controller["containers"][0])["DSCACHE_SERVICE_ACCOUNT"] == "dscache-controller"


def test_agent_tls_off(helm: str):
    docs = docs_of(template(helm, values={"nodeAgent": {"tls": {"enabled": False}}}).stdout)
    assert not find(docs, "Secret", "dscache-agent-tls")
    assert "agent-ca" not in json.dumps(docs) and "DSCACHE_AGENT_CA_FILE" not in json.dumps(docs)
    (c,) = one(docs, "DaemonSet", "dscache-node")["spec"]["template"]["spec"]["containers"]
    assert "DSCACHE_AGENT_TLS_CERT" not in env_of(c)
    assert c["livenessProbe"]["httpGet"]["scheme"] == "HTTP"


def test_agent_certificate_is_kept_across_upgrades():
    """Read back with `lookup` (as the webhook certificate is) and made only when missing or expiring."""
    text = (CHART / "templates" / "agent-tls.yaml").read_text()
    assert 'lookup "v1" "Secret" $ns $secretName' in text
    assert "if and $complete (gt $notAfter $renewBy)" in text


def test_node_agent_rbac(default_docs):
    rules = _rules(one(default_docs, "ClusterRole", "dscache-node"))
    assert rules == [
        ((), ("/.well-known/openid-configuration", "/openid/v1/jwks"), ("get",)),
        (("",), ("nodes",), ("get", "list", "patch", "watch")),
        (("",), ("pods",), ("get", "list", "watch")),
        (("", "events.k8s.io"), ("events",), ("create", "patch")),
        (("authentication.k8s.io",), ("tokenreviews",), ("create",)),
        (("dscache.io",), ("datasetcaches",), ("get", "list")),
    ]
    crb = one(default_docs, "ClusterRoleBinding", "dscache-node")
    assert crb["roleRef"]["name"] == "dscache-node"
    assert crb["subjects"] == [{"kind": "ServiceAccount", "name": "dscache-node", "namespace": NS}]
    assert one(default_docs, "ServiceAccount", "dscache-node")
    # The controller: a node view, and pre-stage pods wherever it serves (cluster-wide by default).
    controller = _rules(one(default_docs, "ClusterRole", "dscache-controller"))
    assert (("",), ("nodes",), ("get", "list", "watch")) in controller
    assert (("",), ("pods",), ("list", "watch")) in controller
    assert _rules(one(default_docs, "ClusterRole", "dscache-prestage")) == [
        (("",), ("pods",), ("create", "delete", "get", "list", "watch"))
    ]
    crb = one(default_docs, "ClusterRoleBinding", "dscache-prestage")
    assert crb["subjects"] == [{"kind": "ServiceAccount", "name": "dscache-controller", "namespace": NS}]
    # No more wipe helper pods in the release namespace: its only Role is the leader election's, on leases.
    assert [r["metadata"]["name"] for r in find(default_docs, "Role")] == ["dscache-controller-leader-election"]
    assert {res for r in find(default_docs, "Role") for rule in r["rules"] for res in rule["resources"]} == {"leases"}
    assert [b["metadata"]["name"] for b in find(default_docs, "RoleBinding")] == ["dscache-controller-leader-election"]
    # The webhook: its node index, read-only.
    webhook = _rules(one(default_docs, "ClusterRole", "dscache-webhook"))
    assert (("",), ("nodes",), ("list", "watch")) in webhook
    for _, resources, verbs in webhook:
        assert set(verbs) <= {"get", "list", "watch"} or resources == ("events",), (resources, verbs)


def test_node_agent_disabled(helm: str):
    docs = docs_of(template(helm, values={"nodeAgent": {"enabled": False}}).stdout)
    assert not find(docs, "DaemonSet")
    assert not find(docs, "ClusterRole", "dscache-node") and not find(docs, "ClusterRoleBinding", "dscache-node")
    assert not find(docs, "ServiceAccount", "dscache-node")
    assert not find(docs, "Service", "dscache-node-metrics")
    # The certificate is still there, for agents run some other way, and the controller trusts its CA.
    assert one(docs, "Secret", "dscache-agent-tls")
    (c,) = one(docs, "Deployment", "dscache-controller")["spec"]["template"]["spec"]["containers"]
    assert env_of(c)["DSCACHE_AGENT_CA_FILE"] == "/etc/dscache/agent-ca/ca.crt"


def test_node_agent_metrics_service(default_docs, helm: str):
    svc = one(default_docs, "Service", "dscache-node-metrics")
    ds = one(default_docs, "DaemonSet", "dscache-node")
    assert svc["spec"]["selector"].items() <= ds["spec"]["template"]["metadata"]["labels"].items()
    assert svc["spec"]["ports"] == [{"name": "agent-metrics", "port": 9477, "targetPort": "http", "protocol": "TCP"}]
    # The operator's metrics Service does not select the agents, and the ServiceMonitor selects both Services.
    operator_svc = one(default_docs, "Service", "dscache-metrics")
    assert not operator_svc["spec"]["selector"].items() <= ds["spec"]["template"]["metadata"]["labels"].items()
    docs = docs_of(template(helm, values={"metrics": {"serviceMonitor": {"enabled": True}}}).stdout)
    monitor = one(docs, "ServiceMonitor")["spec"]
    selector = monitor["selector"]["matchLabels"]
    # The agents serve TLS: scraped over https, checked against their CA for their certificate's name.
    (agents,) = [e for e in monitor["endpoints"] if e["port"] == "agent-metrics"]
    assert agents["scheme"] == "https" and agents["tlsConfig"]["serverName"] == AGENT_TLS_NAME
    assert agents["tlsConfig"]["ca"] == {"secret": {"name": "dscache-agent-tls", "key": "ca.crt"}}
    for name in ("dscache-metrics", "dscache-node-metrics"):
        assert selector.items() <= one(docs, "Service", name)["metadata"]["labels"].items(), name
    docs = docs_of(template(helm, values={"metrics": {"enabled": False}}).stdout)
    assert not find(docs, "Service", "dscache-node-metrics")


def test_notes_name_the_agents(helm: str):
    notes = render_notes(helm, {})
    assert "kubectl get pods -n dscache-system -l app.kubernetes.io/name=dscache-node -o wide" in notes
    assert "budget 80%" in notes
    assert "nodeAgent.enabled=false" in render_notes(helm, {"nodeAgent": {"enabled": False}})


# --- issue 26: chart conventions --------------------------------------------------------------


def test_tenants_get_datasetcaches_through_the_builtin_roles(default_docs, helm: str):
    """ClusterRoles aggregated into admin/edit (write) and view (read): a tenant bound to the
    built-in `edit` role can create DatasetCaches; nothing else is granted to anyone."""
    edit = one(default_docs, "ClusterRole", "dscache-edit")
    view = one(default_docs, "ClusterRole", "dscache-view")
    labels = {k: v for k, v in edit["metadata"]["labels"].items() if k.startswith("rbac.authorization.k8s.io/")}
    assert labels == {
        "rbac.authorization.k8s.io/aggregate-to-admin": "true",
        "rbac.authorization.k8s.io/aggregate-to-edit": "true",
    }
    assert [k for k in view["metadata"]["labels"] if k.startswith("rbac.authorization.k8s.io/")] == [
        "rbac.authorization.k8s.io/aggregate-to-view"
    ]
    assert _rules(edit) == [
        (("dscache.io",), ("datasetcaches",), ("create", "delete", "get", "list", "patch", "update", "watch"))
    ]
    assert _rules(view) == [(("dscache.io",), ("datasetcaches",), ("get", "list", "watch"))]
    # Aggregated roles are granted through the built-in roles' own bindings: the chart binds them to nobody.
    bound = {b["roleRef"]["name"] for b in find(default_docs, "ClusterRoleBinding") + find(default_docs, "RoleBinding")}
    assert not bound & {"dscache-edit", "dscache-view"}
    docs = docs_of(template(helm, values={"rbac": {"aggregateToDefaultRoles": False}}).stdout)
    assert not find(docs, "ClusterRole", "dscache-edit") and not find(docs, "ClusterRole", "dscache-view")


def hook_docs(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d for d in docs if "helm.sh/hook" in (d["metadata"].get("annotations") or {})]


def test_uninstall_hook(default_docs):
    """A pre-delete Job deletes every DatasetCache and waits for the controller's wipes; its
    identity may list and delete DatasetCaches and nothing else, and all of it goes once it succeeded."""
    hooks = hook_docs(default_docs)
    assert sorted((d["kind"], d["metadata"]["name"]) for d in hooks) == [
        ("ClusterRole", "dscache-uninstall"),
        ("ClusterRoleBinding", "dscache-uninstall"),
        ("Job", "dscache-uninstall"),
        ("ServiceAccount", "dscache-uninstall"),
    ]
    for d in hooks:
        ann = d["metadata"]["annotations"]
        assert ann["helm.sh/hook"] == "pre-delete", d["kind"]
        assert ann["helm.sh/hook-delete-policy"] == "before-hook-creation,hook-succeeded", d["kind"]
        # Its identity and rights exist before the Job starts.
        assert int(ann["helm.sh/hook-weight"]) == (0 if d["kind"] == "Job" else -10), d["kind"]
    assert _rules(one(hooks, "ClusterRole", "dscache-uninstall")) == [
        (("dscache.io",), ("datasetcaches",), ("delete", "list"))
    ]
    crb = one(hooks, "ClusterRoleBinding", "dscache-uninstall")
    assert crb["subjects"] == [{"kind": "ServiceAccount", "name": "dscache-uninstall", "namespace": NS}]
    job = one(hooks, "Job", "dscache-uninstall")
    assert job["spec"]["backoffLimit"] == 0
    pod = job["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "dscache-uninstall" and pod["restartPolicy"] == "Never"
    (c,) = pod["containers"]
    assert c["command"] + c["args"] == ["python", "-m", "dscache_operator", "uninstall", "--timeout", "240"]
    # The Job outlives the wait it bounds, and that wait fits in `helm uninstall`'s default 5m.
    assert job["spec"]["activeDeadlineSeconds"] > 240
    assert int(c["args"][-1]) < 300
    assert env_of(c) == {"DSCACHE_WATCH_NAMESPACES": ""}
    controller = one(default_docs, "Deployment", "dscache-controller")["spec"]["template"]["spec"]["containers"][0]
    assert c["image"] == controller["image"]
    assert c["securityContext"]["readOnlyRootFilesystem"] is True and pod["securityContext"]["runAsNonRoot"] is True
    # The metrics Service never takes the hook's pod for an endpoint.
    selector = one(default_docs, "Service", "dscache-metrics")["spec"]["selector"]
    assert not selector.items() <= job["spec"]["template"]["metadata"]["labels"].items()


def test_uninstall_hook_in_namespaced_mode(helm: str):
    namespace, values, extra = VALUE_SETS["watch-namespaces"]
    hooks = hook_docs(docs_of(template(helm, namespace, values, extra).stdout))
    assert not find(hooks, "ClusterRoleBinding")
    assert sorted(b["metadata"]["namespace"] for b in find(hooks, "RoleBinding", "dscache-uninstall")) == [
        "ml-team",
        "research",
    ]
    (c,) = one(hooks, "Job")["spec"]["template"]["spec"]["containers"]
    assert env_of(c) == {"DSCACHE_WATCH_NAMESPACES": "ml-team,research"}
    off = docs_of(template(helm, values={"uninstall": {"deleteCaches": False}}).stdout)
    assert not hook_docs(off)
    long = docs_of(template(helm, values={"uninstall": {"timeoutSeconds": 900}}).stdout)
    job = one(hook_docs(long), "Job")
    assert job["spec"]["activeDeadlineSeconds"] == 960
    assert job["spec"]["template"]["spec"]["containers"][0]["args"][-1] == "900"
