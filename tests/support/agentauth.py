"""Real identities for the node agents' checks (TokenReview on the test API server).

- a stager's token: a TokenRequest bound to a pod (as the kubelet makes the projected
  one: audience ``dscache-peer``, with the pod's name and uid in the review's extra);
- the controller's token: its ServiceAccount's, for ``dscache-peer``'s sibling
  audience ``dscache-agent/<node>``.
The pods are plain API objects (no kubelet runs them); they carry no consumer label,
so the controller's views never count them.
"""

from __future__ import annotations

import hashlib
from typing import Any

import dscache_contract as contract
from dscache_contract.peers import PEER_AUDIENCE, agent_audience

from .kubeapi import OPERATOR_NS, ApiError, KubeAPI

CONTROLLER_SA = "dscache-controller"


def _ignore_conflict(k: KubeAPI, path: str, body: dict[str, Any]) -> None:
    try:
        k.create(path, body)
    except ApiError as e:
        if e.status != 409:
            raise


def ensure_service_account(k: KubeAPI, ns: str, name: str = "default") -> None:
    _ignore_conflict(k, "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
    _ignore_conflict(
        k,
        f"/api/v1/namespaces/{ns}/serviceaccounts",
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": name}},
    )


def consumer_pod(
    k: KubeAPI, ns: str, cache: str | None, node: str, name: str | None = None, service_account: str = "default"
) -> dict[str, Any]:
    """A pod on ``node`` naming ``cache`` (dscache.io/cache; None: naming none), as the webhook leaves it."""
    ensure_service_account(k, ns, service_account)
    if name is None:
        digest = hashlib.sha256(f"{ns}/{cache}/{node}".encode()).hexdigest()[:10]
        name = f"stager-{digest}"
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "annotations": {contract.ANNOTATION_CACHE: cache} if cache else {}},
        "spec": {
            "nodeName": node,
            "serviceAccountName": service_account,
            "automountServiceAccountToken": False,
            "containers": [{"name": "c", "image": "busybox"}],
        },
    }
    try:
        return dict(k.create(f"/api/v1/namespaces/{ns}/pods", pod))
    except ApiError as e:
        if e.status != 409:
            raise
        return dict(k.get(f"/api/v1/namespaces/{ns}/pods/{name}"))


def pod_token(k: KubeAPI, pod: dict[str, Any], audience: str = PEER_AUDIENCE, seconds: int = 600) -> str:
    """The pod's ServiceAccount token bound to the pod, as its projected volume holds it."""
    meta = pod["metadata"]
    sa = pod["spec"].get("serviceAccountName") or "default"
    body = {
        "apiVersion": "authentication.k8s.io/v1",
        "kind": "TokenRequest",
        "spec": {
            "audiences": [audience],
            "expirationSeconds": seconds,
            "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": meta["name"], "uid": meta["uid"]},
        },
    }
    return str(k.create(f"/api/v1/namespaces/{meta['namespace']}/serviceaccounts/{sa}/token", body)["status"]["token"])


def stager_token(k: KubeAPI, ns: str, cache: str, node: str) -> str:
    """A token a stager of ``ns/cache`` on ``node`` shows the agents."""
    return pod_token(k, consumer_pod(k, ns, cache, node))


def controller_token(k: KubeAPI, node: str, audience: str | None = None, seconds: int = 600) -> str:
    """The controller's token for the agent of ``node`` (its ServiceAccount, made if missing)."""
    ensure_service_account(k, OPERATOR_NS, CONTROLLER_SA)
    body = {
        "apiVersion": "authentication.k8s.io/v1",
        "kind": "TokenRequest",
        "spec": {"audiences": [audience or agent_audience(node)], "expirationSeconds": seconds},
    }
    path = f"/api/v1/namespaces/{OPERATOR_NS}/serviceaccounts/{CONTROLLER_SA}/token"
    return str(k.create(path, body)["status"]["token"])
