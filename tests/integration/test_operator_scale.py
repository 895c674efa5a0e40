"""The controller keeps every cache converging when the API server refuses its writes for a while.

Issue 19: at 10,000 caches, 4% of them stayed Pending forever. Each cache had a
kopf timer, and a timer whose status write failed (a request timing out behind
thousands of others on the same connections, a 403, a 422) ended for good:
kopf never restarts a timer that raised. Here the API server refuses every
status write of the test namespace's caches (a ValidatingAdmissionPolicy
answering 422, which kopf does not retry at all) until the controller has
tried each of them; once writes are allowed again, every cache must converge.
"""

from __future__ import annotations

import pytest

from tests.support.kubeapi import ApiError, KubeAPI
from tests.support.s3server import ACCESS_KEY, SECRET_KEY

from .test_operator_api import DSC, FILES, grant_secret_read, make_cache, make_secret

pytestmark = pytest.mark.integration

CACHES = 30
VAP = "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicies"
VAPB = "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicybindings"


def refuse_status_writes(k: KubeAPI, ns: str) -> str:
    name = f"refuse-status-{ns}"
    k.create(
        VAP,
        {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingAdmissionPolicy",
            "metadata": {"name": name},
            "spec": {
                "failurePolicy": "Fail",
                "matchConstraints": {
                    "resourceRules": [
                        {
                            "apiGroups": ["dscache.io"],
                            "apiVersions": ["*"],
                            "operations": ["UPDATE"],
                            "resources": ["datasetcaches/status"],
                        }
                    ]
                },
                "validations": [
                    {"expression": "false", "message": "status writes refused (test)", "reason": "Invalid"}
                ],
            },
        },
    )
    k.create(
        VAPB,
        {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingAdmissionPolicyBinding",
            "metadata": {"name": name},
            "spec": {
                "policyName": name,
                "validationActions": ["Deny"],
                "matchResources": {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns}}},
            },
        },
    )
    return name


def status_of(k: KubeAPI, ns: str) -> list[dict]:
    return [c.get("status") or {} for c in k.request("GET", DSC.format(ns=ns))["items"]]


@pytest.fixture
def s3_bucket(s3_server, bucket):
    s3_server.put_tree(bucket, FILES)
    return bucket


def test_caches_whose_status_writes_were_refused_still_converge(
    kube_api, dscache_operator, s3_server, s3_bucket, opted_ns
):
    k, ns = kube_api, opted_ns
    make_secret(k, ns, "s3-keys", ACCESS_KEY, SECRET_KEY)
    grant_secret_read(k, ns)
    policy = refuse_status_writes(k, ns)
    try:
        # The policy is in force once a status write of ours is refused.
        make_cache(k, ns, "probe", f"s3://{s3_bucket}/data/", s3_server.endpoint, "s3-keys")

        def refused() -> bool:
            try:
                k.merge_patch(f"{DSC.format(ns=ns)}/probe/status", {"status": {"reason": "probe"}})
            except ApiError as e:
                return e.status == 422
            return False

        k.wait_for(refused, timeout=30, what="status writes refused")
        for i in range(CACHES):
            make_cache(k, ns, f"ds-{i}", f"s3://{s3_bucket}/data/", s3_server.endpoint, "s3-keys")

        # The controller has tried (and been refused) every one of them.
        def refused_each() -> bool:
            # From the API server's audit log: the controller's status writes it refused, per cache.
            refused = {
                e["objectRef"].get("name")
                for e in k.audit_events()
                if e["user"]["username"].endswith(":dscache-controller")
                and e.get("verb") == "patch"
                and e["objectRef"].get("namespace") == ns
                and e["objectRef"].get("subresource") == "status"
                and (e.get("responseStatus") or {}).get("code") == 422
            }
            return len(refused - {"probe"}) == CACHES

        k.wait_for(refused_each, timeout=60, interval=0.5, what="every cache's status write refused")
        # (The probe may have got a status before the policy was in force; the others came after.)
        written = [c["metadata"]["name"] for c in k.request("GET", DSC.format(ns=ns))["items"] if c.get("status")]
        assert set(written) <= {"probe"}, f"status writes got through the policy: {written}"
    finally:
        k.delete(f"{VAPB}/{policy}")
        k.delete(f"{VAP}/{policy}")

    def converged() -> bool:
        statuses = status_of(k, ns)
        return len(statuses) == CACHES + 1 and all(s.get("phase") == "Ready" for s in statuses)

    k.wait_for(converged, timeout=60, interval=1, what=f"all {CACHES + 1} caches Ready")
