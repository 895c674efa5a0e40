"""Issue 29: the webhook hands the stager (only) its pod's projected token for the agents; the
controller writes no per-cache peer Secret any more (no shared key to derive one from).

Real kube-apiserver, the controller and webhook as subprocesses with operator/deploy/'s RBAC,
a real S3 server.
"""

from __future__ import annotations

import pytest

import dscache_contract as contract
from dscache_contract.peers import PEER_AUDIENCE, PEER_TOKEN_EXPIRY_S, PEER_TOKEN_FILE
from tests.integration.test_operator_api import (  # noqa: F401 (fixtures)
    create_job,
    get_cache,
    job_body,
    make_cache,
    ready_cache,
    s3_bucket,
)

pytestmark = pytest.mark.integration


def test_the_stager_alone_gets_its_pods_projected_token(kube_api, ready_cache, dscache_operator):  # noqa: F811
    ns, name = ready_cache
    job = create_job(kube_api, ns, job_body("peer-train", name))
    spec = job["spec"]["template"]["spec"]
    (vol,) = [v for v in spec["volumes"] if v["name"] == contract.peers.PEER_VOLUME_NAME]
    assert vol["projected"] == {
        "defaultMode": 0o444,
        "sources": [
            {
                "serviceAccountToken": {
                    "audience": PEER_AUDIENCE,
                    "expirationSeconds": PEER_TOKEN_EXPIRY_S,
                    "path": "token",
                }
            }
        ],
    }
    (init,) = spec["initContainers"]
    assert contract.StageArgs.from_argv(init["args"]).peer_token_file == PEER_TOKEN_FILE
    assert {"name": vol["name"], "mountPath": contract.peers.PEER_TOKEN_DIR, "readOnly": True} in init["volumeMounts"]
    for c in spec["containers"]:
        assert all(m["name"] != vol["name"] for m in c.get("volumeMounts") or []), c
    # No Secret written for the cache: the controller holds no key to make one from.
    secrets = kube_api.get(f"/api/v1/namespaces/{ns}/secrets") or {}
    assert not [s for s in secrets.get("items") or [] if s["metadata"]["name"].startswith("dscache-peer-")]
