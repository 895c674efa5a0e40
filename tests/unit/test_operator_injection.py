"""Injection logic and the webhook handler, called directly (no servers: admission.review)."""

from __future__ import annotations

import asyncio
import base64
import copy
import json

import jsonpatch
import kopf
import pytest

from dscache_contract import STAGER_CONTAINER_NAME, VOLUME_NAME, RevisionRef, StageArgs
from dscache_operator.admission import injection, webhook
from dscache_operator.admission import server as admission
from dscache_operator.admission.injection import InjectionError, inject_object
from dscache_operator.api.models import DatasetCacheSpec
from dscache_operator.context import Context
from dscache_operator.settings import Settings

SETTINGS = Settings(cache_root="/mnt/nvme/dscache", stager_image="stager:test")
REV = "r-0123456789abcdef0123"
REV2 = "r-fedcba9876543210fedc"
PIN = RevisionRef(REV)


def spec(**extra) -> DatasetCacheSpec:
    base = {
        "source": {
            "uri": "s3://bkt/imagenet/",
            "endpoint": "http://s3.local:9000",
            "region": "eu-west-1",
            "addressingStyle": "path",
            "credentials": {"secretRef": {"name": "s3-keys"}},
            "include": ["*.tar"],
            "exclude": ["tmp/*"],
        },
        "mountPath": "/data",
    }
    base.update(extra)
    return DatasetCacheSpec.model_validate(base)


def job(annotate_template: bool = False, containers=None) -> dict:
    meta = {"name": "train", "namespace": "ml"}
    tmeta: dict = {}
    if annotate_template:
        tmeta["annotations"] = {"dscache.io/cache": "imagenet"}
    else:
        meta["annotations"] = {"dscache.io/cache": "imagenet"}
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": meta,
        "spec": {
            "template": {
                "metadata": tmeta,
                "spec": {
                    "restartPolicy": "Never",
                    "containers": containers
                    or [
                        {"name": "train", "image": "trainer:1"},
                        {
                            "name": "logger",
                            "image": "logger:1",
                            "volumeMounts": [{"name": "scratch", "mountPath": "/scratch"}],
                        },
                    ],
                    "volumes": [{"name": "scratch", "emptyDir": {}}],
                },
            }
        },
    }


def pod_spec(obj):
    return obj["spec"]["template"]["spec"]


def test_injects_exactly_once_and_is_idempotent():
    obj = job()
    assert inject_object(
        obj,
        kind="Job",
        namespace="ml",
        cache_name="imagenet",
        spec=spec(),
        settings=SETTINGS,
        mode="HostPath",
        revision=RevisionRef(REV),
    )
    once = copy.deepcopy(obj)
    assert not inject_object(
        obj,
        kind="Job",
        namespace="ml",
        cache_name="imagenet",
        spec=spec(),
        settings=SETTINGS,
        mode="HostPath",
        revision=RevisionRef(REV),
    )
    assert obj == once
    ps = pod_spec(obj)
    assert [c["name"] for c in ps["initContainers"]] == [STAGER_CONTAINER_NAME]
    assert [v for v in ps["volumes"] if v["name"] == VOLUME_NAME] == [
        {"name": VOLUME_NAME, "hostPath": {"path": "/mnt/nvme/dscache/ml/imagenet", "type": "DirectoryOrCreate"}}
    ]
    for c in ps["containers"]:
        mounts = [m for m in c["volumeMounts"] if m["name"] == VOLUME_NAME]
        # The dataset and nothing else at mountPath; the manifest outside it.
        assert mounts == [
            {"name": VOLUME_NAME, "mountPath": "/data", "readOnly": True, "subPath": f"revs/{REV}/data"},
            {"name": VOLUME_NAME, "mountPath": "/var/run/dscache", "readOnly": True, "subPath": f"revs/{REV}/meta"},
        ]
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["DSCACHE_DIR"] == "/data"
        assert env["DSCACHE_MANIFEST"] == "/var/run/dscache/manifest.jsonl"
        assert env["DSCACHE_REVISION"] == REV
        assert not any("valueFrom" in e for e in c["env"]), "credentials leaked into a training container"
    assert obj["spec"]["template"]["metadata"]["annotations"]["dscache.io/cache"] == "imagenet"
    # The revision is pinned on the pod template: every pod the Job ever creates stages it.
    assert obj["spec"]["template"]["metadata"]["annotations"]["dscache.io/revision"] == REV
    # Labelled for the controller's server-side filtered watches: the Job and its pods.
    assert obj["spec"]["template"]["metadata"]["labels"]["dscache.io/consumer"] == "true"
    assert obj["metadata"]["labels"]["dscache.io/consumer"] == "true"


def test_init_container_args_credentials_and_privileges():
    obj = job()
    inject_object(
        obj,
        kind="Job",
        namespace="ml",
        cache_name="imagenet",
        spec=spec(),
        settings=SETTINGS,
        mode="HostPath",
        revision=RevisionRef(REV),
    )
    (init,) = pod_spec(obj)["initContainers"]
    assert init["image"] == "stager:test"
    assert init["command"] == ["dscache-stage"]
    # Built with the contract's StageArgs, so the stager parses exactly what we meant.
    parsed = StageArgs.from_argv(init["args"])
    assert parsed == StageArgs(
        source="s3://bkt/imagenet/",
        revision=REV,
        cache_dir="/dscache",
        pod_uid="$(DSCACHE_POD_UID)",
        endpoint_url="http://s3.local:9000",
        region="eu-west-1",
        addressing_style="path",
        include=("*.tar",),
        exclude=("tmp/*",),
        termination_log="/dev/termination-log",
        agent="http://$(DSCACHE_NODE_IP):9477",
        cache="ml/imagenet",
        peer_token_file="/var/run/dscache-peer/token",
    )
    uid_env = next(e for e in init["env"] if e["name"] == "DSCACHE_POD_UID")
    assert uid_env["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.uid"}}
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in init["env"] if "secretKeyRef" in e.get("valueFrom", {})}
    assert refs["AWS_ACCESS_KEY_ID"] == {"name": "s3-keys", "key": "AWS_ACCESS_KEY_ID", "optional": False}
    assert refs["AWS_SESSION_TOKEN"]["optional"] is True
    sc = init["securityContext"]
    assert sc["runAsUser"] == 0 and sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
    # The pod's own projected token for the agents (fetch once per cluster), read-only, stager only.
    assert init["volumeMounts"] == [
        {"name": VOLUME_NAME, "mountPath": "/dscache"},
        {"name": "dscache-peer-token", "mountPath": "/var/run/dscache-peer", "readOnly": True},
    ]
    vol = next(v for v in pod_spec(obj)["volumes"] if v["name"] == "dscache-peer-token")
    assert vol == {
        "name": "dscache-peer-token",
        "projected": {
            "defaultMode": 0o444,
            "sources": [
                {"serviceAccountToken": {"audience": "dscache-peer", "expirationSeconds": 600, "path": "token"}}
            ],
        },
    }
    # No CA configured: plain HTTP to the agent, and no CA in the stager's env.
    assert "DSCACHE_PEER_CA" not in {e["name"] for e in init["env"]}
    # The API server refuses a projected token in a pod (template) that names no ServiceAccount: the default.
    assert pod_spec(obj)["serviceAccountName"] == "default"


def test_emptydir_mode_runs_non_root():
    obj = job()
    inject_object(
        obj,
        kind="Job",
        namespace="ml",
        cache_name="imagenet",
        spec=spec(),
        settings=SETTINGS,
        mode="EmptyDir",
        revision=RevisionRef(REV),
    )
    ps = pod_spec(obj)
    assert {"name": VOLUME_NAME, "emptyDir": {}} in ps["volumes"]
    sc = ps["initContainers"][0]["securityContext"]
    assert sc["runAsNonRoot"] is True and sc["runAsUser"] != 0
    assert obj["spec"]["template"]["metadata"]["annotations"]["dscache.io/volume"] == "EmptyDir"


def test_csi_mode_gives_the_node_copy_with_no_privilege():
    """The default mode: an inline volume of the agents' driver, and a stager any Pod Security
    level admits (non-root, no capability, no hostPath); the mount holds the lease, so the
    stager writes none."""
    obj = job()
    inject_object(
        obj,
        kind="Job",
        namespace="ml",
        cache_name="imagenet",
        spec=spec(),
        settings=SETTINGS,
        mode="CSI",
        revision=RevisionRef(REV, "2026-01-02T03:04:05Z"),
    )
    ps = pod_spec(obj)
    (vol,) = [v for v in ps["volumes"] if v["name"] == VOLUME_NAME]
    assert vol == {
        "name": VOLUME_NAME,
        "csi": {
            "driver": "cache.dscache.io",
            "volumeAttributes": {"cache": "imagenet", "revision": REV, "asOf": "2026-01-02T03:04:05Z"},
        },
    }
    assert not any("hostPath" in v for v in ps["volumes"])
    init = ps["initContainers"][0]
    sc = init["securityContext"]
    assert (sc["runAsNonRoot"], sc["runAsUser"], sc["allowPrivilegeEscalation"]) == (True, 65532, False)
    assert sc["capabilities"] == {"drop": ["ALL"]} and sc["seccompProfile"] == {"type": "RuntimeDefault"}
    args = StageArgs.from_argv(init["args"])
    assert args.pod_uid is None  # NodePublishVolume took the lease
    assert args.cache == "ml/imagenet" and args.agent is not None  # the node's budget and peers, as with hostPath
    assert "DSCACHE_POD_UID" not in {e["name"] for e in init["env"]}
    # The stager (uid 65532) reads the pod's projected token: fetch once per cluster works non-root.
    (peer,) = [v for v in ps["volumes"] if v["name"] == "dscache-peer-token"]
    assert peer["projected"]["defaultMode"] & 0o004, peer
    assert {"name": "dscache-peer-token", "mountPath": "/var/run/dscache-peer", "readOnly": True} in init[
        "volumeMounts"
    ]
    for c in ps["containers"]:
        assert all(m["readOnly"] for m in c["volumeMounts"] if m["name"] == VOLUME_NAME)
    assert obj["spec"]["template"]["metadata"]["annotations"]["dscache.io/volume"] == "CSI"
    # A pod of this Job passing the webhook again keeps the CSI volume, whatever the namespace says now.
    pod = {"metadata": copy.deepcopy(obj["spec"]["template"]["metadata"]), "spec": copy.deepcopy(ps)}
    assert not inject_object(
        pod,
        kind="Pod",
        namespace="ml",
        cache_name="imagenet",
        spec=spec(),
        settings=SETTINGS,
        mode="EmptyDir",
        revision=RevisionRef(REV2),
    )


def test_no_credentials_means_no_secret_refs():
    s = spec(source={"uri": "s3://bkt/x/"})
    obj = job()
    inject_object(
        obj,
        kind="Job",
        namespace="ml",
        cache_name="imagenet",
        spec=s,
        settings=SETTINGS,
        mode="HostPath",
        revision=RevisionRef(REV),
    )
    # The pod's UID (its lease) and its node's IP (the node agent, asked for room): no Secret.
    assert [e["name"] for e in pod_spec(obj)["initContainers"][0]["env"]] == ["DSCACHE_POD_UID", "DSCACHE_NODE_IP"]


def test_mount_path_clash_is_refused_with_cache_and_fix():
    obj = job(containers=[{"name": "train", "image": "t", "volumeMounts": [{"name": "other", "mountPath": "/data/"}]}])
    with pytest.raises(InjectionError) as e:
        inject_object(
            obj,
            kind="Job",
            namespace="ml",
            cache_name="imagenet",
            spec=spec(),
            settings=SETTINGS,
            mode="HostPath",
            revision=RevisionRef(REV),
        )
    msg = str(e.value)
    assert "imagenet" in msg and "/data" in msg and "spec.mountPath" in msg


def test_pod_injection_and_requested_cache():
    pod = {
        "metadata": {"name": "p", "namespace": "ml", "annotations": {"dscache.io/cache": "imagenet"}},
        "spec": {"containers": [{"name": "c", "image": "i"}]},
    }
    assert injection.requested_cache(pod, "Pod") == "imagenet"
    assert injection.requested_cache(job(annotate_template=True), "Job") == "imagenet"
    assert injection.requested_cache({"metadata": {}}, "Pod") is None
    inject_object(
        pod,
        kind="Pod",
        namespace="ml",
        cache_name="imagenet",
        spec=spec(),
        settings=SETTINGS,
        mode="HostPath",
        revision=RevisionRef(REV),
    )
    assert [c["name"] for c in pod["spec"]["initContainers"]] == [STAGER_CONTAINER_NAME]


# --- the handler itself, through the admission server's path ------------------------


class FakeIndex(dict):
    """kopf.Index maps keys to stores (iterables of values)."""


def view(phase="Ready", reason="Listed", message="", deleting=False, revision=PIN, pins=None):
    return webhook.CacheView(spec(), phase, reason, message, deleting, None, revision, pins)


def review_body(obj, kind="jobs") -> bytes:
    """An AdmissionReview of CREATE ``obj`` in namespace ml, as the API server sends it."""
    group = "batch" if kind == "jobs" else ""
    gvr = {"group": group, "version": "v1", "resource": kind}
    request = {
        "uid": "u-review",
        "kind": {"group": group, "version": "v1", "kind": "Job" if kind == "jobs" else "Pod"},
        "resource": gvr,
        "requestKind": {"group": group, "version": "v1", "kind": "Job" if kind == "jobs" else "Pod"},
        "namespace": "ml",
        "operation": "CREATE",
        "userInfo": {"username": "alice"},
        "object": obj,
        "oldObject": None,
        "dryRun": False,
    }
    return json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": request}).encode()


def run_mutate(obj, index, kind="jobs", mode="HostPath", kube=None, nodes=None, warnings=None, settings=SETTINGS):
    """One review answered as the server answers it (admission.review over webhook.mutate):
    returns the JSON patch ops and ``obj`` with them applied; a refusal is raised again as
    kopf.AdmissionError with the answer's message and code. ``nodes``: the node index
    (placement); ``warnings``: receives the answer's warnings."""
    ctx = Context(settings=settings, kube=kube)
    decide = webhook.make_decider(ctx, index, nodes)
    out = asyncio.run(admission.review(webhook.VolumeMode(mode), review_body(obj, kind), decide))
    response = out["response"]
    assert response["uid"] == "u-review" and out["kind"] == "AdmissionReview"
    if not response["allowed"]:
        raise kopf.AdmissionError(response["status"]["message"], code=response["status"]["code"])
    if warnings is not None:
        warnings.extend(response.get("warnings") or [])
    ops = json.loads(base64.b64decode(response["patch"])) if "patch" in response else []
    assert bool(ops) == ("patchType" in response)
    return ops, jsonpatch.apply_patch(copy.deepcopy(obj), ops)


def test_handler_injects_through_a_json_patch():
    ops, result = run_mutate(job(), FakeIndex({("ml", "imagenet"): [view()]}))
    assert ops
    assert [c["name"] for c in pod_spec(result)["initContainers"]] == [STAGER_CONTAINER_NAME]
    # Re-running on the result (reinvocation) changes nothing.
    ops2, result2 = run_mutate(result, FakeIndex({("ml", "imagenet"): [view()]}))
    assert ops2 == [] and result2 == result


def test_handler_ignores_objects_that_did_not_opt_in():
    obj = job()
    del obj["metadata"]["annotations"]
    ops, result = run_mutate(obj, FakeIndex())
    assert ops == [] and result == obj


def test_handler_refuses_unknown_cache(monkeypatch):
    async def no_cache(ns, name):
        return None

    class K:
        get_cache = staticmethod(no_cache)

    with pytest.raises(kopf.AdmissionError) as e:
        run_mutate(job(), FakeIndex(), kube=K())
    assert "DatasetCache ml/imagenet does not exist" in str(e.value)
    assert "dscache.io/cache" in str(e.value)


def test_handler_cold_index_falls_back_to_the_api(monkeypatch):
    async def found(ns, name):
        return {
            "metadata": {"name": name, "namespace": ns},
            "spec": spec().model_dump(exclude_none=True),
            "status": {"phase": "Ready", "revision": {"id": REV}},
        }

    class K:
        get_cache = staticmethod(found)

    _ops, result = run_mutate(job(), FakeIndex(), kube=K())
    assert [c["name"] for c in pod_spec(result)["initContainers"]] == [STAGER_CONTAINER_NAME]


def test_handler_refuses_broken_and_deleting_caches():
    broken = view(phase="Failed", reason="NoSuchBucket", message="bucket 'bkt' does not exist")
    with pytest.raises(kopf.AdmissionError) as e:
        run_mutate(job(), FakeIndex({("ml", "imagenet"): [broken]}))
    assert "ml/imagenet is broken: NoSuchBucket" in str(e.value)
    with pytest.raises(kopf.AdmissionError) as e:
        run_mutate(job(), FakeIndex({("ml", "imagenet"): [view(deleting=True)]}))
    assert "being deleted" in str(e.value)


def test_handler_refuses_mount_clash():
    obj = job(containers=[{"name": "train", "image": "t", "volumeMounts": [{"name": "x", "mountPath": "/data"}]}])
    with pytest.raises(kopf.AdmissionError) as e:
        run_mutate(obj, FakeIndex({("ml", "imagenet"): [view()]}))
    assert "clashes" in str(e.value)


def _api_returns(monkeypatch, phase, reason=None, message=None, revision=None):
    async def get_cache(ns, name):
        status = {"phase": phase}
        if revision:
            status["revision"] = {"id": revision}
        if reason:
            status["conditions"] = [{"type": "SourceReady", "status": "False", "reason": reason, "message": message}]
        return {
            "metadata": {"name": name, "namespace": ns},
            "spec": spec().model_dump(exclude_none=True),
            "status": status,
        }

    class K:
        pass

    K.get_cache = staticmethod(get_cache)
    return K()


def test_pending_cache_is_admitted(monkeypatch):
    """Pending in the index but pinned by now (a cache created with its Job)."""
    kube = _api_returns(monkeypatch, "Ready", revision=REV)
    ops, _result = run_mutate(job(), FakeIndex({("ml", "imagenet"): [view(phase="Pending", revision=None)]}), kube=kube)
    assert ops


def test_pending_in_index_is_rechecked_against_the_api(monkeypatch):
    kube = _api_returns(monkeypatch, "Failed", "NoSuchBucket", "bucket 'bkt' does not exist")
    with pytest.raises(kopf.AdmissionError) as e:
        run_mutate(job(), FakeIndex({("ml", "imagenet"): [view(phase="Pending")]}), kube=kube)
    assert "NoSuchBucket" in str(e.value)


def test_reinjection_keeps_the_original_mode():
    obj = job()
    inject_object(
        obj,
        kind="Job",
        namespace="ml",
        cache_name="imagenet",
        spec=spec(),
        settings=SETTINGS,
        mode="HostPath",
        revision=RevisionRef(REV),
    )
    pod = {
        "metadata": copy.deepcopy(obj["spec"]["template"]["metadata"]),
        "spec": copy.deepcopy(obj["spec"]["template"]["spec"]),
    }
    before = copy.deepcopy(pod)
    # The namespace switched to emptyDir mode between the Job and its pod.
    assert not inject_object(
        pod,
        kind="Pod",
        namespace="ml",
        cache_name="imagenet",
        spec=spec(),
        settings=SETTINGS,
        mode="EmptyDir",
        revision=RevisionRef(REV2),
    )
    assert pod == before and pod["metadata"]["annotations"]["dscache.io/volume"] == "HostPath"


def test_unpinned_cache_is_refused_with_the_reason(monkeypatch):
    kube = _api_returns(monkeypatch, "Ready", "Listed", "no revision recorded yet")
    monkeypatch.setattr(webhook, "FIRST_REVISION_WAIT", 0.3)
    with pytest.raises(kopf.AdmissionError) as e:
        run_mutate(job(), FakeIndex(), kube=kube)
    assert "no pinned revision" in str(e.value) and "secretRef" in str(e.value)
    assert "spec.source.serviceAccountName" in str(e.value)


def test_job_pods_keep_the_template_revision_after_a_refresh():
    obj = job()
    inject_object(
        obj,
        kind="Job",
        namespace="ml",
        cache_name="imagenet",
        spec=spec(),
        settings=SETTINGS,
        mode="HostPath",
        revision=RevisionRef(REV),
    )
    pod = {
        "metadata": copy.deepcopy(obj["spec"]["template"]["metadata"]),
        "spec": copy.deepcopy(obj["spec"]["template"]["spec"]),
    }
    # The cache moved on to REV2; a pod the Job creates later still stages REV.
    _ops, result = run_mutate(pod, FakeIndex({("ml", "imagenet"): [view(revision=RevisionRef(REV2))]}), kind="pods")
    assert result["metadata"]["annotations"]["dscache.io/revision"] == REV
    (init,) = result["spec"]["initContainers"]
    assert StageArgs.from_argv(init["args"]).revision == REV


def test_pods_of_other_owners_reuse_their_owners_revision():
    pod = {
        "metadata": {
            "name": "w-1",
            "namespace": "ml",
            "annotations": {"dscache.io/cache": "imagenet"},
            "ownerReferences": [
                {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "name": "pt", "uid": "u-pt", "controller": True}
            ],
        },
        "spec": {"containers": [{"name": "c", "image": "i"}]},
    }
    index = FakeIndex({("ml", "imagenet"): [view(revision=RevisionRef(REV2), pins={"u-pt": RevisionRef(REV)})]})
    _ops, result = run_mutate(pod, index, kind="pods")
    assert result["metadata"]["annotations"]["dscache.io/revision"] == REV
    pod["metadata"]["ownerReferences"][0]["uid"] = "u-other"
    _ops, result = run_mutate(pod, index, kind="pods")
    assert result["metadata"]["annotations"]["dscache.io/revision"] == REV2


def test_versioned_pins_carry_their_as_of_time_to_pod_and_stager():
    """A revision pinned in a versioned bucket travels with its as-of time: from
    status.revision for a new pod, from the owner's pin for its later pods, and
    never the cache's time with an owner's older revision."""
    t1, t2 = "2026-01-01T00:00:00Z", "2026-02-01T00:00:00Z"
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "w",
            "namespace": "ml",
            "annotations": {"dscache.io/cache": "imagenet"},
            "ownerReferences": [
                {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "name": "pt", "uid": "u-pt", "controller": True}
            ],
        },
        "spec": {"containers": [{"name": "c", "image": "i"}]},
    }

    def stager_argv(result):
        return next(c for c in result["spec"]["initContainers"] if c["name"] == STAGER_CONTAINER_NAME)["args"]

    index = FakeIndex({("ml", "imagenet"): [view(revision=RevisionRef(REV2, t2), pins={"u-pt": RevisionRef(REV, t1)})]})
    _ops, result = run_mutate(copy.deepcopy(pod), index, kind="pods")
    assert result["metadata"]["annotations"]["dscache.io/revision-as-of"] == t1
    args = StageArgs.from_argv(stager_argv(result))
    assert (args.revision, args.as_of) == (REV, t1)
    # An owner pinned before the bucket was versioned: no time, even though the cache has one now.
    index = FakeIndex({("ml", "imagenet"): [view(revision=RevisionRef(REV2, t2), pins={"u-pt": RevisionRef(REV)})]})
    _ops, result = run_mutate(copy.deepcopy(pod), index, kind="pods")
    assert "dscache.io/revision-as-of" not in result["metadata"]["annotations"]
    assert StageArgs.from_argv(stager_argv(result)).as_of is None
    pod["metadata"]["ownerReferences"][0]["uid"] = "u-other"
    _ops, result = run_mutate(copy.deepcopy(pod), index, kind="pods")
    assert result["metadata"]["annotations"]["dscache.io/revision-as-of"] == t2
    assert StageArgs.from_argv(stager_argv(result)).as_of == t2


def test_bad_as_of_annotation_is_refused():
    obj = job()
    obj["spec"]["template"]["metadata"]["annotations"] = {
        "dscache.io/revision": REV,
        "dscache.io/revision-as-of": "yesterday",
    }
    with pytest.raises(kopf.AdmissionError) as e:
        run_mutate(obj, FakeIndex({("ml", "imagenet"): [view()]}))
    assert "revision-as-of" in str(e.value) and "malformed" in str(e.value)


def test_an_as_of_annotation_without_its_revision_is_refused():
    """Left alone it would be paired with the cache's current revision: a time that
    belongs to another listing (or, unversioned, to none), on the pod and in its pins."""
    obj = job()
    obj["spec"]["template"]["metadata"]["annotations"] = {"dscache.io/revision-as-of": "2026-01-01T00:00:00Z"}
    for current in (PIN, RevisionRef(REV2, "2026-02-01T00:00:00Z")):
        with pytest.raises(kopf.AdmissionError) as e:
            run_mutate(obj, FakeIndex({("ml", "imagenet"): [view(revision=current)]}))
        assert "revision-as-of" in str(e.value) and "without dscache.io/revision" in str(e.value)


def test_a_carried_revision_that_disagrees_with_the_cache_on_versioning_is_refused():
    """A versioned revision's id digests versionIds, so it is never served without its
    as-of time (the stager would fail later); the webhook knows the time and says so."""
    t1 = "2026-01-01T00:00:00Z"
    obj = job()
    obj["spec"]["template"]["metadata"]["annotations"] = {"dscache.io/revision": REV}
    for known in ({"revision": RevisionRef(REV, t1)}, {"revision": PIN, "pins": {"u-x": RevisionRef(REV, t1)}}):
        with pytest.raises(kopf.AdmissionError) as e:
            run_mutate(obj, FakeIndex({("ml", "imagenet"): [view(**known)]}))
        assert f"Add dscache.io/revision-as-of={t1}" in str(e.value), known
    obj["spec"]["template"]["metadata"]["annotations"]["dscache.io/revision-as-of"] = t1
    with pytest.raises(kopf.AdmissionError) as e:
        run_mutate(obj, FakeIndex({("ml", "imagenet"): [view(revision=PIN)]}))
    assert "unversioned" in str(e.value) and "remove dscache.io/revision-as-of" in str(e.value)
    # Agreeing, or a revision the cache no longer lists: admitted as carried.
    for current in (RevisionRef(REV, t1), RevisionRef(REV2)):
        _ops, result = run_mutate(obj, FakeIndex({("ml", "imagenet"): [view(revision=current)]}))
        tmeta = result["spec"]["template"]["metadata"]
        assert RevisionRef.from_annotations(tmeta["annotations"], "imagenet") == RevisionRef(REV, t1)


def test_cache_view_reads_status_revisions_as_whole_values():
    t1, t2 = "2026-01-01T00:00:00Z", "2026-02-01T00:00:00Z"
    body = {
        "spec": spec().model_dump(mode="json", exclude_none=True),
        "status": {
            "phase": "Ready",
            "revision": {"id": REV2, "objects": 1, "bytes": 1, "versioned": True, "asOf": t2},
            "owners": [
                {"uid": "u-a", "kind": "Job", "name": "a", "revision": REV, "asOf": t1},
                {"uid": "u-b", "kind": "Job", "name": "b", "revision": REV},
                {"uid": "u-c", "kind": "Job", "name": "c", "revision": REV, "asOf": "garbage"},
            ],
        },
    }
    got = webhook.cache_view(body)
    assert got.revision == RevisionRef(REV2, t2)
    # An unreadable pin is kept as unreadable, never half-read.
    assert got.pins == {"u-a": RevisionRef(REV, t1), "u-b": RevisionRef(REV), "u-c": None}
    # ...and refuses that owner's pods: status.revision (REV2) would give its pods two revisions.
    pod = {
        "metadata": {
            "name": "w-1",
            "namespace": "ml",
            "annotations": {"dscache.io/cache": "imagenet"},
            "ownerReferences": [{"apiVersion": "v1", "kind": "X", "name": "c", "uid": "u-c", "controller": True}],
        },
        "spec": {"containers": [{"name": "c", "image": "i"}]},
    }
    with pytest.raises(kopf.AdmissionError) as e:
        run_mutate(pod, FakeIndex({("ml", "imagenet"): [got]}), kind="pods")
    assert "status.owners" in str(e.value) and "u-c" in str(e.value) and "retry" in str(e.value)
    pod["metadata"]["ownerReferences"][0]["uid"] = "u-a"
    _ops, result = run_mutate(pod, FakeIndex({("ml", "imagenet"): [got]}), kind="pods")
    assert RevisionRef.from_annotations(result["metadata"]["annotations"], "imagenet") == RevisionRef(REV, t1)
    body["status"]["revision"] = {"id": "nonsense"}
    assert webhook.cache_view(body).revision is None


def test_bad_revision_annotation_is_refused():
    obj = job()
    obj["spec"]["template"]["metadata"]["annotations"] = {"dscache.io/revision": "../../etc"}
    with pytest.raises(kopf.AdmissionError) as e:
        run_mutate(obj, FakeIndex({("ml", "imagenet"): [view()]}))
    assert "not a revision id" in str(e.value)


def test_stager_runs_first_and_every_other_mount_is_read_only():
    obj = job(
        containers=[
            {
                "name": "train",
                "image": "t",
                "volumeMounts": [
                    {"name": VOLUME_NAME, "mountPath": "/data"},  # at our path
                    {"name": VOLUME_NAME, "mountPath": "/raw"},
                ],
            },  # their own
        ]
    )
    obj["spec"]["template"]["spec"]["initContainers"] = [
        {
            "name": "poison",
            "image": "busybox",
            "command": ["sh", "-c", "echo x > /c/y"],
            "volumeMounts": [{"name": VOLUME_NAME, "mountPath": "/c", "readOnly": False}],
        },
        {"name": "mesh", "image": "proxy", "restartPolicy": "Always"},
    ]
    inject_object(
        obj,
        kind="Job",
        namespace="ml",
        cache_name="imagenet",
        spec=spec(),
        settings=SETTINGS,
        mode="HostPath",
        revision=RevisionRef(REV),
    )
    ps = pod_spec(obj)
    assert [c["name"] for c in ps["initContainers"]] == [STAGER_CONTAINER_NAME, "poison", "mesh"]
    for c in ps["initContainers"][1:] + ps["containers"]:
        for m in c.get("volumeMounts") or []:
            if m["name"] == VOLUME_NAME:
                assert m["readOnly"] is True, (c["name"], m)
                assert m["subPath"].startswith(f"revs/{REV}/"), (c["name"], m)
    (stager,) = [c for c in ps["initContainers"] if c["name"] == STAGER_CONTAINER_NAME]
    assert stager["volumeMounts"][0] == {"name": VOLUME_NAME, "mountPath": "/dscache"}
    assert all(m.get("readOnly") for m in stager["volumeMounts"][1:]), stager["volumeMounts"]
    # The user's writable mount at /data became exactly ours.
    train = ps["containers"][0]
    assert {"name": VOLUME_NAME, "mountPath": "/data", "readOnly": True, "subPath": f"revs/{REV}/data"} in train[
        "volumeMounts"
    ]
    assert sum(1 for m in train["volumeMounts"] if m["mountPath"] == "/data") == 1
    # Idempotent.
    again = copy.deepcopy(obj)
    assert not inject_object(
        again,
        kind="Job",
        namespace="ml",
        cache_name="imagenet",
        spec=spec(),
        settings=SETTINGS,
        mode="HostPath",
        revision=RevisionRef(REV),
    )
    assert again == obj


def test_the_registered_indexes_are_the_ones_the_server_reads():
    """kopf passes each index to every handler (startup ones too) under its handler id; the
    startup handler that starts the admission server takes it by this name. A nested
    function's default id is its qualname (make_registry.<locals>...): the start-up
    would fail on the missing name. DatasetCaches are no kopf index (our informer keeps them)."""
    registry = webhook.make_registry()
    ids = [h.id for h in registry._indexing.get_all_handlers()]
    assert ids == [webhook.NODES_INDEX] == ["dscache_nodes"], ids
    assert registry._watching.get_all_handlers() == [] and registry._changing.get_all_handlers() == []
    # No kopf admission handler is left: kopf would start its own webhook server for one.
    assert registry._webhooks.get_all_handlers() == []


def test_with_the_agents_ca_the_stager_speaks_tls_and_trusts_that_ca(tmp_path):
    """The chart's agent TLS: the webhook gives the stager the CA (PEM, in its env) and an https
    --agent; no other container gets either."""
    ca = tmp_path / "ca.crt"
    ca.write_text("-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n")
    settings = Settings(cache_root="/mnt/nvme/dscache", stager_image="stager:test", agent_ca_file=str(ca))
    obj = job()
    inject_object(
        obj,
        kind="Job",
        namespace="ml",
        cache_name="imagenet",
        spec=spec(),
        settings=settings,
        mode="HostPath",
        revision=RevisionRef(REV),
    )
    (init,) = pod_spec(obj)["initContainers"]
    assert StageArgs.from_argv(init["args"]).agent == "https://$(DSCACHE_NODE_IP):9477"
    env = {e["name"]: e.get("value") for e in init["env"]}
    assert env["DSCACHE_PEER_CA"] == ca.read_text().strip()
    for c in pod_spec(obj)["containers"]:
        assert "DSCACHE_PEER_CA" not in {e["name"] for e in c.get("env") or []}


def _cohort_of(obj: dict, kind: str, settings: Settings = SETTINGS) -> bool:
    inject_object(
        obj,
        kind=kind,
        namespace="ml",
        cache_name="imagenet",
        spec=spec(),
        settings=settings,
        mode="CSI",
        revision=PIN,
    )
    ps = pod_spec(obj) if kind == "Job" else obj["spec"]
    return StageArgs.from_argv(ps["initContainers"][0]["args"]).cohort


def _labelled_pod(labels: dict[str, str]) -> dict:
    return {
        "metadata": {"name": "p", "namespace": "ml", "labels": labels, "annotations": {"dscache.io/cache": "imagenet"}},
        "spec": {"containers": [{"name": "train", "image": "trainer:1"}]},
    }


def test_a_gang_gets_cohort_and_a_lone_pod_lists_at_once():
    """--cohort (the stager waits a moment for peers before it lists the bucket) only where pods start
    together: a lone Job's stager would wait 0.4 s for nobody."""
    assert not _cohort_of(job(), "Job"), "a Job of one pod at a time starts alone"
    parallel = job()
    parallel["spec"]["parallelism"] = 4
    assert _cohort_of(parallel, "Job")
    child = job()  # a JobSet's child Job: parallelism 1, one Job per replica
    child["metadata"]["labels"] = {"jobset.sigs.k8s.io/jobset-name": "train"}
    assert _cohort_of(child, "Job")
    assert _cohort_of(_labelled_pod({"training.kubeflow.org/job-name": "pt"}), "Pod")  # a PyTorchJob's worker
    assert _cohort_of(_labelled_pod({"batch.kubernetes.io/job-completion-index": "3"}), "Pod")
    assert not _cohort_of(_labelled_pod({"app": "notebook"}), "Pod")
    no_peers = Settings(cache_root="/mnt/nvme/dscache", stager_image="stager:test", peers=False)
    fresh = job()
    fresh["spec"]["parallelism"] = 4
    assert not _cohort_of(fresh, "Job", no_peers), "--cohort is about peers: none without them"
