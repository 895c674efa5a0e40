"""The operator against a real kube-apiserver + etcd + S3 server (versitygw).

The controller and the webhook run as subprocesses with the ServiceAccounts
and RBAC of operator/deploy/, and the API server calls the webhook over TLS
through the MutatingWebhookConfiguration of operator/deploy/webhook.yaml.
There is no kubelet and no job controller: the tests patch pod and Job status
the way those components would, and stage a pod's copy on its node's disk the
way its stager would. Each node a test wipes runs a real node agent
(dscache-node, tests/support/nodeagent.py) with its own cacheRoot in a temp dir:
the controller's wipes reach it over HTTP, and the tests assert on that disk.
"""

from __future__ import annotations

import base64
import copy
import json
import os
import subprocess
import time
from pathlib import Path

import pytest

import dscache_contract as contract
from dscache_contract import RevisionHasher, StageArgs
from tests.support.kubeapi import OPERATOR_NS, ApiError, KubeAPI
from tests.support.nodeagent import NodeAgent, revision_on_disk, stage_copy, warm_labels
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
    """A Node object as a kubelet would register it, when the test started no agent for it
    (tests that wipe start one: the ``agents`` fixture, tests/support/nodeagent.py)."""
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


def staged(agent: NodeAgent, ns: str, cache: str, pod: dict, **kw) -> Path:
    """What the pod's stager leaves on its node: the revision it was admitted with, complete,
    and the pod's lease on it. Returns the revision's dir under the agent's cacheRoot."""
    rev = pod["metadata"]["annotations"]["dscache.io/revision"]
    c = stage_copy(agent.cache_root, ns, cache, rev, leases=(pod["metadata"]["uid"],), **kw)
    return Path(contract.revision_dir(str(c), rev))


def wait_gone(k: KubeAPI, path: Path, timeout: float = 30) -> None:
    k.wait_for(lambda: not os.path.lexists(path), timeout=timeout, what=f"{path} removed")


def wipe_lines(agent: NodeAgent, ns: str, cache: str) -> list[str]:
    """The wipe requests of ns/cache the agent served, as 'WHAT release=UIDS: OUTCOME'."""
    return [line.split(f" wipe {ns}/{cache} ", 1)[1] for line in agent.wipes(ns, cache)]


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


def test_no_secret_and_no_service_account_is_not_ready(kube_api, dscache_operator, s3_server, s3_bucket, opted_ns):
    make_cache(kube_api, opted_ns, "irsa", f"s3://{s3_bucket}/data/", s3_server.endpoint)
    c = wait_phase(kube_api, opted_ns, "irsa", "Failed")
    got = condition(c)
    assert (got["status"], got["reason"]) == ("False", "NoIdentity"), got
    assert "spec.source.serviceAccountName" in got["message"] and "secretRef" in got["message"]
    assert not (c.get("status") or {}).get("revision")
    # No revision can be pinned without listing the source: refused, saying why and how to fix it.
    with pytest.raises(ApiError) as e:
        create_job(kube_api, opted_ns, job_body("train", "irsa"))
    assert "NoIdentity" in e.value.body and "spec.source.serviceAccountName" in e.value.body, e.value.body


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
    (init,) = spec["initContainers"]
    assert init["image"] == "dscache-stager:test"
    # The node's copy as the agents' CSI volume (webhook.yaml's default entries).
    rev0 = job["spec"]["template"]["metadata"]["annotations"]["dscache.io/revision"]
    assert vol == {
        "name": "dscache-data",
        "csi": {"driver": "cache.dscache.io", "volumeAttributes": {"cache": name, "revision": rev0}},
    }
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


def test_emptydir_namespace(kube_api, dscache_operator, agents, s3_server, s3_bucket):
    from tests.support.s3server import ACCESS_KEY, SECRET_KEY

    # The per-pod emptyDir, asked for by the namespace (a baseline one gets the CSI volume).
    ns = kube_api.namespace(
        "ml-emptydir",
        {"dscache.io/injection": "enabled", "dscache.io/volume": "emptyDir"},
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
    # The kubelet removes emptyDir copies with their pods: Wiped without asking the node's agent.
    agent = agents.start("node-e")
    pod = start_job_pod(kube_api, ns, job, "node-e")
    kubelet_status(kube_api, ns, pod["metadata"]["name"], phase="Running", init="done", message=json.dumps(SUMMARY))
    e = wait_node_state(kube_api, ns, "ds", "node-e", "Ready")
    assert e["volume"] == "EmptyDir"
    kubelet_status(kube_api, ns, pod["metadata"]["name"], phase="Succeeded", init="done", message=json.dumps(SUMMARY))
    complete_job(kube_api, ns, "train")
    wait_node_state(kube_api, ns, "ds", "node-e", "Wiped")
    time.sleep(2)
    assert wipe_lines(agent, ns, "ds") == []


# --- lifecycle: node state, wipe, deletion, restart ---------------------------------------


def test_job_completion_wipes_the_node_once(kube_api, ready_cache, agents):
    k = kube_api
    ns, name = ready_cache
    node_a, node_b = agents.start("node-a"), agents.start("node-b")
    job = create_job(k, ns, job_body("train", name))
    pod = start_job_pod(k, ns, job, "node-a")
    uid, rev = pod["metadata"]["uid"], pod["metadata"]["annotations"]["dscache.io/revision"]
    kubelet_status(k, ns, pod["metadata"]["name"], phase="Pending", init="running")
    wait_node_state(k, ns, name, "node-a", "Staging")
    copy_a = staged(node_a, ns, name, pod)
    kubelet_status(k, ns, pod["metadata"]["name"], phase="Running", init="done", message=json.dumps(SUMMARY))
    e = wait_node_state(k, ns, name, "node-a", "Ready")
    assert (e["bytes"], e["objects"], e["seconds"], e["consumers"]) == (35, 3, 0.42, 1)
    assert get_cache(k, ns, name)["status"]["readyNodes"] == 1
    # The agent verified the copy and labelled its Node: the cache counts it warm.
    k.wait_for(lambda: contract.warm_label(ns, name, rev) in warm_labels(k, "node-a"), what="node-a warm")

    # A second Job on another node is still running: its copy must stay.
    job2 = create_job(k, ns, job_body("other", name))
    pod2 = start_job_pod(k, ns, job2, "node-b")
    copy_b = staged(node_b, ns, name, pod2)
    kubelet_status(k, ns, pod2["metadata"]["name"], phase="Running", init="done", message=json.dumps(SUMMARY))

    kubelet_status(k, ns, pod["metadata"]["name"], phase="Succeeded", init="done", message=json.dumps(SUMMARY))
    time.sleep(2.5)
    assert wipe_lines(node_a, ns, name) == [], "wiped while the Job had not completed yet"
    assert copy_a.exists()
    complete_job(k, ns, "train")
    wait_node_state(k, ns, name, "node-a", "Wiped")
    assert not copy_a.exists()
    assert contract.warm_label(ns, name, rev) not in warm_labels(k, "node-a")
    time.sleep(3)  # several reconciliations after the wipe: no second request
    assert wipe_lines(node_a, ns, name) == [f"{rev} release={uid}: removed"], node_a.log()[-3000:]
    entry = node_entry(k, ns, name, "node-a")
    assert entry["bytes"] == 35 and entry["seconds"] == 0.42 and entry["consumers"] == 0
    assert node_entry(k, ns, name, "node-b")["state"] == "Ready"
    assert copy_b.exists() and wipe_lines(node_b, ns, name) == []
    events = k.request("GET", f"/api/v1/namespaces/{ns}/events")["items"]
    assert any(ev["reason"] == "Wiped" and "node-a" in ev["message"] for ev in events)


def test_a_copy_kept_by_a_stray_entry_gets_no_request_loop(kube_api, ready_cache, agents):
    """A wipe found the revision held by an entry under leases/ that is no pod's lease
    (no pod's end will ever release it). The node says so, and the agent is not asked
    again for KEPT_RETRY_S: before keptAt, it was asked every reconciliation (1 s here)."""
    k = kube_api
    ns, name = ready_cache
    agent = agents.start("node-s")
    job = create_job(k, ns, job_body("stray", name))
    pod = start_job_pod(k, ns, job, "node-s")
    rev = pod["metadata"]["annotations"]["dscache.io/revision"]
    copy = staged(agent, ns, name, pod)
    stray = Path(contract.lease_dir(str(copy.parent.parent), rev)) / ".notes"  # no pod UID
    stray.write_text("mine")
    kubelet_status(k, ns, pod["metadata"]["name"], phase="Succeeded", init="done", message=json.dumps(SUMMARY))
    complete_job(k, ns, "stray")

    def kept() -> dict | None:
        revs = (node_entry(k, ns, name, "node-s") or {}).get("revisions") or []
        return next((r for r in revs if r["id"] == rev and r.get("keptAt")), None)

    k.wait_for(kept, what="the revision marked kept")
    message = node_entry(k, ns, name, "node-s")["message"]
    assert "remove them by hand" in message and f"leases/{rev}/.notes" in message, message
    time.sleep(5)  # five reconciliations
    assert [line.split(": ")[-1] for line in wipe_lines(agent, ns, name)] == ["kept"], agent.wipes(ns, name)
    assert kept().get("wipedAt") is None
    assert copy.exists() and stray.exists()


def test_a_new_cache_has_the_finalizer_from_creation_and_the_controller_restores_it(kube_api, ready_cache):
    """The webhook puts the controller's finalizer on each new cache, so the controller
    writes none (at 10,000 caches that write was a fifth of the API server's time); a
    cache without it (created while the webhook was down, or stripped by hand) gets it
    from the controller, as before."""
    k = kube_api
    ns, name = ready_cache
    finalizer = "dscache.io/wipe"
    assert make_cache(k, ns, "claimed", "s3://no-such-bucket/")["metadata"]["finalizers"] == [finalizer]
    patches = [
        e
        for e in k.audit_events()
        if e["user"]["username"].endswith(":dscache-controller")
        and e["verb"] == "patch"
        and e.get("objectRef", {}).get("name") in (name, "claimed")
        and not e["objectRef"].get("subresource")
    ]
    assert patches == [], "the controller wrote the finalizer the webhook had set"
    assert get_cache(k, ns, name)["metadata"]["finalizers"] == [finalizer]
    remove = [{"op": "remove", "path": "/metadata/finalizers"}]
    k.request("PATCH", f"{DSC.format(ns=ns)}/{name}", remove, content_type="application/json-patch+json")
    k.wait_for(
        lambda: (get_cache(k, ns, name)["metadata"].get("finalizers") or []) == [finalizer],
        what="the controller's finalizer back",
    )


def test_deleting_the_cache_runs_the_finalizer(kube_api, ready_cache, agents):
    k = kube_api
    ns, name = ready_cache
    agent = agents.start("node-d")
    job = create_job(k, ns, job_body("train", name))
    pod = start_job_pod(k, ns, job, "node-d")
    copy = staged(agent, ns, name, pod)
    kubelet_status(k, ns, pod["metadata"]["name"], phase="Running", init="done", message=json.dumps(SUMMARY))
    wait_node_state(k, ns, name, "node-d", "Ready")
    k.delete(f"{DSC.format(ns=ns)}/{name}")
    # A live consumer blocks the wipe; the cache waits in Deleting.
    k.wait_for(lambda: get_cache(k, ns, name)["status"]["phase"] == "Deleting", what="Deleting")
    time.sleep(2)
    assert wipe_lines(agent, ns, name) == [] and copy.exists() and get_cache(k, ns, name) is not None
    # New workloads cannot use a cache being deleted.
    with pytest.raises(ApiError) as e:
        create_job(k, ns, job_body("late", name))
    assert "being deleted" in e.value.body
    kubelet_status(k, ns, pod["metadata"]["name"], phase="Succeeded", init="done", message=json.dumps(SUMMARY))
    complete_job(k, ns, "train")
    k.wait_for(lambda: get_cache(k, ns, name) is None, timeout=30, what="cache gone after finalizer")
    # The whole cache dir went, lock file included.
    assert not (agent.cache_root / ns / name).exists()
    assert list((agent.cache_root / ns).iterdir()) == []
    assert [w.split(": ")[-1] for w in wipe_lines(agent, ns, name)] == ["removed"], agent.wipes(ns, name)
    assert wipe_lines(agent, ns, name)[0].startswith("whole cache dir release=")


def test_failed_wipe_is_retried(kube_api, ready_cache, agents):
    """The node's agent does not answer (stopped): the wipe fails, says so, and is asked
    again until the agent is back."""
    k = kube_api
    ns, name = ready_cache
    agent = agents.start("node-r")
    job = create_job(k, ns, job_body("train", name))
    pod = start_job_pod(k, ns, job, "node-r")
    copy = staged(agent, ns, name, pod)
    kubelet_status(k, ns, pod["metadata"]["name"], phase="Succeeded", init="done", message=json.dumps(SUMMARY))
    agent.stop()
    complete_job(k, ns, "train", failed=True)
    entry = k.wait_for(
        lambda: (lambda n: n if n and "did not answer" in (n.get("message") or "") else None)(
            node_entry(k, ns, name, "node-r")
        ),
        what="the failed wipe in status",
    )
    assert entry["state"] != "Wiped" and f"127.0.0.1:{agent.port}" in entry["message"], entry
    events = k.request("GET", f"/api/v1/namespaces/{ns}/events")["items"]
    assert any(ev["reason"] == "WipeFailed" and "retrying" in ev["message"] for ev in events)
    time.sleep(1.5)  # retried meanwhile: still nothing removed
    assert copy.exists()
    agent.start()
    wait_node_state(k, ns, name, "node-r", "Wiped")
    assert not copy.exists()
    assert node_entry(k, ns, name, "node-r").get("message") is None
    assert [w.split(": ")[-1] for w in wipe_lines(agent, ns, name)] == ["removed"], agent.wipes(ns, name)


def test_operator_restart_converges(kube_api, dscache_operator, ready_cache, agents):
    """The controller is SIGKILLed while the Job completes, and again while the agent is
    removing the copy: the agent finishes the removal, and the restarted controller
    converges on Wiped without leaving the copy or touching the busy node."""
    k = kube_api
    op = dscache_operator
    ns, name = ready_cache
    node_x, node_y = agents.start("node-x"), agents.start("node-y")
    try:
        job = create_job(k, ns, job_body("train", name))
        pod = start_job_pod(k, ns, job, "node-x")
        # A large tree, so that removing it takes a moment.
        copy_x = staged(node_x, ns, name, pod, files={f"d{i % 50}/f{i}": b"" for i in range(20000)})
        kubelet_status(k, ns, pod["metadata"]["name"], phase="Running", init="done", message=json.dumps(SUMMARY))
        wait_node_state(k, ns, name, "node-x", "Ready")
        # Another Job keeps node-y busy across the restart.
        job2 = create_job(k, ns, job_body("busy", name))
        pod2 = start_job_pod(k, ns, job2, "node-y")
        copy_y = staged(node_y, ns, name, pod2)
        kubelet_status(k, ns, pod2["metadata"]["name"], phase="Running", init="done", message=json.dumps(SUMMARY))
        wait_node_state(k, ns, name, "node-y", "Ready")

        op.stop("controller", kill=True)  # SIGKILL: no cleanup at all
        kubelet_status(k, ns, pod["metadata"]["name"], phase="Succeeded", init="done", message=json.dumps(SUMMARY))
        complete_job(k, ns, "train")
        time.sleep(1)
        assert copy_x.exists() and wipe_lines(node_x, ns, name) == []
        op.start("controller")

        # Killed again as soon as the agent is at work (the copy renamed away, its removal under way).
        def removing() -> bool:
            return not copy_x.exists()

        k.wait_for(removing, timeout=40, interval=0.01, what="the agent removing the copy")
        op.stop("controller", kill=True)
        wait_gone(k, copy_x)  # the agent finishes what it started
        k.wait_for(lambda: not disk_leftovers(node_x), what="no .gone- leftovers")
        op.start("controller")
        wait_node_state(k, ns, name, "node-x", "Wiped", timeout=40)
        time.sleep(3)
        outcomes = [w.split(": ")[-1] for w in wipe_lines(node_x, ns, name)]
        # One request, or a second one after the restart if the first answer was lost with the
        # killed controller: that one finds nothing left.
        assert outcomes in (["removed"], ["removed", "absent"]), node_x.wipes(ns, name)
        assert node_entry(k, ns, name, "node-y")["state"] == "Ready"
        assert copy_y.exists() and wipe_lines(node_y, ns, name) == []
    finally:
        if not op.alive("controller"):
            op.start("controller")


def disk_leftovers(agent: NodeAgent) -> list[str]:
    return [str(p) for p in agent.cache_root.rglob(".gone-*")]


def test_an_upgraded_node_gets_one_legacy_wipe_once_its_version_1_pod_ends(
    kube_api, dscache_operator, ready_cache, agents
):
    """A pod admitted before the upgrade has no revision annotation: it mounts C itself and
    reads the version 1 copy at its top. That copy is removed (a legacy wipe) only once no
    such pod holds the node, exactly once, and the node then shows Wiped."""
    k = kube_api
    ns, name = ready_cache
    agent = agents.start("node-v1")
    # The controller never sees the pod with the revision this webhook pins (a version 1
    # webhook pinned none): it reconciles a cache as soon as one of its pods changes.
    dscache_operator.stop("controller")
    job = create_job(k, ns, job_body("v1job", name))
    pod = start_job_pod(k, ns, job, "node-v1")
    pname = pod["metadata"]["name"]
    # As a version 1 webhook admitted it (this one only mutates on CREATE).
    k.merge_patch(f"/api/v1/namespaces/{ns}/pods/{pname}", {"metadata": {"annotations": {"dscache.io/revision": None}}})
    dscache_operator.start("controller")
    # What a version 1 stager left: the data at the top of C, its metadata in C/.dscache
    # (last written long ago), and, beside it, a revision another pod staged since.
    c = agent.cache_root / ns / name
    (c / "sub").mkdir(parents=True)
    (c / "a.bin").write_bytes(b"a" * 10)
    (c / "sub" / "c.bin").write_bytes(b"c" * 15)
    (c / ".dscache").mkdir()
    for trace in ("complete", "manifest.jsonl"):
        (c / ".dscache" / trace).write_text("{}")
        os.utime(c / ".dscache" / trace, (time.time() - 3600, time.time() - 3600))
    newer = rev_of(k, ns, name)
    stage_copy(agent.cache_root, ns, name, newer, leases=("another-pod",))
    kubelet_status(k, ns, pname, phase="Running", init="done", message=json.dumps(SUMMARY))

    def legacy() -> dict | None:
        revs = (node_entry(k, ns, name, "node-v1") or {}).get("revisions") or []
        return next((r for r in revs if r["id"] == "legacy"), None)

    k.wait_for(lambda: (legacy() or {}).get("consumers") == 1, what="the version 1 copy listed, held")
    kubelet_status(k, ns, pname, phase="Succeeded", init="done", message=json.dumps(SUMMARY))
    time.sleep(2.5)  # its Job still runs (it may recreate the pod): kept
    assert wipe_lines(agent, ns, name) == [], "the version 1 copy was wiped while its Job ran"
    assert (c / "a.bin").exists()
    complete_job(k, ns, "v1job")
    wait_node_state(k, ns, name, "node-v1", "Wiped")
    assert (legacy() or {}).get("wipedAt")
    # Only what predates revisions went: revs/, leases/ and the lock stay.
    assert sorted(p.name for p in c.iterdir()) == ["leases", "lock", "revs"], sorted(p.name for p in c.iterdir())
    assert revision_on_disk(agent.cache_root, ns, name, newer)
    time.sleep(3)
    assert wipe_lines(agent, ns, name) == ["legacy copy release=-: removed"], agent.wipes(ns, name)


def rev_of(k: KubeAPI, ns: str, name: str) -> str:
    return get_cache(k, ns, name)["status"]["revision"]["id"]


def test_bare_pod_completion_wipes(kube_api, ready_cache, agents):
    """A pod with no Job (e.g. one worker of another operator's workload): its end frees the node."""
    k = kube_api
    ns, name = ready_cache
    agent = agents.start("node-p")
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
    copy = staged(agent, ns, name, pod)
    kubelet_status(k, ns, "worker-0", phase="Running", init="done", message=json.dumps(SUMMARY))
    wait_node_state(k, ns, name, "node-p", "Ready")
    time.sleep(1)
    assert wipe_lines(agent, ns, name) == [] and copy.exists()
    kubelet_status(k, ns, "worker-0", phase="Succeeded", init="done", message=json.dumps(SUMMARY))
    wait_node_state(k, ns, name, "node-p", "Wiped")
    assert not copy.exists()


def test_retain_while_used_keeps_then_expires(kube_api, dscache_operator, agents, s3_server, s3_bucket, opted_ns):
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
    agent = agents.start("node-k")
    job = create_job(k, opted_ns, job_body("train", "kept"))
    pod = start_job_pod(k, opted_ns, job, "node-k")
    copy = staged(agent, opted_ns, "kept", pod)
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
    assert wipe_lines(agent, opted_ns, "kept") == [] and copy.exists(), "wiped before ttlAfterLastUse"
    wait_node_state(k, opted_ns, "kept", "node-k", "Wiped", timeout=20)
    assert not copy.exists()


def test_namespaced_mode(kube_api, dscache_operator, agents, s3_server, s3_bucket):
    """DSCACHE_WATCH_NAMESPACES: kopf and the informers watch only those namespaces (same RBAC)."""
    k = kube_api
    op = dscache_operator
    mine = k.namespace("ml-watched", {"dscache.io/injection": "enabled"})
    other = k.namespace("ml-unwatched", {"dscache.io/injection": "enabled"})
    op.stop("controller")
    op.extra_env["DSCACHE_WATCH_NAMESPACES"] = mine
    try:
        op.start("controller")
        agent = agents.start("node-n")
        for ns in (mine, other):
            make_cache(k, ns, "ds", f"s3://{s3_bucket}/data/", s3_server.endpoint, with_keys(k, ns))
        wait_phase(k, mine, "ds", "Ready")
        job = create_job(k, mine, job_body("train", "ds"))
        pod = start_job_pod(k, mine, job, "node-n")
        copy = staged(agent, mine, "ds", pod)
        kubelet_status(k, mine, pod["metadata"]["name"], phase="Succeeded", init="done", message=json.dumps(SUMMARY))
        complete_job(k, mine, "train")
        wait_node_state(k, mine, "ds", "node-n", "Wiped")
        assert not copy.exists()
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


def test_a_node_that_is_gone_gets_no_wipe(kube_api, ready_cache, agents):
    k = kube_api
    ns, name = ready_cache
    agent = agents.start("node-gone")
    job = create_job(k, ns, job_body("train", name))
    pod = start_job_pod(k, ns, job, "node-gone")
    copy = staged(agent, ns, name, pod)
    kubelet_status(k, ns, pod["metadata"]["name"], phase="Running", init="done", message=json.dumps(SUMMARY))
    wait_node_state(k, ns, name, "node-gone", "Ready")
    k.delete("/api/v1/nodes/node-gone")
    kubelet_status(k, ns, pod["metadata"]["name"], phase="Succeeded", init="done", message=json.dumps(SUMMARY))
    complete_job(k, ns, "train")
    k.wait_for(lambda: node_entry(k, ns, name, "node-gone") is None, what="node dropped from status")
    time.sleep(2.5)
    # Its agent still answers at 127.0.0.1 (a test artefact), yet was never asked.
    assert wipe_lines(agent, ns, name) == [] and copy.exists()
    events = k.request("GET", f"/api/v1/namespaces/{ns}/events")["items"]
    assert any(ev["reason"] == "NodeGone" for ev in events)


def test_api_client_survives_a_rotated_token(kube_api, dscache_operator, tmp_path):
    """Against the real kube-apiserver: a token bound to a Secret stops working when the
    Secret goes (as a projected token does when its pod or expiry ends); the client re-reads
    its token file on the 401 and carries on with the new token."""
    import asyncio

    from dscache_operator.kube.client import Kube, connection_info

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

    from dscache_operator.kube.client import ApiError as ApiErrorK

    asyncio.run(main())


def test_pytorchjob_worker_lifecycle_follows_its_owner(kube_api, dscache_operator, ready_cache, agents):
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
    agent = agents.start("node-pt")
    pt = k.create(
        f"/apis/kubeflow.org/v1/namespaces/{ns}/pytorchjobs",
        {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": {"name": "pt"}, "spec": {}},
    )
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
    copy = staged(agent, ns, name, worker)
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
    assert wipe_lines(agent, ns, name) == [], "wiped while the PyTorchJob still runs (it may recreate the worker)"
    assert copy.exists()
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
    wait_node_state(k, ns, name, "node-pt", "Wiped")
    assert not copy.exists()
    assert wipe_lines(agent, ns, name) == [f"{rev} release={worker['metadata']['uid']}: removed"], agent.wipes(ns, name)


def test_deleting_a_cache_whose_job_still_needs_pods_does_not_deadlock(kube_api, ready_cache, agents):
    """The Job's pod failed and the Job would start another, but the cache is being
    deleted: the new pod is refused, and the deletion completes without waiting for a
    Job that can never finish with this cache."""
    k = kube_api
    ns, name = ready_cache
    agent = agents.start("node-dl")
    job = create_job(k, ns, job_body("needy", name))
    pod = start_job_pod(k, ns, job, "node-dl")
    copy = staged(agent, ns, name, pod)
    kubelet_status(k, ns, pod["metadata"]["name"], phase="Running", init="done", message=json.dumps(SUMMARY))
    wait_node_state(k, ns, name, "node-dl", "Ready")
    kubelet_status(k, ns, pod["metadata"]["name"], phase="Failed", init="done", message=json.dumps(SUMMARY))
    time.sleep(2)
    assert wipe_lines(agent, ns, name) == [] and copy.exists(), "wiped while the Job may still start a pod"
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
    # Refused as being deleted, or, if the controller finished the deletion in between
    # (it acts on the deletion at once), as a cache that no longer exists.
    assert "being deleted" in e.value.body or "does not exist" in e.value.body, e.value.body
    k.wait_for(lambda: get_cache(k, ns, name) is None, timeout=30, what="cache gone")
    assert not (agent.cache_root / ns / name).exists()
    assert wipe_lines(agent, ns, name) == [f"whole cache dir release={pod['metadata']['uid']}: removed"], agent.wipes(
        ns, name
    )
