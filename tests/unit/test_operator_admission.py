"""The webhook's AdmissionReview server (admission.py): the JSON patch, the answers, and a
real TLS server on loopback (its endpoints, status codes and certificate reload)."""

from __future__ import annotations

import asyncio
import base64
import copy
import functools
import json
import os
import ssl
import time
from pathlib import Path

import jsonpatch
import kopf
import pytest

from dscache_operator.admission import server as admission
from dscache_operator.admission import webhook
from dscache_operator.api.models import FINALIZER, VolumeMode
from tests.support.kubeapi import make_ca, make_cert
from tests.support.s3server import free_port
from tests.unit.test_operator_injection import job, review_body

# --- json_patch --------------------------------------------------------------------------

CASES = [
    ({}, {}),
    ({"a": 1}, {"a": 1}),
    ({"a": 1}, {"a": 2}),
    ({"a": 1}, {}),
    ({}, {"a": {"b": [1, 2]}}),
    ({"a": [1, 2]}, {"a": [1, 2, 3]}),
    ({"a": [1, 2, 3]}, {"a": [3]}),
    ({"a": {"b": 1, "c": 2}}, {"a": {"b": 1, "c": 3, "d": None}}),
    ({"a": None}, {"a": {"x": 1}}),
    # Keys a JSON pointer must escape (annotation keys have a slash).
    ({"m": {"dscache.io/cache": "x"}}, {"m": {"dscache.io/cache": "y", "a~b/c": "z"}}),
    # JSON types, not Python equality: true is not 1, 1 is not 1.0.
    ({"a": 1}, {"a": True}),
    ({"a": [1]}, {"a": [1.0]}),
    ({"a": {"b": False}}, {"a": {"b": 0}}),
]


@pytest.mark.parametrize("old,new", CASES)
def test_json_patch_turns_the_old_value_into_the_new(old, new):
    ops = admission.json_patch(old, new)
    got = jsonpatch.apply_patch(copy.deepcopy(old), ops)
    assert json.dumps(got, sort_keys=True) == json.dumps(new, sort_keys=True)
    assert (ops == []) == (json.dumps(old, sort_keys=True) == json.dumps(new, sort_keys=True))


def test_json_patch_of_an_injected_job_applies_to_what_was_sent():
    """The object as the API server holds it, patched, is the object as mutated."""
    sent = job()
    mutated = copy.deepcopy(sent)
    mutated["metadata"]["labels"] = {"dscache.io/consumer": "true"}
    spec = mutated["spec"]["template"]["spec"]
    spec["initContainers"] = [{"name": "dscache-stage", "image": "s:1"}]
    spec["containers"][0]["env"] = [{"name": "DSCACHE_DIR", "value": "/data"}]
    del spec["restartPolicy"]
    ops = admission.json_patch(sent, mutated)
    assert jsonpatch.apply_patch(sent, ops) == mutated
    assert {"op": "remove", "path": "/spec/template/spec/restartPolicy"} in ops


# --- one review ----------------------------------------------------------------------------


def decided(changes=None, warnings=(), error=None):
    """A decider that applies ``changes`` (a function of the object), or raises ``error``."""
    calls = []

    async def decide(mode, kind, namespace, obj):
        calls.append((mode, kind, namespace, copy.deepcopy(obj)))
        if error is not None:
            raise error
        if changes is None:
            return False, list(warnings)
        changes(obj)
        return True, list(warnings)

    return decide, calls


def label(obj):
    obj["metadata"].setdefault("labels", {})["dscache.io/consumer"] = "true"


def run(body, decide, mode=VolumeMode.HOST_PATH, observe=None):
    return asyncio.run(admission.review(mode, body, decide, observe))


def test_a_mutated_object_is_answered_with_its_patch_and_warnings():
    seen = []
    decide, calls = decided(label, warnings=["mind the gap"])
    out = run(review_body(job()), decide, observe=lambda *a: seen.append(a))
    assert out["apiVersion"] == "admission.k8s.io/v1" and out["kind"] == "AdmissionReview"
    r = out["response"]
    assert r["uid"] == "u-review" and r["allowed"] is True and r["patchType"] == "JSONPatch"
    assert r["warnings"] == ["mind the gap"] and "status" not in r
    ops = json.loads(base64.b64decode(r["patch"]))
    assert jsonpatch.apply_patch(job(), ops)["metadata"]["labels"] == {"dscache.io/consumer": "true"}
    assert [(m, k, ns) for m, k, ns, _ in calls] == [(VolumeMode.HOST_PATH, "Job", "ml")]
    assert calls[0][3] == job()  # the decider gets the object as sent
    assert [s[:2] for s in seen] == [("HostPath", "admitted")] and seen[0][2] >= 0


def test_an_unchanged_object_gets_no_patch_even_if_touched():
    """Only a change the decider reports makes a patch (as kopf's handler did): an object
    that did not opt in, or is injected already, is admitted as it is."""

    async def touch(mode, kind, namespace, obj):
        obj.setdefault("spec", {}).setdefault("extra", [])
        return False, []

    r = run(review_body(job()), touch)["response"]
    assert r["allowed"] is True and "patch" not in r and "patchType" not in r


def test_a_refusal_is_an_answer_with_its_message_and_code():
    seen = []
    decide, _ = decided(error=kopf.AdmissionError("DatasetCache ml/x does not exist.", code=400))
    r = run(review_body(job()), decide, mode=VolumeMode.EMPTY_DIR, observe=lambda *a: seen.append(a))["response"]
    assert r["allowed"] is False and r["status"] == {"message": "DatasetCache ml/x does not exist.", "code": 400}
    assert "patch" not in r and [s[:2] for s in seen] == [("EmptyDir", "refused")]


def test_an_unexpected_error_refuses_with_500():
    seen = []
    decide, _ = decided(error=RuntimeError("boom"))
    r = run(review_body(job()), decide, observe=lambda *a: seen.append(a))["response"]
    assert r["allowed"] is False and r["status"] == {"message": "boom", "code": 500}
    assert [s[:2] for s in seen] == [("HostPath", "error")]


def edit(body: bytes, fn) -> bytes:
    doc = json.loads(body)
    fn(doc)
    return json.dumps(doc).encode()


@pytest.mark.parametrize(
    "change",
    [
        lambda d: d["request"].update(operation="UPDATE"),
        lambda d: d["request"].update(subResource="status"),
        lambda d: d["request"].update(resource={"group": "apps", "version": "v1", "resource": "deployments"}),
    ],
    ids=["update", "subresource", "other-resource"],
)
def test_what_is_not_a_create_of_a_job_or_pod_is_allowed_untouched(change):
    decide, calls = decided(label)
    r = run(edit(review_body(job()), change), decide)["response"]
    assert r == {"uid": "u-review", "allowed": True} and calls == []


def test_a_pod_is_decided_as_a_pod_and_the_request_namespace_is_the_fallback():
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}, "spec": {"containers": []}}
    decide, calls = decided()
    run(review_body(pod, kind="pods"), decide)
    assert [(k, ns) for _m, k, ns, _o in calls] == [("Pod", "ml")]


@pytest.mark.parametrize(
    "body",
    [
        b"not json",
        b"[]",
        b'{"request": {}}',
        edit(review_body(job()), lambda d: d["request"].pop("userInfo")),
        edit(review_body(job()), lambda d: d["request"].update(object=None)),
        edit(review_body(job()), lambda d: d["request"].pop("uid")),
    ],
    ids=["not-json", "not-an-object", "no-uid", "no-user", "no-object", "no-uid-with-object"],
)
def test_a_body_that_is_not_a_review_is_a_bad_request(body):
    decide, calls = decided(label)
    with pytest.raises(admission.BadReview):
        run(body, decide)
    assert calls == []


# --- new DatasetCaches: the controller's finalizer ----------------------------------------------


def cache_review(finalizers=None, namespace="ml", operation="CREATE") -> bytes:
    meta = {"name": "imagenet", "namespace": namespace} | ({"finalizers": finalizers} if finalizers else {})
    cache = {"apiVersion": "dscache.io/v1alpha1", "kind": "DatasetCache", "metadata": meta, "spec": {}}
    resource = {"group": "dscache.io", "version": "v1alpha1", "resource": "datasetcaches"}
    request = {
        "uid": "u-review",
        "kind": {"group": "dscache.io", "version": "v1alpha1", "kind": "DatasetCache"},
        "resource": resource,
        "namespace": namespace,
        "operation": operation,
        "userInfo": {"username": "alice"},
        "object": cache,
    }
    return json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": request}).encode()


def claimed(body: bytes, watched=()) -> list[str] | None:
    """The finalizers of the cache as the API server stores it (None: no patch)."""
    r = admission.review_cache(body, functools.partial(webhook.claim_cache, watched))["response"]
    assert r["uid"] == "u-review" and r["allowed"] is True
    if "patch" not in r:
        return None
    sent = json.loads(body)["request"]["object"]
    return jsonpatch.apply_patch(sent, json.loads(base64.b64decode(r["patch"])))["metadata"]["finalizers"]


def test_a_new_cache_gets_the_controllers_finalizer_beside_its_own():
    assert claimed(cache_review()) == [FINALIZER]
    assert claimed(cache_review(["example.com/keep"])) == ["example.com/keep", FINALIZER]
    assert claimed(cache_review([FINALIZER])) is None  # there already: no patch
    assert claimed(cache_review(operation="UPDATE")) is None


def test_a_cache_outside_the_watched_namespaces_gets_no_finalizer():
    """Nothing there would ever remove it (the controller does not see that namespace)."""
    assert claimed(cache_review(namespace="other"), watched=("ml",)) is None
    assert claimed(cache_review(namespace="ml"), watched=("ml",)) == [FINALIZER]


def test_a_cache_is_admitted_as_sent_when_claiming_it_fails():
    def broken(namespace, obj):
        raise RuntimeError("boom")

    r = admission.review_cache(cache_review(), broken)["response"]
    assert r == {"uid": "u-review", "allowed": True}


# --- the server ------------------------------------------------------------------------------


@pytest.fixture
def pki(tmp_path) -> Path:
    make_ca(tmp_path)
    make_cert(tmp_path, "serving", "/CN=dscache-webhook", sans="IP:127.0.0.1")
    return tmp_path


async def post(port: int, path: str, body: bytes, cafile: Path) -> tuple[int, dict | None, bytes]:
    """One request on a new connection; (status, JSON body or None, the server's certificate)."""
    ctx = ssl.create_default_context(cafile=str(cafile))
    reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=ctx)
    der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    writer.write(head.encode() + b"Connection: close\r\n\r\n" + body)
    raw = await reader.read()
    writer.close()
    status = int(raw.split(b" ", 2)[1])
    payload = raw.split(b"\r\n\r\n", 1)[1]
    try:
        return status, json.loads(payload), der
    except ValueError:
        return status, None, der


def test_the_server_answers_over_tls_and_reloads_a_renewed_certificate(pki):
    decide, calls = decided(label)
    port = free_port()

    async def main():
        server = admission.Server(
            decide,
            addr="127.0.0.1",
            port=port,
            certfile=str(pki / "serving.crt"),
            keyfile=str(pki / "serving.key"),
            claim=functools.partial(webhook.claim_cache, ()),
            cert_check_interval=3600,
        )
        await server.start()
        try:
            status, out, first = await post(port, "/dscache-emptydir", review_body(job()), pki / "ca.crt")
            assert status == 200 and out["response"]["allowed"] and out["response"]["patch"]
            assert calls[-1][0] == VolumeMode.EMPTY_DIR
            status, out, _ = await post(port, "/dscache-caches", cache_review(), pki / "ca.crt")
            assert status == 200 and out["response"]["allowed"] and out["response"]["patch"]
            status, _, _ = await post(port, "/dscache-hostpath", b"{}", pki / "ca.crt")
            assert status == 400
            status, _, _ = await post(port, "/elsewhere", review_body(job()), pki / "ca.crt")
            assert status == 404
            assert len(calls) == 1
            # Renewed (a Secret update swaps both files): new connections get the new one.
            assert not server.reload_if_changed()
            make_cert(pki, "serving", "/CN=dscache-webhook", sans="IP:127.0.0.1")
            later = time.time() + 5
            os.utime(pki / "serving.crt", (later, later))
            assert server.reload_if_changed()
            status, _, second = await post(port, "/dscache-hostpath", review_body(job()), pki / "ca.crt")
            assert status == 200 and second != first
            # A pair that does not load (a key that is not the certificate's) keeps the old one.
            (pki / "serving.key").write_text((pki / "ca.key").read_text())
            assert not server.reload_if_changed()
            status, _, third = await post(port, "/dscache-hostpath", review_body(job()), pki / "ca.crt")
            assert status == 200 and third == second
        finally:
            await server.stop()

    asyncio.run(main())
