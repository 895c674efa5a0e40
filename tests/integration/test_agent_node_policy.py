"""The chart's ValidatingAdmissionPolicy for the agents' Node writes, enforced by a real kube-apiserver.

The policy (charts/dscache/templates/agent-node-policy.yaml, as `helm template` renders it) is
created in the test's API server, and Node patches are made with a token of the agents' own
ServiceAccount bound to a Pod on node A (as the kubelet mounts it: its node claim names A), with
the permissions the shipped RBAC gives it. The e2e suite checks the same on kind
(e2e/test_31_node_policy.py); this one runs without a cluster.
"""

from __future__ import annotations

import http.client
import json
import os
import ssl
import subprocess
import tempfile
from typing import Any

import pytest
import yaml

import dscache_contract as contract
from tests.support.kubeapi import OPERATOR_NS, REPO, ApiError, KubeAPI
from tests.support.nodeagent import create_ignoring_conflict, register_node
from tests.support.tools import tool_bin

pytestmark = pytest.mark.integration


def rendered_policy() -> list[dict[str, Any]]:
    """The policy and its binding, for a release "dscache" in the operator's namespace (its agents'
    ServiceAccount is then dscache-node, the one the tier's RBAC binds)."""
    p = subprocess.run(
        [
            str(tool_bin("helm") / "helm"),
            "template",
            "dscache",
            str(REPO / "charts" / "dscache"),
            "-n",
            OPERATOR_NS,
            "--kube-version",
            "1.34.4",
            "--show-only",
            "templates/agent-node-policy.yaml",
        ],
        capture_output=True,
        text=True,
        check=True,
        env={
            **os.environ,
            "HELM_CACHE_HOME": tempfile.gettempdir() + "/dscache-helm-cache",
            "HELM_CONFIG_HOME": tempfile.gettempdir() + "/dscache-helm-config",
        },
    )
    return [d for d in yaml.safe_load_all(p.stdout) if d]


def patch_as(k: KubeAPI, token: str, node: str, body: dict[str, Any]) -> tuple[int, str]:
    """A merge patch of ``node`` with ``token`` as the only credential (no client certificate)."""
    ctx = ssl.create_default_context(cafile=str(k.certs / "ca.crt"))
    conn = http.client.HTTPSConnection("127.0.0.1", k.port, context=ctx, timeout=30)
    try:
        conn.request(
            "PATCH",
            f"/api/v1/nodes/{node}",
            body=json.dumps(body),
            headers={"Content-Type": "application/merge-patch+json", "Authorization": f"Bearer {token}"},
        )
        resp = conn.getresponse()
        return resp.status, resp.read().decode()
    finally:
        conn.close()


@pytest.fixture
def policy(kube_api: KubeAPI, dscache_operator):
    k = kube_api
    docs = rendered_policy()
    kinds = {d["kind"]: d for d in docs}
    assert set(kinds) == {"ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"}, docs
    base = "/apis/admissionregistration.k8s.io/v1"
    vap, binding = kinds["ValidatingAdmissionPolicy"], kinds["ValidatingAdmissionPolicyBinding"]
    k.create(f"{base}/validatingadmissionpolicies", vap)
    k.create(f"{base}/validatingadmissionpolicybindings", binding)
    name = vap["metadata"]["name"]
    # (Its expressions' type check is reported in the status by kube-controller-manager, which this
    # tier does not run; the e2e test reads it. Here the enforcement itself is what is checked.)
    yield vap
    for path in (f"{base}/validatingadmissionpolicybindings/{name}", f"{base}/validatingadmissionpolicies/{name}"):
        try:
            k.request("DELETE", path)
        except ApiError:
            pass


def bound_token(k: KubeAPI, node: str) -> str:
    """The agents' ServiceAccount token bound to a Pod on ``node``, as the kubelet mounts it."""
    create_ignoring_conflict(
        k,
        f"/api/v1/namespaces/{OPERATOR_NS}/serviceaccounts",
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "dscache-node"}},
    )
    pod = k.create(
        f"/api/v1/namespaces/{OPERATOR_NS}/pods",
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"generateName": f"agent-{node}-"},
            "spec": {
                "nodeName": node,
                "serviceAccountName": "dscache-node",
                "containers": [{"name": "agent", "image": "dscache-stager"}],
            },
        },
    )
    return str(
        k.create(
            f"/api/v1/namespaces/{OPERATOR_NS}/serviceaccounts/dscache-node/token",
            {
                "apiVersion": "authentication.k8s.io/v1",
                "kind": "TokenRequest",
                "spec": {
                    "expirationSeconds": 3600,
                    "boundObjectRef": {
                        "apiVersion": "v1",
                        "kind": "Pod",
                        "name": pod["metadata"]["name"],
                        "uid": pod["metadata"]["uid"],
                    },
                },
            },
        )["status"]["token"]
    )


def test_the_policy_confines_the_agents_to_their_own_node(kube_api: KubeAPI, policy):
    k = kube_api
    own, other = "policy-a", "policy-b"
    register_node(k, own)
    register_node(k, other)
    token = bound_token(k, own)
    warm = contract.warm_label("ml", "c", "r-" + "0" * 20)
    staging = contract.peers.staging_label("ml", "c", "r-" + "1" * 20)

    # The policy is in force once a write to another node that would change nothing is refused (the
    # API server loads a new policy within a second or so; a probe that changed something would
    # change it while the policy is not loaded yet).
    same = {"metadata": {"labels": {"kubernetes.io/hostname": other}}}
    k.wait_for(lambda: patch_as(k, token, other, same)[0] >= 400, timeout=30, what="the policy in force")

    # Its own node, dscache's labels and annotation: allowed.
    def allowed() -> bool:
        code, _text = patch_as(k, token, own, {"metadata": {"labels": {warm: "true", staging: "1.0"}}})
        return code == 200

    k.wait_for(allowed, timeout=30, what="the agent labelling its own node")
    code, text = patch_as(
        k,
        token,
        own,
        {
            "metadata": {
                "labels": {warm: None, contract.AGENT_LABEL: "9477"},
                "annotations": {contract.INVENTORY_ANNOTATION: "{}"},
            }
        },
    )
    assert code == 200, text

    # Another node, or anything but dscache's labels and annotation: refused by the policy.
    def refused_on(node: str, body: dict[str, Any]) -> str:
        code, text = patch_as(k, token, node, body)
        assert code >= 400 and "denied request" in text, (node, body, code, text)
        return text

    assert "only its own Node" in refused_on(other, {"metadata": {"labels": {warm: "true"}}})
    refused_on(own, {"metadata": {"labels": {"example.com/steer": "here"}}})
    refused_on(own, {"metadata": {"labels": {"kubernetes.io/hostname": None}}})
    refused_on(own, {"metadata": {"annotations": {"example.com/note": "x"}}})
    refused_on(own, {"spec": {"unschedulable": True}})
    refused_on(own, {"spec": {"taints": [{"key": "example.com/evil", "effect": "NoSchedule"}]}})
    node = k.get(f"/api/v1/nodes/{own}")
    assert "example.com/steer" not in node["metadata"]["labels"] and not node["spec"].get("unschedulable")
    assert node["metadata"]["labels"].get(staging) == "1.0" and warm not in node["metadata"]["labels"]
    assert k.get(f"/api/v1/nodes/{other}")["metadata"]["labels"].get(warm) is None

    # A token with no node claim (not a pod's): no Node at all.
    plain = k.create(
        f"/api/v1/namespaces/{OPERATOR_NS}/serviceaccounts/dscache-node/token",
        {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {"expirationSeconds": 600}},
    )["status"]["token"]
    code, text = patch_as(k, plain, own, {"metadata": {"labels": {warm: "true"}}})
    assert code >= 400 and "denied request" in text, text
