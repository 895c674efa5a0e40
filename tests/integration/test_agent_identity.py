"""Issue 29: the node agents trust Kubernetes identity, not a shared key.

Real kube-apiserver (its service-account issuer signs the tokens; the agents verify them
against its published keys, issue 30, or by TokenReview when they cannot read them), real
dscache-node processes running as the chart's dscache-node ServiceAccount (so the shipped
RBAC is what is exercised: the issuer's discovery URLs, tokenreviews create, pods get).
Every refusal is 401 or 403, and no byte of the object is in the answer.
"""

from __future__ import annotations

import base64
import itertools
import json
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa

import dscache_contract as contract
from dscache_contract.peers import PEER_AUDIENCE, ObjectRequest, agent_audience
from tests.support.agentauth import consumer_pod, controller_token, pod_token, stager_token
from tests.support.kubeapi import REPO, KubeAPI, load_yaml_docs, make_cert
from tests.support.nodeagent import NodeAgent, revision_on_disk, service_account_token, stage_copy

_ids = itertools.count()
#: Bytes no JSON error message could contain by chance.
SECRET = b"dscache-secret-bytes-" + b"\x8e" * 64
REV = "r-" + "a" * 20


@pytest.fixture
def ns(kube_api) -> str:
    return kube_api.namespace(f"ident-{next(_ids)}")


@pytest.fixture
def node_sa(kube_api, tmp_path) -> Path:
    """The agents' own ServiceAccount token: the shipped RBAC (operator/deploy/rbac.yaml)."""
    return service_account_token(kube_api, "dscache-node", tmp_path / "node-sa-token")


def get(agent: NodeAgent, path: str, token: str | None) -> tuple[int, bytes]:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    req = urllib.request.Request(agent.url + path, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def expired_copy(k: KubeAPI, token: str) -> str:
    """``token`` as its issuer would have signed it 20 minutes ago: same claims, expired 10 minutes
    ago, signed with the API server's own service-account key (so only the expiry is wrong)."""

    def part(b64: str) -> dict:
        return json.loads(base64.urlsafe_b64decode(b64 + "=" * (-len(b64) % 4)))

    def enc(obj: dict) -> str:
        return base64.urlsafe_b64encode(json.dumps(obj, separators=(",", ":")).encode()).rstrip(b"=").decode()

    head, body, _ = token.split(".")
    claims = part(body)
    now = int(time.time())
    claims.update(iat=now - 1200, nbf=now - 1200, exp=now - 600)
    key = serialization.load_pem_private_key((k.certs / "sa.key").read_bytes(), password=None)
    assert isinstance(key, rsa.RSAPrivateKey)
    signing_input = f"{enc(part(head))}.{enc(claims)}"
    sig = key.sign(signing_input.encode(), padding.PKCS1v15(), hashes.SHA256())
    return f"{signing_input}.{base64.urlsafe_b64encode(sig).rstrip(b'=').decode()}"


def test_objects_only_for_a_consumer_pod_of_that_cache(kube_api, agents, ns, node_sa):
    k = kube_api
    node, other_node = f"ident-a{next(_ids)}", f"ident-b{next(_ids)}"
    agent = agents.start(node, kube_token_file=node_sa)
    stage_copy(agent.cache_root, ns, "data", REV, files={"f.bin": SECRET})
    path = ObjectRequest(ns, "data", REV, "f.bin").target()

    # A stager of the cache on another node: served (fetch once per cluster).
    good = stager_token(k, ns, "data", other_node)
    assert get(agent, path, good) == (200, SECRET)

    other_ns = k.namespace(f"ident-other-{next(_ids)}")
    refused = {
        "no token": None,
        "garbage": "not.a.jwt",
        # A pod of another namespace that names a cache of the same name.
        "another namespace": stager_token(k, other_ns, "data", other_node),
        # A pod of the right namespace that is no consumer (names no cache), and one of another cache.
        "not a consumer": pod_token(k, consumer_pod(k, ns, None, other_node, name="bystander")),
        "another cache": stager_token(k, ns, "other-data", other_node),
        # The right pod, the wrong audience (the controller's audience for this node).
        "wrong audience": pod_token(k, consumer_pod(k, ns, "data", other_node), audience=agent_audience(node)),
        # The right pod's token, expired (signed by the API server's key, claims intact but exp).
        "expired": expired_copy(k, good),
        # The controller's own token is no consumer's.
        "controller": controller_token(k, node),
    }
    for what, token in refused.items():
        code, body = get(agent, path, token)
        assert code in (401, 403), (what, code, body)
        assert SECRET not in body, what
    assert get(agent, path, refused["expired"])[0] == 401  # signed by the issuer, but expired

    # A deleted pod's token stops working (bound token; the agent keeps a verdict only so long).
    gone = consumer_pod(k, ns, "data", other_node, name="gone")
    gone_token = pod_token(k, gone)
    k.request("DELETE", f"/api/v1/namespaces/{ns}/pods/gone?gracePeriodSeconds=0")  # no kubelet to wait for
    # Gone from etcd and from the API server's watch cache, which the agent reads first (it lags
    # etcd by milliseconds; the agent's bound for a deleted pod is docs/security.md's 5 minutes).
    gone_path = f"/api/v1/namespaces/{ns}/pods/gone"
    k.wait_for(lambda: k.get(gone_path) is None and k.get(f"{gone_path}?resourceVersion=0") is None, what="pod gone")
    assert get(agent, path, gone_token)[0] == 401
    assert get(agent, path, good) == (200, SECRET)


def counter(agent: NodeAgent, name: str) -> float:
    line = next(x for x in agent.metrics().splitlines() if x.startswith(f"{name}_total "))
    return float(line.split()[-1])


def test_a_token_is_verified_by_the_agent_itself_once(kube_api, agents, ns, node_sa):
    """Issue 30: no TokenReview for a consumer's objects (they were N x N per staging): the agent
    checks the token against the API server's published keys, once, and GETs its pod."""
    agent = agents.start(f"ident-c{next(_ids)}", kube_token_file=node_sa)
    stage_copy(agent.cache_root, ns, "data", REV, files={"f.bin": SECRET})
    path = ObjectRequest(ns, "data", REV, "f.bin").target()
    tokens = [stager_token(kube_api, ns, "data", f"elsewhere-{i}") for i in range(2)]
    for token in tokens:
        for _ in range(5):
            assert get(agent, path, token) == (200, SECRET)
    assert counter(agent, "dscache_node_token_reviews") == 0
    assert counter(agent, "dscache_node_token_local_checks") == 2
    assert "verifying ServiceAccount tokens of issuer https://kubernetes.default.svc locally" in agent.log()


def test_without_the_keys_the_agent_asks_token_review(kube_api, agents, ns):
    """An agent whose identity may not read the issuer's discovery document and keys (a user
    outside system:serviceaccounts, so not even Kubernetes' default grant of them applies; its
    role: the shipped one without those URLs) checks every token by TokenReview, says why once,
    and still refuses what the API server refuses."""
    k = kube_api
    user = f"dscache-node-nojwks-{next(_ids)}"
    make_cert(k.certs, user, f"/CN={user}", usage="clientAuth")
    (shipped,) = [
        d
        for d in load_yaml_docs(REPO / "operator" / "deploy" / "rbac.yaml")
        if d["kind"] == "ClusterRole" and d["metadata"]["name"] == "dscache-node"
    ]
    rules = [r for r in shipped["rules"] if "nonResourceURLs" not in r]
    assert len(rules) == len(shipped["rules"]) - 1
    k.apply_yaml_docs(
        [
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "ClusterRole",
                "metadata": {"name": user},
                "rules": rules,
            },
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "ClusterRoleBinding",
                "metadata": {"name": user},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": user},
                "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}],
            },
        ]
    )
    creds = {"DSCACHE_KUBE_CERT": str(k.certs / f"{user}.crt"), "DSCACHE_KUBE_KEY": str(k.certs / f"{user}.key")}
    agent = agents.start(f"ident-f{next(_ids)}", env_extra=creds)
    stage_copy(agent.cache_root, ns, "data", REV, files={"f.bin": SECRET})
    path = ObjectRequest(ns, "data", REV, "f.bin").target()
    good = stager_token(k, ns, "data", "elsewhere")
    for _ in range(3):
        assert get(agent, path, good) == (200, SECRET)
    assert get(agent, path, expired_copy(k, good))[0] == 401  # never open: the API server refuses it
    assert counter(agent, "dscache_node_token_reviews") == 2
    assert counter(agent, "dscache_node_token_local_checks") == 0
    said = [line for line in agent.log().splitlines() if "checking tokens by TokenReview" in line]
    assert len(said) == 1 and "403" in said[0], said


def test_reservations_only_from_a_consumer_pod_on_this_node(kube_api, agents, ns, node_sa):
    k = kube_api
    node = f"ident-d{next(_ids)}"
    agent = agents.start(node, kube_token_file=node_sa)
    elsewhere = stager_token(k, ns, "data", f"{node}-other")
    code, text = agent.reserve(ns, "data", REV, 1024, token=elsewhere)
    assert code == 403 and "does not run on node" in str(text), (code, text)
    code, text = agent.reserve(ns, "data", REV, 1024, token=stager_token(k, ns, "other", node))
    assert code == 403, (code, text)
    code, text = agent.reserve(ns, "data", REV, 1024, token=controller_token(k, node))
    assert code == 401, (code, text)
    code, answer = agent.reserve(ns, "data", REV, 1024)  # a stager of the cache on this node
    assert code == 200, answer


def test_wipes_only_from_the_controller_for_this_node(kube_api, agents, ns, node_sa):
    k = kube_api
    node = f"ident-e{next(_ids)}"
    agent = agents.start(node, kube_token_file=node_sa)
    stage_copy(agent.cache_root, ns, "data", REV)
    wipe = contract.WipeRequest(ns, "data", revision=REV)
    tenant_pod = consumer_pod(k, ns, "data", node)
    refused = {
        "a tenant's stager token": pod_token(k, tenant_pod),
        # A tenant may mint a token of any audience for its own pods: it is still not the controller.
        "a tenant's token for the agent audience": pod_token(k, tenant_pod, audience=agent_audience(node)),
        "the controller's token for another node": controller_token(k, f"{node}-other"),
        "the controller's token for the peers' audience": controller_token(k, node, audience=PEER_AUDIENCE),
        "garbage": "x" * 40,
    }
    for what, token in refused.items():
        code, text = agent.wipe(wipe, token=token)
        assert code in (401, 403), (what, code, text)
        assert revision_on_disk(agent.cache_root, ns, "data", REV), what
    assert agent.wipe(wipe, token=refused["a tenant's token for the agent audience"])[0] == 403
    code, text = agent.wipe(wipe)  # the controller's token for this node
    assert code == 200, text
    assert not revision_on_disk(agent.cache_root, ns, "data", REV)
