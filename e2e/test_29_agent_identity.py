"""29. The node agents trust Kubernetes identity, not a shared key, over TLS.

- test_agent_trusts_pod_identity: a staged copy on a node; its own stager pod's projected-kind
  token (audience dscache-peer, bound to the pod) reads an object from that node's agent, over
  TLS checked against the chart's CA for the agents' name. A pod of another namespace, a pod of
  the right namespace that names no cache, that pod's token expired (signed with the cluster's
  own service-account key, only ``exp`` in the past), and a tenant's tokens on the wipe endpoint
  all get 401 or 403 and no byte; the copy is still there afterwards. The consumer's token is
  verified by the agent itself (issue 30): its local-check counter moves, its TokenReviews do not
  (this also proves the image carries PyJWT and the chart's RBAC lets the agent read the keys).
"""

from __future__ import annotations

import base64
import json
import time
import uuid
from typing import Any

from conftest import cache_status, send_go, wait_verified
from support import workloads as w
from support.agent import agent_call, agent_log
from support.kube import node_sh

import dscache_contract as contract
from dscache_contract.peers import PEER_AUDIENCE, ObjectRequest, agent_audience

KEY = "labels.json"


def _token(kube, ns: str, sa: str, audience: str, pod: dict[str, Any] | None = None) -> str:
    args = ["create", "token", sa, "-n", ns, "--audience", audience, "--duration", "10m"]
    if pod is not None:
        meta = pod["metadata"]
        args += ["--bound-object-kind", "Pod", "--bound-object-name", meta["name"], "--bound-object-uid", meta["uid"]]
    return kube.kubectl(*args).stdout.strip()


def _bystander(kube, ns: str, image: str) -> dict[str, Any]:
    """A pod of ``ns`` that names no cache (the webhook leaves it alone), bound to a node that does not
    exist: it never runs, but it exists, so a token can be bound to it."""
    name = f"bystander-{uuid.uuid4().hex[:6]}"
    restricted = {
        "allowPrivilegeEscalation": False,
        "runAsNonRoot": True,
        "runAsUser": 65532,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    kube.create(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": ns, "labels": {"e2e": "dscache"}},
            "spec": {
                "nodeName": "dscache-e2e-no-such-node",
                "serviceAccountName": "default",
                "automountServiceAccountToken": False,
                "containers": [{"name": "c", "image": image, "command": ["true"], "securityContext": restricted}],
            },
        }
    )
    return kube.get("pod", name, ns)


def _expired(token: str, sa_key_pem: bytes) -> str:
    """``token`` with the same claims, expired 10 minutes ago, signed with the cluster's own key."""
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import padding, rsa

    def part(b64: str) -> dict:
        return json.loads(base64.urlsafe_b64decode(b64 + "=" * (-len(b64) % 4)))

    def enc(obj: dict) -> str:
        return base64.urlsafe_b64encode(json.dumps(obj, separators=(",", ":")).encode()).rstrip(b"=").decode()

    head, body, _ = token.split(".")
    claims = part(body)
    now = int(time.time())
    claims.update(iat=now - 1200, nbf=now - 1200, exp=now - 600)
    key = serialization.load_pem_private_key(sa_key_pem, password=None)
    assert isinstance(key, rsa.RSAPrivateKey)
    signing_input = f"{enc(part(head))}.{enc(claims)}"
    sig = key.sign(signing_input.encode(), padding.PKCS1v15(), hashes.SHA256())
    return f"{signing_input}.{base64.urlsafe_b64encode(sig).rstrip(b'=').decode()}"


def _token_checks(call) -> tuple[float, float]:
    """The agent's counters: tokens it verified itself, TokenReviews it sent."""
    code, text = call("GET", "/metrics", None)
    assert code == 200, code
    lines = text.decode().splitlines()

    def value(name: str) -> float:
        return float(next(x for x in lines if x.startswith(f"{name}_total ")).split()[-1])

    return value("dscache_node_token_local_checks"), value("dscache_node_token_reviews")


def _control_plane(kube) -> str:
    nodes = kube.items("nodes", selector="node-role.kubernetes.io/control-plane")
    assert nodes, "no control-plane node to read the service-account key from"
    return nodes[0]["metadata"]["name"]


def test_agent_trusts_pod_identity(cfg, kube, cache_factory, dataset, namespaces):
    cache = cache_factory("agentid")
    ns, name = cache["namespace"], cache["name"]
    job = f"agentid-{uuid.uuid4().hex[:6]}"
    kube.create(w.training_job(job, ns, name, cfg.stager_image, dataset, wait=True))
    pod = wait_verified(kube, ns, job)
    others: list[tuple[str, str]] = []
    try:
        node = pod["spec"]["nodeName"]
        rev = cache_status(kube, ns, name)["revision"]["id"]

        def call(method: str, path: str, token: str | None, body: str = "") -> tuple[int, bytes]:
            return agent_call(kube, node, method, path, token, body)

        path = ObjectRequest(ns, name, rev, KEY).target()
        want = dataset.files[KEY]
        sa = pod["spec"].get("serviceAccountName") or "default"

        # The consumer's own token (as its projected volume holds it): served, over TLS, verified
        # by the agent itself against the cluster's published keys (issue 30): no TokenReview.
        checks_before = _token_checks(call)
        own = _token(kube, ns, sa, PEER_AUDIENCE, pod)
        assert call("GET", path, own) == (200, want), "the cache's own consumer pod must read its objects"
        local, reviews = (after - before for after, before in zip(_token_checks(call), checks_before, strict=True))
        assert local >= 1 and reviews == 0, (local, reviews, agent_log(kube, node)[-2000:])

        other_ns = namespaces["baseline"] if namespaces["baseline"] != ns else namespaces["restricted"]
        stranger = _bystander(kube, other_ns, cfg.stager_image)
        bystander = _bystander(kube, ns, cfg.stager_image)
        others += [(other_ns, stranger["metadata"]["name"]), (ns, bystander["metadata"]["name"])]
        sa_key = node_sh("cat /etc/kubernetes/pki/sa.key", check=True, node=_control_plane(kube)).stdout.encode()
        refused = {
            "no token": None,
            "a pod of another namespace": _token(kube, other_ns, "default", PEER_AUDIENCE, stranger),
            "a pod of this namespace that is no consumer": _token(kube, ns, "default", PEER_AUDIENCE, bystander),
            "the consumer's token, expired": _expired(own, sa_key),
            "the consumer's token for the controller's audience": _token(kube, ns, sa, agent_audience(node), pod),
        }
        for what, token in refused.items():
            code, body = call("GET", path, token)
            assert code in (401, 403) and want not in body, (what, code, body[:200])

        # A tenant's tokens on the wipe endpoint: neither its stager's nor one it minted for the
        # agent's audience is the controller's. Nothing is removed.
        wipe = contract.WipeRequest(ns, name, revision=rev).to_json()
        for what, token in (
            ("the stager's token", own),
            ("a tenant token for dscache-agent/<node>", _token(kube, ns, sa, agent_audience(node))),
        ):
            code, body = call("POST", contract.WIPE_PATH, token, wipe)
            assert code in (401, 403), (what, code, body[:200])
        assert call("GET", path, own) == (200, want), "the copy must still be there"
    finally:
        for other_ns, other in others:
            kube.delete("pod", other, other_ns)
        send_go(kube, ns, pod["metadata"]["name"])
