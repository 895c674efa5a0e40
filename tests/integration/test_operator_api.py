"""The operator against a real kube-apiserver + etcd + S3 server (versitygw).

The controller and the webhook run as subprocesses with the ServiceAccounts
and RBAC of operator/deploy/, and the API server calls the webhook over TLS
through the MutatingWebhookConfiguration of operator/deploy/webhook.yaml.
There is no kubelet and no job controller: the tests patch pod and Job status
the way those components would.
"""

from __future__ import annotations

import base64
import copy
import json
import subprocess
import threading
import time

import pytest

from dscache_contract import RevisionHasher, StageArgs, WipeArgs
from tests.support.kubeapi import OPERATOR_NS, ApiError, KubeAPI
from tests.support.tools import kubectl

pytestmark = pytest.mark.integration

DSC = "/apis/dscache.io/v1alpha1/namespaces/{ns}/datasetcaches"
SUMMARY = {"objects": 3, "bytes": 35, "skipped": 0, "fetched_bytes": 35, "seconds": 0.42, "mb_s": 0.1}
FILES = {"data/a.bin": b"a" * 10, "data/b.bin": b"b" * 10, "data/sub/c.bin": b"c" * 15, "data/skip.tmp": b"x" * 100}


# --- helpers ------------------------------------------------------------------------


def b64(s: str) -> str:
    return base64.b64encode(s.encode()).decode()


def make_secret(k: KubeAPI, ns: str, name: str, key_id: str, secret: str) -> None:
    k.create(
        f"/api/v1/namespaces/{ns}/secrets",
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": name},
            "data": {"AWS_ACCESS_KEY_ID": b64(key_id), "AWS_SECRET_ACCESS_KEY": b64(secret)},
        },
    )


def grant_secret_read(k: KubeAPI, ns: str) -> None:
    """What the chart does for each watched namespace (operator/deploy/rbac-secrets.yaml)."""
    from tests.support.kubeapi import REPO, load_yaml_docs

    (rb,) = load_yaml_docs(REPO / "operator" / "deploy" / "rbac-secrets.yaml")
    rb["metadata"]["namespace"] = ns
    k.apply_yaml_docs([rb])


def make_cache(
    k: KubeAPI, ns: str, name: str, uri: str, endpoint: str | None = None, secret: str | None = None, **spec
) -> dict:
    source: dict = {"uri": uri}
    if endpoint:
        source.update(endpoint=endpoint, region="us-east-1", addressingStyle="path")
    if secret:
        source["credentials"] = {"secretRef": {"name": secret}}
    body = {
        "apiVersion": "dscache.io/v1alpha1",
        "kind": "DatasetCache",
        "metadata": {"name": name},
        "spec": {"source": source, "mountPath": "/data", **spec},
    }
    return k.create(DSC.format(ns=ns), body)


def get_cache(k: KubeAPI, ns: str, name: str) -> dict | None:
    return k.get(f"{DSC.format(ns=ns)}/{name}")


def wait_phase(k: KubeAPI, ns: str, name: str, phase: str, timeout: float = 30) -> dict:
    def ready():
        c = get_cache(k, ns, name)
        return c if c and (c.get("status") or {}).get("phase") == phase else None

    return k.wait_for(ready, timeout, what=f"{ns}/{name} phase {phase}")


def condition(cache: dict, type_: str = "SourceReady") -> dict:
    return next(c for c in cache["status"]["conditions"] if c["type"] == type_)


def node_entry(k: KubeAPI, ns: str, name: str, node: str) -> dict | None:
    c = get_cache(k, ns, name) or {}
    return next((n for n in (c.get("status") or {}).get("nodes", []) if n["node"] == node), None)


def wait_node_state(k: KubeAPI, ns: str, name: str, node: str, state: str, timeout: float = 30) -> dict:
    """Wait until the cache's status shows ``node`` in ``state``; return that entry."""
    return k.wait_for(
        lambda: (lambda n: n if n and n["state"] == state else None)(node_entry(k, ns, name, node)),
        timeout=timeout,
        what=f"{node} {state}",
    )


def job_body(name: str, cache: str | None, *, template_annotation: bool = False, mounts=None) -> dict:
    meta: dict = {"name": name}
    tmeta: dict = {}
    if cache and template_annotation:
        tmeta["annotations"] = {"dscache.io/cache": cache}
    elif cache:
        meta["annotations"] = {"dscache.io/cache": cache}
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": meta,
        "spec": {
            "backoffLimit": 0,
            "template": {
                "metadata": tmeta,
                "spec": {
                    "restartPolicy": "Never",
                    "securityContext": {"runAsNonRoot": True, "runAsUser": 1000},
                    "containers": [
                        {
                            "name": "train",
                            "image": "trainer:1",
                            "command": ["python", "train.py"],
                            "volumeMounts": mounts or [],
                        }
                    ],
                },
            },
        },
    }


def create_job(k: KubeAPI, ns: str, body: dict) -> dict:
    return k.create(f"/apis/batch/v1/namespaces/{ns}/jobs", body)


def ensure_node(k: KubeAPI, node: str) -> None:
    """A Node object as a kubelet would register it (the operator starts no wipe helper on a
    node the API server does not have)."""
    try:
        k.create("/api/v1/nodes", {"apiVersion": "v1", "kind": "Node", "metadata": {"name": node}})
    except ApiError as e:
        if e.status != 409:
            raise


def start_job_pod(k: KubeAPI, ns: str, job: dict, node: str, suffix: str = "0", dry_run: bool = False) -> dict:
    """What the job controller and the scheduler do: a pod from the template, bound to a node.
    ``dry_run`` asks admission (our webhook included) without creating the pod."""
    ensure_node(k, node)
    template = job["spec"]["template"]
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"{job['metadata']['name']}-{suffix}",
            "labels": dict(template["metadata"].get("labels") or {}),
            "annotations": dict(template["metadata"].get("annotations") or {}),
            "ownerReferences": [
                {
                    "apiVersion": "batch/v1",
                    "kind": "Job",
                    "name": job["metadata"]["name"],
                    "uid": job["metadata"]["uid"],
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        },
        "spec": {**copy.deepcopy(template["spec"]), "nodeName": node},
    }
    return k.create(f"/api/v1/namespaces/{ns}/pods" + ("?dryRun=All" if dry_run else ""), pod)


def now_rfc3339(offset: float = 0) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + offset))


def kubelet_status(
    k: KubeAPI,
    ns: str,
    pod: str,
    *,
    phase: str,
    init: str,
    message: str = "",
    exit_code: int = 0,
    started: str | None = None,
) -> None:
    """Patch pod status as a kubelet would: the dscache-stage init container's state."""
    started = started or now_rfc3339(-2)
    if init == "running":
        state = {"running": {"startedAt": started}}
    else:
        state = {
            "terminated": {
                "exitCode": exit_code,
                "reason": "Completed" if exit_code == 0 else "Error",
                "message": message,
                "startedAt": started,
                "finishedAt": now_rfc3339(),
            }
        }
    status = {
        "phase": phase,
        "initContainerStatuses": [
            {
                "name": "dscache-stage",
                "ready": init != "running",
                "restartCount": 0,
                "image": "dscache-stager:test",
                "imageID": "",
                "state": state,
            }
        ],
        "containerStatuses": [
            {
                "name": "train",
                "ready": phase == "Running",
                "restartCount": 0,
                "image": "trainer:1",
                "imageID": "",
                "state": {"running": {"startedAt": now_rfc3339()}}
                if phase == "Running"
                else {
                    "terminated": {
                        "exitCode": 0,
                        "reason": "Completed",
                        "startedAt": started,
                        "finishedAt": now_rfc3339(),
                    }
                }
                if phase == "Succeeded"
                else {"waiting": {"reason": "PodInitializing"}},
            }
        ],
    }
    k.merge_patch(f"/api/v1/namespaces/{ns}/pods/{pod}/status", {"status": status})


def complete_job(k: KubeAPI, ns: str, name: str, failed: bool = False) -> None:
    """Patch Job status as the job controller would on completion."""
    t = now_rfc3339()
    if failed:
        conds = [
            {
                "type": "FailureTarget",
                "status": "True",
                "reason": "BackoffLimitExceeded",
                "message": "x",
                "lastProbeTime": t,
                "lastTransitionTime": t,
            },
            {
                "type": "Failed",
                "status": "True",
                "reason": "BackoffLimitExceeded",
                "message": "x",
                "lastProbeTime": t,
                "lastTransitionTime": t,
            },
        ]
        status = {
            "startTime": now_rfc3339(-5),
            "failed": 1,
            "conditions": conds,
            "uncountedTerminatedPods": {},
            "ready": 0,
            "active": 0,
        }
    else:
        conds = [
            {
                "type": "SuccessCriteriaMet",
                "status": "True",
                "reason": "CompletionsReached",
                "message": "x",
                "lastProbeTime": t,
                "lastTransitionTime": t,
            },
            {
                "type": "Complete",
                "status": "True",
                "reason": "CompletionsReached",
                "message": "x",
                "lastProbeTime": t,
                "lastTransitionTime": t,
            },
        ]
        status = {
            "startTime": now_rfc3339(-5),
            "completionTime": t,
            "succeeded": 1,
            "conditions": conds,
            "uncountedTerminatedPods": {},
            "ready": 0,
            "active": 0,
        }
    k.merge_patch(f"/apis/batch/v1/namespaces/{ns}/jobs/{name}/status", {"status": status})


def helper_pods(k: KubeAPI) -> list[dict]:
    return k.request(
        "GET", f"/api/v1/namespaces/{OPERATOR_NS}/pods", params={"labelSelector": "app.kubernetes.io/name=dscache-wipe"}
    )["items"]


def helper_for(k: KubeAPI, ns: str, cache: str) -> list[dict]:
    return [p for p in helper_pods(k) if p["metadata"]["annotations"].get("dscache.io/wipe-for") == f"{ns}/{cache}"]


def kubelet_runs_helper(k: KubeAPI, pod: dict, exit_code: int = 0, message: str | None = None) -> None:
    t = now_rfc3339()
    if message is None:
        message = "" if exit_code == 0 else "error: boom"
    k.merge_patch(
        f"/api/v1/namespaces/{OPERATOR_NS}/pods/{pod['metadata']['name']}/status",
        {
            "status": {
                "phase": "Succeeded" if exit_code == 0 else "Failed",
                "containerStatuses": [
                    {
                        "name": "wipe",
                        "ready": False,
                        "restartCount": 0,
                        "image": "x",
                        "imageID": "",
                        "state": {
                            "terminated": {
                                "exitCode": exit_code,
                                "startedAt": t,
                                "finishedAt": t,
                                "reason": "Completed",
                                "message": message,
                            }
                        },
                    }
                ],
            }
        },
    )


class HelperWatch:
    """Counts wipe helper pods ADDED in the operator namespace (a real watch)."""

    def __init__(self, k: KubeAPI) -> None:
        self.k = k
        self.added: list[tuple[str, str]] = []
        rv = k.request("GET", f"/api/v1/namespaces/{OPERATOR_NS}/pods")["metadata"]["resourceVersion"]
        self.proc = subprocess.Popen(
            [
                kubectl(),
                "--kubeconfig",
                str(k.kubeconfig),
                "get",
                "--raw",
                f"/api/v1/namespaces/{OPERATOR_NS}/pods?watch=1&resourceVersion={rv}"
                f"&labelSelector=app.kubernetes.io%2Fname%3Ddscache-wipe",
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            ev = json.loads(line)
            if ev["type"] == "ADDED":
                o = ev["object"]
                self.added.append((o["metadata"]["annotations"].get("dscache.io/wipe-for"), o["spec"].get("nodeName")))

    def for_cache(self, ns: str, cache: str) -> list[str]:
        return [node for who, node in self.added if who == f"{ns}/{cache}"]

    def close(self) -> None:
        self.proc.kill()


@pytest.fixture
def s3_bucket(s3_server, bucket):
    s3_server.put_tree(bucket, FILES)
    return bucket


@pytest.fixture
def ready_cache(kube_api, dscache_operator, s3_server, s3_bucket, opted_ns):
    """A DatasetCache over a real bucket, with credentials, in an opted-in namespace."""
    from tests.support.s3server import ACCESS_KEY, SECRET_KEY

    k = kube_api
    make_secret(k, opted_ns, "s3-keys", ACCESS_KEY, SECRET_KEY)
    grant_secret_read(k, opted_ns)
    make_cache(
        k,
        opted_ns,
        "imagenet",
        f"s3://{s3_bucket}/data/",
        s3_server.endpoint,
        "s3-keys",
    )
    wait_phase(k, opted_ns, "imagenet", "Ready")
    return opted_ns, "imagenet"


# --- the API -----------------------------------------------------------------------------


def test_crd_installs_and_explains(kube_api, dscache_operator):
    out = subprocess.run(
        [kubectl(), "--kubeconfig", str(kube_api.kubeconfig), "explain", "datasetcache.spec.retention"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    assert "WipeOnJobCompletion" in out and "ttlAfterLastUse" in out
    crd = kube_api.get("/apis/apiextensions.k8s.io/v1/customresourcedefinitions/datasetcaches.dscache.io")
    assert crd["spec"]["names"]["shortNames"] == ["dsc"]


def test_cel_rejects_ttl_without_retain(kube_api, dscache_operator, opted_ns):
    with pytest.raises(ApiError) as e:
        make_cache(
            kube_api,
            opted_ns,
            "bad",
            "s3://bkt/x/",
            retention={"policy": "WipeOnJobCompletion", "ttlAfterLastUse": "1h"},
        )
    assert e.value.status == 422 and "ttlAfterLastUse" in e.value.body


def test_status_filled_from_real_bucket(kube_api, ready_cache, s3_server):
    ns, name = ready_cache
    c = get_cache(kube_api, ns, name)
    st = c["status"]
    # 4 objects under data/: 10 + 10 + 15 + 100 bytes.
    assert (st["objects"], st["bytes"], st["size"]) == (4, 135, "135 B")
    assert st["observedGeneration"] == c["metadata"]["generation"]
    cond = condition(c)
    assert cond["status"] == "True" and cond["reason"] == "Listed"
    assert "dscache.io/wipe" in c["metadata"]["finalizers"]
    assert not any(k.startswith("kopf.zalando.org") for k in c["metadata"].get("annotations", {}))
    # A spec change is re-checked: exclude the temp file.
    kube_api.merge_patch(f"{DSC.format(ns=ns)}/{name}", {"spec": {"source": {"exclude": ["*.tmp"]}}})
    kube_api.wait_for(
        lambda: (
            get_cache(kube_api, ns, name)["status"].get("objects") == 3
            and get_cache(kube_api, ns, name)["status"]["bytes"] == 35
        ),
        what="re-check after spec change",
    )
    events = kube_api.request("GET", f"/api/v1/namespaces/{ns}/events")["items"]
    assert any(e["reason"] == "SourceChecked" and e["involvedObject"]["name"] == name for e in events)


def test_no_such_bucket(kube_api, dscache_operator, s3_server, opted_ns):
    from tests.support.s3server import ACCESS_KEY, SECRET_KEY

    make_secret(kube_api, opted_ns, "s3-keys", ACCESS_KEY, SECRET_KEY)
    grant_secret_read(kube_api, opted_ns)
    make_cache(kube_api, opted_ns, "nobucket", "s3://does-not-exist/x/", s3_server.endpoint, "s3-keys")
    c = wait_phase(kube_api, opted_ns, "nobucket", "Failed")
    cond = condition(c)
    assert (cond["status"], cond["reason"]) == ("False", "NoSuchBucket")
    assert "does-not-exist" in cond["message"]


def test_bad_secret_conditions(kube_api, dscache_operator, s3_server, s3_bucket, opted_ns):
    grant_secret_read(kube_api, opted_ns)
    make_cache(kube_api, opted_ns, "nosecret", f"s3://{s3_bucket}/data/", s3_server.endpoint, "missing")
    c = wait_phase(kube_api, opted_ns, "nosecret", "Failed")
    assert condition(c)["reason"] == "SecretNotFound" and f"{opted_ns}/missing" in condition(c)["message"]

    make_secret(kube_api, opted_ns, "wrong-keys", "dscache-test", "not-the-secret")
    make_cache(kube_api, opted_ns, "badkeys", f"s3://{s3_bucket}/data/", s3_server.endpoint, "wrong-keys")
    c = wait_phase(kube_api, opted_ns, "badkeys", "Failed")
    assert condition(c)["reason"] == "AccessDenied"


def with_keys(k: KubeAPI, ns: str) -> str:
    from tests.support.s3server import ACCESS_KEY, SECRET_KEY

    make_secret(k, ns, "s3-keys", ACCESS_KEY, SECRET_KEY)
    grant_secret_read(k, ns)
    return "s3-keys"


def test_endpoint_unreachable(kube_api, dscache_operator, opted_ns):
    make_cache(kube_api, opted_ns, "nowhere", "s3://bkt/x/", "http://127.0.0.1:9", with_keys(kube_api, opted_ns))
    c = wait_phase(kube_api, opted_ns, "nowhere", "Failed", timeout=60)
    assert condition(c)["reason"] == "EndpointUnreachable"


def test_pod_identity_without_operator_identity_is_not_verifiable(
    kube_api, dscache_operator, s3_server, s3_bucket, opted_ns
):
    make_cache(kube_api, opted_ns, "irsa", f"s3://{s3_bucket}/data/", s3_server.endpoint)
    c = wait_phase(kube_api, opted_ns, "irsa", "Ready")
    assert (condition(c)["status"], condition(c)["reason"]) == ("Unknown", "NotVerifiable")
    # No revision can be pinned without listing the source: refused, saying why and how to fix it.
    with pytest.raises(ApiError) as e:
        create_job(kube_api, opted_ns, job_body("train", "irsa"))
    assert "no pinned revision" in e.value.body and "secretRef" in e.value.body


def test_secret_without_rolebinding_is_forbidden(kube_api, dscache_operator, s3_server, s3_bucket, opted_ns):
    """Without the per-namespace RoleBinding the controller cannot read Secrets."""
    from tests.support.s3server import ACCESS_KEY, SECRET_KEY

    make_secret(kube_api, opted_ns, "s3-keys", ACCESS_KEY, SECRET_KEY)
    make_cache(kube_api, opted_ns, "forbidden", f"s3://{s3_bucket}/data/", s3_server.endpoint, "s3-keys")
    c = wait_phase(kube_api, opted_ns, "forbidden", "Failed")
    assert condition(c)["reason"] == "SecretForbidden"


# --- admission -------------------------------------------------------------------------------


def _injected_counts(pod_spec: dict) -> tuple[int, int, list[int]]:
    inits = [c for c in pod_spec.get("initContainers", []) if c["name"] == "dscache-stage"]
    vols = [v for v in pod_spec.get("volumes", []) if v["name"] == "dscache-data"]
    mounts = [
        len([m for m in c.get("volumeMounts", []) if m["name"] == "dscache-data"]) for c in pod_spec["containers"]
    ]
    return len(inits), len(vols), mounts


def test_job_in_opted_in_namespace_is_injected_once(kube_api, ready_cache):
    ns, name = ready_cache
    job = create_job(kube_api, ns, job_body("train", name))
    spec = job["spec"]["template"]["spec"]
    assert _injected_counts(spec) == (1, 1, [2])
    (vol,) = [v for v in spec["volumes"] if v["name"] == "dscache-data"]
    assert vol["hostPath"] == {"path": f"/var/lib/dscache-test/{ns}/{name}", "type": "DirectoryOrCreate"}
    (init,) = spec["initContainers"]
    assert init["image"] == "dscache-stager:test"
    assert {e["name"] for e in init["env"] if "valueFrom" in e} >= {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}
    rev = get_cache(kube_api, ns, name)["status"]["revision"]["id"]
    assert job["spec"]["template"]["metadata"]["annotations"]["dscache.io/revision"] == rev
    assert StageArgs.from_argv(init["args"]).revision == rev
    train = spec["containers"][0]
    assert {e["name"]: e.get("value") for e in train["env"]} == {
        "DSCACHE_DIR": "/data",
        "DSCACHE_MANIFEST": "/var/run/dscache/manifest.jsonl",
        "DSCACHE_REVISION": rev,
    }
    assert {"name": "dscache-data", "mountPath": "/data", "readOnly": True, "subPath": f"revs/{rev}/data"} in train[
        "volumeMounts"
    ]
    # The pod the job controller creates from it passes the webhook again: still one of each.
    pod = start_job_pod(kube_api, ns, job, "node-a")
    assert _injected_counts(pod["spec"]) == (1, 1, [2])


def test_template_annotation_and_bare_pod(kube_api, ready_cache):
    ns, name = ready_cache
    job = create_job(kube_api, ns, job_body("tmpl", name, template_annotation=True))
    assert _injected_counts(job["spec"]["template"]["spec"]) == (1, 1, [2])
    assert job["metadata"]["annotations"]["dscache.io/cache"] == name
    pod = kube_api.create(
        f"/api/v1/namespaces/{ns}/pods",
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "pytorchjob-worker-0", "annotations": {"dscache.io/cache": name}},
            "spec": {"containers": [{"name": "pytorch", "image": "t"}, {"name": "sidecar", "image": "s"}]},
        },
    )
    assert _injected_counts(pod["spec"]) == (1, 1, [2, 2])


def test_namespace_not_opted_in_is_untouched(kube_api, dscache_operator):
    ns = kube_api.namespace("plain-ns")
    body = job_body("train", "imagenet")
    job = create_job(kube_api, ns, body)
    assert "initContainers" not in job["spec"]["template"]["spec"]
    assert job["spec"]["template"]["spec"]["containers"][0].get("volumeMounts") is None


def test_unknown_cache_is_refused(kube_api, dscache_operator, opted_ns):
    with pytest.raises(ApiError) as e:
        create_job(kube_api, opted_ns, job_body("train", "no-such-cache"))
    msg = e.value.body
    assert f"DatasetCache {opted_ns}/no-such-cache does not exist" in msg
    assert "dscache.io/cache" in msg
    assert kube_api.get(f"/apis/batch/v1/namespaces/{opted_ns}/jobs/train") is None


def test_broken_cache_is_refused(kube_api, dscache_operator, opted_ns):
    make_cache(kube_api, opted_ns, "broken", "s3://bkt/x/", "http://127.0.0.1:9", with_keys(kube_api, opted_ns))
    wait_phase(kube_api, opted_ns, "broken", "Failed", timeout=60)
    with pytest.raises(ApiError) as e:
        create_job(kube_api, opted_ns, job_body("train", "broken"))
    assert f"DatasetCache {opted_ns}/broken is broken: EndpointUnreachable" in e.value.body


def test_mount_clash_is_refused(kube_api, ready_cache):
    ns, name = ready_cache
    with pytest.raises(ApiError) as e:
        create_job(kube_api, ns, job_body("clash", name, mounts=[{"name": "x", "mountPath": "/data"}]))
    assert "clashes" in e.value.body and name in e.value.body


def test_emptydir_namespace(kube_api, dscache_operator, s3_server, s3_bucket):
    from tests.support.s3server import ACCESS_KEY, SECRET_KEY

    ns = kube_api.namespace(
        "ml-baseline", {"dscache.io/injection": "enabled", "pod-security.kubernetes.io/enforce": "baseline"}
    )
    make_secret(kube_api, ns, "s3-keys", ACCESS_KEY, SECRET_KEY)
    grant_secret_read(kube_api, ns)
    make_cache(kube_api, ns, "ds", f"s3://{s3_bucket}/data/", s3_server.endpoint, "s3-keys")
    wait_phase(kube_api, ns, "ds", "Ready")
    job = create_job(kube_api, ns, job_body("train", "ds"))
    spec = job["spec"]["template"]["spec"]
    (vol,) = [v for v in spec["volumes"] if v["name"] == "dscache-data"]
    assert vol == {"name": "dscache-data", "emptyDir": {}}
    assert spec["initContainers"][0]["securityContext"]["runAsNonRoot"] is True
    # The kubelet removes emptyDir copies with their pods: Wiped without a helper pod.
    pod = start_job_pod(kube_api, ns, job, "node-e")
    kubelet_status(kube_api, ns, pod["metadata"]["name"], phase="Running", init="done", message=json.dumps(SUMMARY))
    e = wait_node_state(kube_api, ns, "ds", "node-e", "Ready")
    assert e["volume"] == "EmptyDir"
    kubelet_status(kube_api, ns, pod["metadata"]["name"], phase="Succeeded", init="done", message=json.dumps(SUMMARY))
    complete_job(kube_api, ns, "train")
    wait_node_state(kube_api, ns, "ds", "node-e", "Wiped")
    assert helper_for(kube_api, ns, "ds") == []


# --- lifecycle: node state, wipe, deletion, restart ---------------------------------------


def test_job_completion_wipes_the_node_once(kube_api, ready_cache):
    k = kube_api
    ns, name = ready_cache
    watch = HelperWatch(k)
    try:
        job = create_job(k, ns, job_body("train", name))
        pod = start_job_pod(k, ns, job, "node-a")
        kubelet_status(k, ns, pod["metadata"]["name"], phase="Pending", init="running")
        wait_node_state(k, ns, name, "node-a", "Staging")
        kubelet_status(k, ns, pod["metadata"]["name"], phase="Running", init="done", message=json.dumps(SUMMARY))
        e = wait_node_state(k, ns, name, "node-a", "Ready")
        assert (e["bytes"], e["objects"], e["seconds"], e["consumers"]) == (35, 3, 0.42, 1)
        assert get_cache(k, ns, name)["status"]["readyNodes"] == 1

        # A second Job on another node is still running: its copy must stay.
        job2 = create_job(k, ns, job_body("other", name))
        pod2 = start_job_pod(k, ns, job2, "node-b")
        kubelet_status(k, ns, pod2["metadata"]["name"], phase="Running", init="done", message=json.dumps(SUMMARY))

        kubelet_status(k, ns, pod["metadata"]["name"], phase="Succeeded", init="done", message=json.dumps(SUMMARY))
        time.sleep(2.5)
        assert watch.for_cache(ns, name) == [], "wiped while the Job had not completed yet"
        complete_job(k, ns, "train")
        helper = k.wait_for(lambda: helper_for(k, ns, name), what="wipe helper pod")[0]
        assert helper["spec"]["nodeName"] == "node-a"
        assert helper["spec"]["tolerations"] == [{"operator": "Exists"}]
        rev = pod["metadata"]["annotations"]["dscache.io/revision"]
        assert WipeArgs.from_argv(helper["spec"]["containers"][0]["args"]) == WipeArgs(
            cache_dir=f"/var/lib/dscache-test/{ns}/{name}",
            root="/var/lib/dscache-test",
            revision=rev,
            release=(pod["metadata"]["uid"],),
            termination_log="/dev/termination-log",
        )
        time.sleep(2.5)  # several reconciliations while the helper runs: no second helper
        kubelet_runs_helper(k, helper)
        wait_node_state(k, ns, name, "node-a", "Wiped")
        k.wait_for(lambda: not helper_for(k, ns, name), what="helper pod deleted")
        time.sleep(3)
        assert watch.for_cache(ns, name) == ["node-a"], watch.added
        entry = node_entry(k, ns, name, "node-a")
        assert entry["bytes"] == 35 and entry["seconds"] == 0.42 and entry["consumers"] == 0
        assert node_entry(k, ns, name, "node-b")["state"] == "Ready"
    finally:
        watch.close()


def test_a_copy_kept_by_a_stray_entry_gets_no_helper_loop(kube_api, ready_cache):
    """A wipe found the revision held by an entry under leases/ that is no pod's lease
    (no pod's end will ever release it). The node says so, and no helper is started
    again for KEPT_RETRY_S: before keptAt, one started every reconciliation (1 s here)."""
    k = kube_api
    ns, name = ready_cache
    watch = HelperWatch(k)
    try:
        job = create_job(k, ns, job_body("stray", name))
        pod = start_job_pod(k, ns, job, "node-s")
        kubelet_status(k, ns, pod["metadata"]["name"], phase="Succeeded", init="done", message=json.dumps(SUMMARY))
        complete_job(k, ns, "stray")
        helper = k.wait_for(lambda: helper_for(k, ns, name), what="wipe helper")[0]
        rev = pod["metadata"]["annotations"]["dscache.io/revision"]
        summary = {
            "cache": f"/var/lib/dscache-test/{ns}/{name}",
            "revision": rev,
            "released": [pod["metadata"]["uid"]],
            "existed": True,
            "removed": False,
            "stray": [f"leases/{rev}/notes.txt"],
        }
        kubelet_runs_helper(k, helper, message=json.dumps(summary))

        def kept() -> dict | None:
            revs = (node_entry(k, ns, name, "node-s") or {}).get("revisions") or []
            return next((r for r in revs if r["id"] == rev and r.get("keptAt")), None)

        k.wait_for(kept, what="the revision marked kept")
        assert "remove them by hand" in node_entry(k, ns, name, "node-s")["message"]
        k.wait_for(lambda: not helper_for(k, ns, name), what="helper pod deleted")
        time.sleep(5)  # five reconciliations
        assert watch.for_cache(ns, name) == ["node-s"], watch.added
        assert kept().get("wipedAt") is None
    finally:
        watch.close()


def test_failed_stager_shows_failed_node(kube_api, ready_cache):
    k = kube_api
    ns, name = ready_cache
    job = create_job(k, ns, job_body("fails", name))
    pod = start_job_pod(k, ns, job, "node-f")
    kubelet_status(
        k,
        ns,
        pod["metadata"]["name"],
        phase="Failed",
        init="done",
        exit_code=4,
        message="error: not enough free space: need 35 bytes, 0 free",
    )
    e = wait_node_state(k, ns, name, "node-f", "Failed")
    assert "not enough free space" in e["message"]
    events = k.request("GET", f"/api/v1/namespaces/{ns}/events")["items"]
    assert any(ev["reason"] == "NodeFailed" for ev in events)


def test_deleting_the_cache_runs_the_finalizer(kube_api, ready_cache):
    k = kube_api
    ns, name = ready_cache
    job = create_job(k, ns, job_body("train", name))
    pod = start_job_pod(k, ns, job, "node-d")
    kubelet_status(k, ns, pod["metadata"]["name"], phase="Running", init="done", message=json.dumps(SUMMARY))
    wait_node_state(k, ns, name, "node-d", "Ready")
    k.delete(f"{DSC.format(ns=ns)}/{name}")
    # A live consumer blocks the wipe; the cache waits in Deleting.
    k.wait_for(lambda: get_cache(k, ns, name)["status"]["phase"] == "Deleting", what="Deleting")
    time.sleep(2)
    assert helper_for(k, ns, name) == [] and get_cache(k, ns, name) is not None
    # New workloads cannot use a cache being deleted.
    with pytest.raises(ApiError) as e:
        create_job(k, ns, job_body("late", name))
    assert "being deleted" in e.value.body
    kubelet_status(k, ns, pod["metadata"]["name"], phase="Succeeded", init="done", message=json.dumps(SUMMARY))
    complete_job(k, ns, "train")
    helper = k.wait_for(lambda: helper_for(k, ns, name), what="wipe helper on deletion")[0]
    assert helper["spec"]["nodeName"] == "node-d"
    kubelet_runs_helper(k, helper)
    k.wait_for(lambda: get_cache(k, ns, name) is None, timeout=30, what="cache gone after finalizer")
    k.wait_for(lambda: not helper_for(k, ns, name), what="helper deleted")


def test_failed_wipe_is_retried(kube_api, ready_cache):
    k = kube_api
    ns, name = ready_cache
    job = create_job(k, ns, job_body("train", name))
    pod = start_job_pod(k, ns, job, "node-r")
    kubelet_status(k, ns, pod["metadata"]["name"], phase="Succeeded", init="done", message=json.dumps(SUMMARY))
    complete_job(k, ns, "train", failed=True)
    helper = k.wait_for(lambda: helper_for(k, ns, name), what="helper")[0]
    uid = helper["metadata"]["uid"]
    kubelet_runs_helper(k, helper, exit_code=1)
    again = k.wait_for(
        lambda: [p for p in helper_for(k, ns, name) if p["metadata"]["uid"] != uid],
        what="a new helper after the failed one",
    )[0]
    kubelet_runs_helper(k, again)
    wait_node_state(k, ns, name, "node-r", "Wiped")


def test_operator_restart_converges(kube_api, dscache_operator, ready_cache):
    k = kube_api
    op = dscache_operator
    ns, name = ready_cache
    watch = HelperWatch(k)
    try:
        job = create_job(k, ns, job_body("train", name))
        pod = start_job_pod(k, ns, job, "node-x")
        kubelet_status(k, ns, pod["metadata"]["name"], phase="Running", init="done", message=json.dumps(SUMMARY))
        wait_node_state(k, ns, name, "node-x", "Ready")
        # Another Job keeps node-y busy across the restart.
        job2 = create_job(k, ns, job_body("busy", name))
        pod2 = start_job_pod(k, ns, job2, "node-y")
        kubelet_status(k, ns, pod2["metadata"]["name"], phase="Running", init="done", message=json.dumps(SUMMARY))
        wait_node_state(k, ns, name, "node-y", "Ready")

        op.stop("controller", kill=True)  # SIGKILL: no cleanup at all
        kubelet_status(k, ns, pod["metadata"]["name"], phase="Succeeded", init="done", message=json.dumps(SUMMARY))
        complete_job(k, ns, "train")
        time.sleep(1)
        assert helper_for(k, ns, name) == []
        op.start("controller")
        helper = k.wait_for(lambda: helper_for(k, ns, name), timeout=40, what="helper after restart")[0]
        assert helper["spec"]["nodeName"] == "node-x"

        # Killed again while the helper runs: the restarted operator finds the same helper.
        op.stop("controller", kill=True)
        kubelet_runs_helper(k, helper)
        op.start("controller")
        wait_node_state(k, ns, name, "node-x", "Wiped", timeout=40)
        k.wait_for(lambda: not helper_for(k, ns, name), what="helper deleted")
        time.sleep(3)
        assert watch.for_cache(ns, name) == ["node-x"], watch.added
        assert node_entry(k, ns, name, "node-y")["state"] == "Ready"
    finally:
        watch.close()
        if not op.alive("controller"):
            op.start("controller")


def test_an_upgraded_node_gets_one_legacy_wipe_once_its_version_1_pod_ends(kube_api, ready_cache):
    """A pod admitted before the upgrade has no revision annotation: it mounts C itself and
    reads the version 1 copy at its top. That copy is removed (wipe --legacy) only once no
    such pod holds the node, exactly once, and the node then shows Wiped."""
    k = kube_api
    ns, name = ready_cache
    watch = HelperWatch(k)
    try:
        job = create_job(k, ns, job_body("v1job", name))
        pod = start_job_pod(k, ns, job, "node-v1")
        pname = pod["metadata"]["name"]
        # As a version 1 webhook admitted it (this one only mutates on CREATE).
        k.merge_patch(
            f"/api/v1/namespaces/{ns}/pods/{pname}", {"metadata": {"annotations": {"dscache.io/revision": None}}}
        )
        kubelet_status(k, ns, pname, phase="Running", init="done", message=json.dumps(SUMMARY))

        def legacy() -> dict | None:
            revs = (node_entry(k, ns, name, "node-v1") or {}).get("revisions") or []
            return next((r for r in revs if r["id"] == "legacy"), None)

        k.wait_for(lambda: (legacy() or {}).get("consumers") == 1, what="the version 1 copy listed, held")
        kubelet_status(k, ns, pname, phase="Succeeded", init="done", message=json.dumps(SUMMARY))
        time.sleep(2.5)  # its Job still runs (it may recreate the pod): kept
        assert watch.for_cache(ns, name) == [], "the version 1 copy was wiped while its Job ran"
        complete_job(k, ns, "v1job")
        helper = k.wait_for(lambda: helper_for(k, ns, name), what="legacy wipe helper")[0]
        assert helper["spec"]["nodeName"] == "node-v1"
        assert WipeArgs.from_argv(helper["spec"]["containers"][0]["args"]) == WipeArgs(
            cache_dir=f"/var/lib/dscache-test/{ns}/{name}",
            root="/var/lib/dscache-test",
            legacy=True,
            termination_log="/dev/termination-log",
        )
        summary = {"cache": "/c", "legacy": True, "existed": True, "removed": True, "legacy_entries": 4}
        kubelet_runs_helper(k, helper, message=json.dumps(summary))
        wait_node_state(k, ns, name, "node-v1", "Wiped")
        assert (legacy() or {}).get("wipedAt")
        k.wait_for(lambda: not helper_for(k, ns, name), what="helper pod deleted")
        time.sleep(3)
        assert watch.for_cache(ns, name) == ["node-v1"], watch.added
    finally:
        watch.close()


def test_bare_pod_completion_wipes(kube_api, ready_cache):
    """A pod with no Job (e.g. one worker of another operator's workload): its end frees the node."""
    k = kube_api
    ns, name = ready_cache
    ensure_node(k, "node-p")
    pod = k.create(
        f"/api/v1/namespaces/{ns}/pods",
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "worker-0", "annotations": {"dscache.io/cache": name}},
            "spec": {"nodeName": "node-p", "containers": [{"name": "train", "image": "t"}]},
        },
    )
    assert pod["metadata"]["labels"]["dscache.io/consumer"] == "true"
    kubelet_status(k, ns, "worker-0", phase="Running", init="done", message=json.dumps(SUMMARY))
    wait_node_state(k, ns, name, "node-p", "Ready")
    assert helper_for(k, ns, name) == []
    kubelet_status(k, ns, "worker-0", phase="Succeeded", init="done", message=json.dumps(SUMMARY))
    helper = k.wait_for(lambda: helper_for(k, ns, name), what="helper")[0]
    assert helper["spec"]["nodeName"] == "node-p"
    kubelet_runs_helper(k, helper)
    wait_node_state(k, ns, name, "node-p", "Wiped")


def test_retain_while_used_keeps_then_expires(kube_api, dscache_operator, s3_server, s3_bucket, opted_ns):
    k = kube_api
    make_cache(
        k,
        opted_ns,
        "kept",
        f"s3://{s3_bucket}/data/",
        s3_server.endpoint,
        with_keys(k, opted_ns),
        retention={"policy": "RetainWhileUsed", "ttlAfterLastUse": "4s"},
    )
    wait_phase(k, opted_ns, "kept", "Ready")
    job = create_job(k, opted_ns, job_body("train", "kept"))
    pod = start_job_pod(k, opted_ns, job, "node-k")
    kubelet_status(k, opted_ns, pod["metadata"]["name"], phase="Succeeded", init="done", message=json.dumps(SUMMARY))
    complete_job(k, opted_ns, "train")
    k.wait_for(
        lambda: (
            (node_entry(k, opted_ns, "kept", "node-k") or {}).get("consumers") == 0
            and node_entry(k, opted_ns, "kept", "node-k")["state"] == "Ready"
        ),
        what="Ready, unused",
    )
    time.sleep(1.5)
    assert helper_for(k, opted_ns, "kept") == [], "wiped before ttlAfterLastUse"
    helper = k.wait_for(lambda: helper_for(k, opted_ns, "kept"), timeout=20, what="helper after the TTL")[0]
    kubelet_runs_helper(k, helper)
    wait_node_state(k, opted_ns, "kept", "node-k", "Wiped")


def test_webhook_down_blocks_only_what_asked_for_a_cache_and_cold_start_admits(kube_api, dscache_operator, ready_cache):
    k = kube_api
    op = dscache_operator
    ns, name = ready_cache
    op.stop("webhook")
    try:
        # matchConditions: a Job that did not ask for a cache never reaches the webhook.
        plain = create_job(k, ns, job_body("plain", None))
        assert "initContainers" not in plain["spec"]["template"]["spec"]
        # failurePolicy Fail: one that asked never starts without its cache.
        with pytest.raises(ApiError) as e:
            create_job(k, ns, job_body("asked", name))
        assert "failed calling webhook" in e.value.body
    finally:
        op.start("webhook")  # returns as soon as the port listens: the index may still be cold
    job = create_job(k, ns, job_body("asked", name))
    assert _injected_counts(job["spec"]["template"]["spec"]) == (1, 1, [2])


def test_namespaced_mode(kube_api, dscache_operator, s3_server, s3_bucket):
    """DSCACHE_WATCH_NAMESPACES: kopf and the informers watch only those namespaces (same RBAC)."""
    k = kube_api
    op = dscache_operator
    mine = k.namespace("ml-watched", {"dscache.io/injection": "enabled"})
    other = k.namespace("ml-unwatched", {"dscache.io/injection": "enabled"})
    op.stop("controller")
    op.extra_env["DSCACHE_WATCH_NAMESPACES"] = mine
    try:
        op.start("controller")
        for ns in (mine, other):
            make_cache(k, ns, "ds", f"s3://{s3_bucket}/data/", s3_server.endpoint, with_keys(k, ns))
        wait_phase(k, mine, "ds", "Ready")
        job = create_job(k, mine, job_body("train", "ds"))
        pod = start_job_pod(k, mine, job, "node-n")
        kubelet_status(k, mine, pod["metadata"]["name"], phase="Succeeded", init="done", message=json.dumps(SUMMARY))
        complete_job(k, mine, "train")
        helper = k.wait_for(lambda: helper_for(k, mine, "ds"), what="helper")[0]
        kubelet_runs_helper(k, helper)
        wait_node_state(k, mine, "ds", "node-n", "Wiped")
        assert (get_cache(k, other, "ds").get("status") or {}).get("phase") is None, "unwatched ns reconciled"
        assert "orbidden" not in op.log("controller")
    finally:
        op.stop("controller")
        op.extra_env.pop("DSCACHE_WATCH_NAMESPACES", None)
        op.start("controller")


# --- issue 7: revisions, nodes that are gone, rotated tokens ---------------------------------


def _expected_revision(files: dict[str, bytes], prefix: str, bucket: str) -> str:
    import hashlib

    h = RevisionHasher()
    for key in sorted(files):
        if key.startswith(prefix):
            h.add(key, len(files[key]), hashlib.md5(files[key]).hexdigest())
    return h.revision_id()


def test_revision_is_pinned_and_jobs_keep_theirs_across_a_refresh(kube_api, ready_cache, s3_server, s3_bucket):
    """status.revision is the contract digest of the listing; a Job's later pods keep the
    revision it was admitted with after the bucket changed and the cache re-listed."""
    k = kube_api
    ns, name = ready_cache
    c = get_cache(k, ns, name)
    rev = c["status"]["revision"]
    assert rev["id"] == _expected_revision(FILES, "data/", s3_bucket)
    assert (rev["objects"], rev["bytes"]) == (4, 135)
    out = subprocess.run(
        [kubectl(), "--kubeconfig", str(k.kubeconfig), "get", "dsc", name, "-n", ns],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "REVISION" in out and rev["id"] in out
    job = create_job(k, ns, job_body("old", name))
    assert job["spec"]["template"]["metadata"]["annotations"]["dscache.io/revision"] == rev["id"]

    changed = {**FILES, "data/a.bin": b"A" * 11}
    s3_server.put_tree(s3_bucket, {"data/a.bin": changed["data/a.bin"]})
    k.merge_patch(f"{DSC.format(ns=ns)}/{name}", {"metadata": {"annotations": {"dscache.io/refresh": "1"}}})
    new = k.wait_for(
        lambda: (lambda r: r if r and r["id"] != rev["id"] else None)(
            (get_cache(k, ns, name)["status"] or {}).get("revision")
        ),
        what="a new revision",
    )
    assert new["id"] == _expected_revision(changed, "data/", s3_bucket)
    assert get_cache(k, ns, name)["status"]["observedRefresh"] == "1"
    # A pod the old Job creates now still stages the old revision; a new Job gets the new one.
    pod = start_job_pod(k, ns, job, "node-v")
    assert pod["metadata"]["annotations"]["dscache.io/revision"] == rev["id"]
    init = next(c for c in pod["spec"]["initContainers"] if c["name"] == "dscache-stage")
    assert StageArgs.from_argv(init["args"]).revision == rev["id"]
    job2 = create_job(k, ns, job_body("new", name))
    assert job2["spec"]["template"]["metadata"]["annotations"]["dscache.io/revision"] == new["id"]
    events = k.request("GET", f"/api/v1/namespaces/{ns}/events")["items"]
    assert any(ev["reason"] == "RevisionPinned" for ev in events)


def test_a_versioned_bucket_pins_versions_and_every_pod_of_a_job_carries_the_time(
    kube_api, dscache_operator, versioned_s3, versioned_bucket, opted_ns
):
    """Versioning Enabled: status.revision says so, with its as-of time; a Job's
    pod template, its later pods and their stager args carry that time after the
    bucket changed and the cache re-listed."""
    from dscache_contract import Selection, pin
    from tests.support.s3server import ACCESS_KEY, SECRET_KEY

    k, ns, name = kube_api, opted_ns, "versioned"
    versioned_s3.put_tree(versioned_bucket, FILES)
    make_secret(k, ns, "s3-keys", ACCESS_KEY, SECRET_KEY)
    grant_secret_read(k, ns)
    make_cache(k, ns, name, f"s3://{versioned_bucket}/data/", versioned_s3.endpoint, "s3-keys")
    rev = wait_phase(k, ns, name, "Ready")["status"]["revision"]
    pinned = pin(versioned_s3.client(), versioned_bucket, Selection("data/"))
    assert (rev["id"], rev["versioned"], rev["asOf"], rev["objects"]) == (pinned.revision, True, pinned.as_of, 4)
    job = create_job(k, ns, job_body("old", name))
    annotations = job["spec"]["template"]["metadata"]["annotations"]
    assert (annotations["dscache.io/revision"], annotations["dscache.io/revision-as-of"]) == (rev["id"], rev["asOf"])

    with versioned_s3.keeping_version_times(versioned_bucket):
        versioned_s3.put_tree(versioned_bucket, {"data/a.bin": b"A" * 11})
    k.merge_patch(f"{DSC.format(ns=ns)}/{name}", {"metadata": {"annotations": {"dscache.io/refresh": "1"}}})
    new = k.wait_for(
        lambda: (lambda r: r if r and r["id"] != rev["id"] else None)(
            (get_cache(k, ns, name)["status"] or {}).get("revision")
        ),
        what="a new revision",
    )
    assert new["versioned"] and new["asOf"] >= rev["asOf"]
    pod = start_job_pod(k, ns, job, "node-v")
    assert pod["metadata"]["annotations"]["dscache.io/revision-as-of"] == rev["asOf"]
    init = next(c for c in pod["spec"]["initContainers"] if c["name"] == "dscache-stage")
    assert (StageArgs.from_argv(init["args"]).revision, StageArgs.from_argv(init["args"]).as_of) == (
        rev["id"],
        rev["asOf"],
    )


def test_a_node_that_is_gone_gets_no_helper(kube_api, ready_cache):
    k = kube_api
    ns, name = ready_cache
    job = create_job(k, ns, job_body("train", name))
    pod = start_job_pod(k, ns, job, "node-gone")
    kubelet_status(k, ns, pod["metadata"]["name"], phase="Running", init="done", message=json.dumps(SUMMARY))
    wait_node_state(k, ns, name, "node-gone", "Ready")
    k.delete("/api/v1/nodes/node-gone")
    kubelet_status(k, ns, pod["metadata"]["name"], phase="Succeeded", init="done", message=json.dumps(SUMMARY))
    complete_job(k, ns, "train")
    k.wait_for(lambda: node_entry(k, ns, name, "node-gone") is None, what="node dropped from status")
    time.sleep(2.5)
    assert helper_for(k, ns, name) == []
    events = k.request("GET", f"/api/v1/namespaces/{ns}/events")["items"]
    assert any(ev["reason"] == "NodeGone" for ev in events)


def test_api_client_survives_a_rotated_token(kube_api, dscache_operator, tmp_path):
    """Against the real kube-apiserver: a token bound to a Secret stops working when the
    Secret goes (as a projected token does when its pod or expiry ends); the client re-reads
    its token file on the 401 and carries on with the new token."""
    import asyncio

    from dscache_operator.kube import Kube, connection_info

    k = kube_api
    sa = f"/api/v1/namespaces/{OPERATOR_NS}/serviceaccounts/dscache-controller/token"

    def bound_token(secret: str) -> str:
        s = k.create(
            f"/api/v1/namespaces/{OPERATOR_NS}/secrets",
            {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": secret}},
        )
        return k.create(
            sa,
            {
                "apiVersion": "authentication.k8s.io/v1",
                "kind": "TokenRequest",
                "spec": {
                    "expirationSeconds": 3600,
                    "boundObjectRef": {
                        "kind": "Secret",
                        "apiVersion": "v1",
                        "name": secret,
                        "uid": s["metadata"]["uid"],
                    },
                },
            },
        )["status"]["token"]

    token_file = tmp_path / "token"
    token_file.write_text(bound_token("rot-1"))
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "c",
                "clusters": [
                    {"name": "t", "cluster": {"server": k.server, "certificate-authority": str(k.certs / "ca.crt")}}
                ],
                "users": [{"name": "u", "user": {"tokenFile": str(token_file)}}],
                "contexts": [{"name": "c", "context": {"cluster": "t", "user": "u"}}],
            }
        )
    )
    path = "/apis/dscache.io/v1alpha1/datasetcaches"

    async def main():
        import os

        old = os.environ.get("KUBECONFIG")
        os.environ["KUBECONFIG"] = str(kubeconfig)
        try:
            kube = Kube(connection_info())
        finally:
            if old is None:
                os.environ.pop("KUBECONFIG")
            else:
                os.environ["KUBECONFIG"] = old
        try:
            await kube.request("GET", path)
            k.delete(f"/api/v1/namespaces/{OPERATOR_NS}/secrets/rot-1")  # the old token is dead
            deadline = time.monotonic() + 20
            while True:  # the API server notices the deleted Secret within its cache's lag
                try:
                    await kube.request("GET", path)
                    assert time.monotonic() < deadline, "the revoked token kept working"
                    await asyncio.sleep(0.5)
                except ApiErrorK as e:
                    assert e.status == 401
                    break
            token_file.write_text(bound_token("rot-2"))  # the kubelet rotates it
            await kube.request("GET", path)  # re-read on 401, retried
        finally:
            await kube.close()

    from dscache_operator.kube import ApiError as ApiErrorK

    asyncio.run(main())


def test_pytorchjob_worker_lifecycle_follows_its_owner(kube_api, dscache_operator, ready_cache):
    """A PyTorchJob (its CRD installed after the operator started: an optional kind): a
    worker that failed while the PyTorchJob runs keeps the node's copy; the copy is
    released only when the PyTorchJob has finished."""
    k = kube_api
    op = dscache_operator
    ns, name = ready_cache
    k.apply_yaml_docs(
        [
            {
                "apiVersion": "apiextensions.k8s.io/v1",
                "kind": "CustomResourceDefinition",
                "metadata": {"name": "pytorchjobs.kubeflow.org"},
                "spec": {
                    "group": "kubeflow.org",
                    "scope": "Namespaced",
                    "names": {"kind": "PyTorchJob", "plural": "pytorchjobs", "singular": "pytorchjob"},
                    "versions": [
                        {
                            "name": "v1",
                            "served": True,
                            "storage": True,
                            "subresources": {"status": {}},
                            "schema": {
                                "openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
                            },
                        }
                    ],
                },
            }
        ]
    )
    k.wait_for(
        lambda: any(
            c["type"] == "Established" and c["status"] == "True"
            for c in (
                k.get("/apis/apiextensions.k8s.io/v1/customresourcedefinitions/pytorchjobs.kubeflow.org").get("status")
                or {}
            ).get("conditions")
            or []
        ),
        what="PyTorchJob CRD",
    )
    op.stop("controller")  # the absent kind is looked at again every minute; do not wait for that
    op.start("controller")
    pt = k.create(
        f"/apis/kubeflow.org/v1/namespaces/{ns}/pytorchjobs",
        {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": {"name": "pt"}, "spec": {}},
    )
    ensure_node(k, "node-pt")
    worker = k.create(
        f"/api/v1/namespaces/{ns}/pods",
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": "pt-worker-0",
                "annotations": {"dscache.io/cache": name},
                "ownerReferences": [
                    {
                        "apiVersion": "kubeflow.org/v1",
                        "kind": "PyTorchJob",
                        "name": "pt",
                        "uid": pt["metadata"]["uid"],
                        "controller": True,
                    }
                ],
            },
            "spec": {
                "nodeName": "node-pt",
                "restartPolicy": "Never",
                "containers": [{"name": "pytorch", "image": "t"}],
            },
        },
    )
    rev = worker["metadata"]["annotations"]["dscache.io/revision"]
    kubelet_status(k, ns, "pt-worker-0", phase="Running", init="done", message=json.dumps(SUMMARY))
    wait_node_state(k, ns, name, "node-pt", "Ready")
    k.wait_for(
        lambda: any(
            o["uid"] == pt["metadata"]["uid"] and o["revision"] == rev
            for o in get_cache(k, ns, name)["status"].get("owners") or []
        ),
        what="the PyTorchJob pinned in status.owners",
    )
    kubelet_status(k, ns, "pt-worker-0", phase="Failed", init="done", message=json.dumps(SUMMARY))
    time.sleep(3)
    assert helper_for(k, ns, name) == [], "wiped while the PyTorchJob still runs (it may recreate the worker)"
    assert node_entry(k, ns, name, "node-pt")["consumers"] == 1
    t = now_rfc3339()
    k.merge_patch(
        f"/apis/kubeflow.org/v1/namespaces/{ns}/pytorchjobs/pt/status",
        {
            "status": {
                "conditions": [{"type": "Succeeded", "status": "True", "lastTransitionTime": t, "reason": "Done"}]
            }
        },
    )
    helper = k.wait_for(lambda: helper_for(k, ns, name), what="helper once the PyTorchJob finished")[0]
    args = WipeArgs.from_argv(helper["spec"]["containers"][0]["args"])
    assert (args.revision, args.release) == (rev, (worker["metadata"]["uid"],))
    kubelet_runs_helper(k, helper)
    wait_node_state(k, ns, name, "node-pt", "Wiped")


def test_deleting_a_cache_whose_job_still_needs_pods_does_not_deadlock(kube_api, ready_cache):
    """The Job's pod failed and the Job would start another, but the cache is being
    deleted: the new pod is refused, and the deletion completes without waiting for a
    Job that can never finish with this cache."""
    k = kube_api
    ns, name = ready_cache
    job = create_job(k, ns, job_body("needy", name))
    pod = start_job_pod(k, ns, job, "node-dl")
    kubelet_status(k, ns, pod["metadata"]["name"], phase="Running", init="done", message=json.dumps(SUMMARY))
    wait_node_state(k, ns, name, "node-dl", "Ready")
    kubelet_status(k, ns, pod["metadata"]["name"], phase="Failed", init="done", message=json.dumps(SUMMARY))
    time.sleep(2)
    assert helper_for(k, ns, name) == [], "wiped while the Job may still start a pod"
    k.delete(f"{DSC.format(ns=ns)}/{name}")

    def refused() -> bool:
        try:
            start_job_pod(k, ns, job, "node-dl", suffix="1", dry_run=True)
        except ApiError as e:
            return "being deleted" in e.body
        return False

    # The webhook decides from its watch of DatasetCaches, which sees the deletion a
    # moment after the API server does (seconds on a loaded machine): wait for that,
    # through dry runs, so that no real pod slips in before it.
    k.wait_for(refused, what="the webhook refusing the Job's next pod (dry run)")
    with pytest.raises(ApiError) as e:  # what the job controller's next pod gets
        start_job_pod(k, ns, job, "node-dl", suffix="1")
    assert "being deleted" in e.value.body
    helper = k.wait_for(lambda: helper_for(k, ns, name), what="wipe helper although the Job runs")[0]
    args = WipeArgs.from_argv(helper["spec"]["containers"][0]["args"])
    assert args.all_revisions and args.release == (pod["metadata"]["uid"],)
    kubelet_runs_helper(k, helper)
    k.wait_for(lambda: get_cache(k, ns, name) is None, timeout=30, what="cache gone")
