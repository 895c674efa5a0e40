"""11. Pod identity: a cache with spec.source.serviceAccountName and no Secret (before test_12,
whose README release replaces the session's and has no podIdentity.stsEndpoint).

The STS is the checking one of tests/support/sts.py, in a pod of this namespace
(e2e/support/sts.py): it verifies every token's signature against the cluster's JWKS,
its issuer, audience, expiry, and that its subject is the one ServiceAccount the role
trusts, and only then hands out the suite's S3 keys. The release points the controller
and the stagers at it (podIdentity.stsEndpoint, conftest.py).
"""

import json

import pytest
from conftest import RELEASE_NS, assert_complete, cache_status, describe_pods, job_pods, wait_job
from support import sts
from support import workloads as w
from support.kube import wait_for

ROLE = "arn:aws:iam::000000000000:role/e2e-dataset-reader"


def _service_account(name: str, ns: str) -> dict:
    annotations = {"eks.amazonaws.com/role-arn": ROLE}
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": {"name": name, "namespace": ns, "annotations": annotations},
    }


@pytest.fixture(scope="module")
def identity_sts(cfg, kube, release, namespaces):
    ns = namespaces["main"]
    roles = {
        ROLE: {
            "subject": f"system:serviceaccount:{ns}:e2e-reader",
            "access_key": cfg.s3["AWS_ACCESS_KEY_ID"],
            "secret_key": cfg.s3["AWS_SECRET_ACCESS_KEY"],
        }
    }
    kube.apply(sts.manifests(ns, cfg.stager_image, cfg.pull_policy, roles))
    kube.apply([_service_account("e2e-reader", ns), _service_account("e2e-intruder", ns)])
    wait_for(
        "the STS pod Ready",
        lambda: any(
            c.get("type") == "Ready" and c.get("status") == "True"
            for c in ((kube.get("pod", sts.NAME, ns) or {}).get("status") or {}).get("conditions") or []
        ),
        timeout=120,
        describe=lambda: kube.kubectl("describe", "pod", sts.NAME, "-n", ns, check=False).stdout[-3000:],
    )
    yield ns
    for kind in ("pod", "service", "configmap"):
        kube.delete(kind, sts.NAME, ns)


def _sts_log(kube, ns: str) -> str:
    return kube.kubectl("logs", sts.NAME, "-n", ns, check=False).stdout


def _stager_message(pod: dict) -> str:
    for cs in (pod.get("status") or {}).get("initContainerStatuses") or []:
        if cs.get("name") == w.INIT_NAME:
            term = (cs.get("state") or {}).get("terminated") or (cs.get("lastState") or {}).get("terminated") or {}
            return f"exit {term.get('exitCode')}: {term.get('message') or ''}"
    return ""


def test_pod_identity_cache(cfg, kube, dataset, identity_sts):
    ns = identity_sts
    controller_env = kube.kubectl(
        "get", "deploy", "-n", RELEASE_NS, "-o", "jsonpath={.items[*].spec.template.spec.containers[*].env}"
    ).stdout
    assert sts.endpoint(ns) in controller_env, "the release was installed without podIdentity.stsEndpoint"

    # 1. No Secret, a ServiceAccount: Ready with a revision, listed as that ServiceAccount.
    name = "podid"
    body = w.dataset_cache(name, ns, dataset, cfg.endpoint_pod, None)
    body["spec"]["source"]["serviceAccountName"] = "e2e-reader"
    kube.apply(body)
    st = wait_for(
        f"DatasetCache {ns}/{name} Ready with a revision",
        lambda: (lambda s: s if s.get("phase") == "Ready" and s.get("revision") else None)(
            cache_status(kube, ns, name)
        ),
        timeout=90,
        describe=lambda: json.dumps(cache_status(kube, ns, name), indent=1) + "\n" + _sts_log(kube, ns)[-2000:],
    )
    assert st["objects"] == len(dataset.files), st
    subject = f"system:serviceaccount:{ns}:e2e-reader"
    assert [ROLE, subject, "ok"] in sts.decisions(_sts_log(kube, ns))

    # 2. A Job running as that ServiceAccount: admitted, its stager staged with the pod's own projected token.
    job = "train-podid"
    spec = w.training_job(job, ns, name, cfg.stager_image, dataset)
    spec["spec"]["template"]["spec"]["serviceAccountName"] = "e2e-reader"
    kube.create(spec)
    tpl = kube.get("job", job, ns)["spec"]["template"]["spec"]
    stager = next(c for c in tpl["initContainers"] if c["name"] == w.INIT_NAME)
    env = {e["name"]: e.get("value") for e in stager["env"]}
    assert env["AWS_ROLE_ARN"] == ROLE and env["AWS_ENDPOINT_URL_STS"] == sts.endpoint(ns), env
    assert "AWS_ACCESS_KEY_ID" not in env, env
    assert_complete(kube, ns, job)
    (pod,) = job_pods(kube, ns, job)
    assert _stager_message(pod).startswith("exit 0"), _stager_message(pod)

    # 3. A pod of another ServiceAccount that claims the same role: the STS refuses its token, the
    #    stage fails with that reason, and the training container never runs.
    job = "train-intruder"
    spec = w.training_job(job, ns, name, cfg.stager_image, dataset)
    spec["spec"]["template"]["spec"]["serviceAccountName"] = "e2e-intruder"
    # A node that already holds the revision does not hide the refusal: the stager serves a copy
    # only to a pod that may read the source (it asks the bucket first).
    kube.create(spec)
    assert wait_job(kube, ns, job) == "Failed", describe_pods(kube, ns, f"job-name={job}")
    (pod,) = job_pods(kube, ns, job)
    message = _stager_message(pod)
    assert message.startswith("exit 3") and "STS refused this pod's web identity" in message, message
    assert "AccessDenied" in message, message
    intruder = f"system:serviceaccount:{ns}:e2e-intruder"
    refused = [d for d in sts.decisions(_sts_log(kube, ns)) if d[1] == intruder]
    assert refused and all(d[2] != "ok" for d in refused), refused
    assert kube.logs(pod["metadata"]["name"], ns, w.TRAIN_CONTAINER).strip() == ""
