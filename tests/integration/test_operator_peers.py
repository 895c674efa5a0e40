"""The controller writes each DatasetCache's peer token; the webhook hands it to the stager only.

Real kube-apiserver, the controller and webhook as subprocesses with operator/deploy/'s RBAC
(including the peer-tokens role), a real S3 server.
"""

from __future__ import annotations

import base64

import pytest

import dscache_contract as contract
from dscache_contract.peers import PEER_TOKEN_FILE, PEER_TOKEN_KEY, check_peer_token, peer_secret_name
from tests.integration.test_operator_api import (  # noqa: F401 (fixtures)
    create_job,
    get_cache,
    job_body,
    make_cache,
    ready_cache,
    s3_bucket,
)

pytestmark = pytest.mark.integration


def test_each_cache_gets_its_own_peer_token_and_only_the_stager_mounts_it(kube_api, ready_cache, dscache_operator):  # noqa: F811
    ns, name = ready_cache
    key = dscache_operator.agent_token_file.read_text().strip()
    secret = kube_api.wait_for(
        lambda: kube_api.get(f"/api/v1/namespaces/{ns}/secrets/{peer_secret_name(name)}"),
        timeout=30,
        what="the peer token Secret",
    )
    token = base64.b64decode(secret["data"][PEER_TOKEN_KEY]).decode()
    # The agents' own check accepts it for this cache only.
    assert check_peer_token(key, ns, name, token)
    assert not check_peer_token(key, ns, "other", token) and not check_peer_token(key, "other-ns", name, token)
    # Owned by the cache (garbage-collected with it), and marked as ours.
    cache_uid = get_cache(kube_api, ns, name)["metadata"]["uid"]
    assert [(o["kind"], o["name"], o["uid"]) for o in secret["metadata"]["ownerReferences"]] == [
        ("DatasetCache", name, cache_uid)
    ]
    assert secret["metadata"]["labels"]["dscache.io/peer-token"] == "true"
    # The webhook mounts it, read-only and optional, into the stager and nowhere else.
    job = create_job(kube_api, ns, job_body("peer-train", name))
    spec = job["spec"]["template"]["spec"]
    (vol,) = [v for v in spec["volumes"] if v["name"] == contract.peers.PEER_VOLUME_NAME]
    assert vol["secret"] == {"secretName": peer_secret_name(name), "optional": True, "defaultMode": 0o444}
    (init,) = spec["initContainers"]
    assert contract.StageArgs.from_argv(init["args"]).peer_token_file == PEER_TOKEN_FILE
    assert {"name": vol["name"], "mountPath": contract.peers.PEER_TOKEN_DIR, "readOnly": True} in init["volumeMounts"]
    for c in spec["containers"]:
        assert all(m["name"] != vol["name"] for m in c.get("volumeMounts") or []), c


def test_a_secret_of_that_name_that_is_not_ours_is_left_alone(
    kube_api,
    dscache_operator,
    s3_server,
    s3_bucket,  # noqa: F811
    opted_ns,
):
    name = "squatted"
    theirs = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": peer_secret_name(name)},
        "data": {PEER_TOKEN_KEY: base64.b64encode(b"not-a-token").decode()},
    }
    kube_api.create(f"/api/v1/namespaces/{opted_ns}/secrets", theirs)
    make_cache(kube_api, opted_ns, name, f"s3://{s3_bucket}/data/", s3_server.endpoint)
    kube_api.wait_for(
        lambda: (get_cache(kube_api, opted_ns, name).get("status") or {}).get("conditions"),
        timeout=30,
        what="the cache's first reconciliation",
    )
    secret = kube_api.get(f"/api/v1/namespaces/{opted_ns}/secrets/{peer_secret_name(name)}")
    assert base64.b64decode(secret["data"][PEER_TOKEN_KEY]) == b"not-a-token"
    assert "ownerReferences" not in secret["metadata"]
