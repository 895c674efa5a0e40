"""The webhook's HTTPS server: AdmissionReviews in, their responses out.

What the API server sends (``admission.k8s.io/v1`` AdmissionReview) to one of
two endpoints, ``/dscache-hostpath`` and ``/dscache-emptydir`` (the volume mode;
see operator/deploy/webhook.yaml), is answered here and decided by
``webhook.mutate``; the answer carries a JSON patch from the object as sent to
the object as mutated (``json_patch``). A third, ``/dscache-caches``, gets each new
DatasetCache and puts the controller's finalizer on it (``webhook.claim_cache``).

Why not kopf's WebhookServer and admission engine (which this replaced): per
review they cost about 1.8 ms of CPU here, most of it turning the mutated
object back into a patch (a deep copy and python-jsonpatch's generic diff of
the whole object), the rest building a handler context (loggers, memos, a
progress state) that a stateless mutation never reads. At 1,000 reviews/s
that is more than a core. kopf still runs the process (log-in, the cache and
node indexes, liveness); this server only answers reviews.

HTTP answers: 200 with a response for every well-formed review (a refusal is
``allowed: false`` with its message and code; an unexpected error too, code
500, as kopf answered); 400 for a body that is not an AdmissionReview (the API
server then applies the webhook's failurePolicy, Fail); 404 for other paths.
Only ``CREATE`` of jobs (batch/v1) and pods (v1) without a subresource is
mutated, as registered before; any other review is allowed unchanged.

The serving certificate and key are re-read when their files change (checked
every ``cert_check_interval`` seconds): a renewed Secret needs no restart. New
connections get the new certificate; kept-alive ones keep theirs.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import ssl
import time
from collections.abc import Awaitable, Callable
from typing import Any

import kopf
from aiohttp import web

from ..api.models import VolumeMode

logger = logging.getLogger(__name__)

#: URL path -> the volume mode its reviews are injected with.
ENDPOINTS = {
    "/dscache-csi": VolumeMode.CSI,
    "/dscache-hostpath": VolumeMode.HOST_PATH,
    "/dscache-emptydir": VolumeMode.EMPTY_DIR,
}
#: (group, version, plural) of what is mutated -> its kind.
RESOURCES = {("batch", "v1", "jobs"): "Job", ("", "v1", "pods"): "Pod"}
#: URL path of new DatasetCaches' reviews (our finalizer, from creation on).
CACHES_ENDPOINT = "/dscache-caches"
CACHES = ("dscache.io", "datasetcaches")

#: Decides one review: (mode, kind, namespace, object) -> (changed, warnings); mutates the
#: object in place; raises kopf.AdmissionError to refuse it (webhook.make_decider).
Decide = Callable[[VolumeMode, str, str, dict[str, Any]], Awaitable[tuple[bool, list[str]]]]
#: Told of every answered review: (mode, "admitted" | "refused" | "error", seconds).
Observe = Callable[[str, str, float], None]
#: Claims one new DatasetCache: (namespace, object) -> changed; mutates the object in place.
Claim = Callable[[str, dict[str, Any]], bool]


class BadReview(ValueError):
    """The body is not an AdmissionReview we can answer (HTTP 400)."""


# --- the JSON patch -------------------------------------------------------------------


def _pointer(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def same(a: Any, b: Any) -> bool:
    """JSON equality: unlike ``==``, true is not 1 and 1 is not 1.0."""
    if type(a) is not type(b):
        return False
    if type(a) is dict:
        return a.keys() == b.keys() and all(same(v, b[k]) for k, v in a.items())
    if type(a) is list:
        return len(a) == len(b) and all(map(same, a, b))
    return bool(a == b)


def json_patch(old: Any, new: Any, path: str = "") -> list[dict[str, Any]]:
    """RFC 6902 operations that turn the JSON value ``old`` into ``new``: objects key by
    key (remove, add, or recurse), anything else (arrays too) replaced whole where it
    differs. The API server applies them to exactly the object it sent."""
    if type(old) is dict and type(new) is dict:
        ops: list[dict[str, Any]] = [{"op": "remove", "path": f"{path}/{_pointer(k)}"} for k in old if k not in new]
        for k, v in new.items():
            at = f"{path}/{_pointer(k)}"
            if k in old:
                ops.extend(json_patch(old[k], v, at))
            else:
                ops.append({"op": "add", "path": at, "value": v})
        return ops
    return [] if same(old, new) else [{"op": "replace", "path": path, "value": new}]


# --- one review ------------------------------------------------------------------------


def parse(body: bytes) -> tuple[dict[str, Any], dict[str, Any]]:
    """The review, and a second copy of its ``request.object`` to mutate (parsing the
    body twice is several times cheaper than a deep copy)."""
    try:
        review = json.loads(body)
        request = review["request"]
        obj = request["object"]
        uid = request["uid"]
        resource = request["resource"]
    except (ValueError, KeyError, TypeError) as e:
        raise BadReview(f"not an AdmissionReview with a request and its object: {e}") from None
    if not isinstance(obj, dict) or not isinstance(uid, str) or not isinstance(resource, dict):
        raise BadReview("not an AdmissionReview: request.object, uid or resource has the wrong type")
    if request.get("userInfo") is None:
        raise BadReview("user info is missing from the admission request")
    work: dict[str, Any] = json.loads(body)["request"]["object"]
    return review, work


def answer(
    review: dict[str, Any],
    *,
    ops: list[dict[str, Any]] | None = None,
    warnings: list[str] | None = None,
    refused: tuple[str, int] | None = None,
) -> dict[str, Any]:
    """The AdmissionReview response: allowed with ``ops`` (if any), or refused with (message, code)."""
    response: dict[str, Any] = {"uid": review["request"]["uid"], "allowed": refused is None}
    if warnings:
        response["warnings"] = [str(w) for w in warnings]
    if ops:
        response["patch"] = base64.b64encode(json.dumps(ops, separators=(",", ":")).encode()).decode("ascii")
        response["patchType"] = "JSONPatch"
    if refused is not None:
        response["status"] = {"message": refused[0], "code": refused[1]}
    return {
        "apiVersion": review.get("apiVersion") or "admission.k8s.io/v1",
        "kind": review.get("kind") or "AdmissionReview",
        "response": response,
    }


async def review(mode: VolumeMode, body: bytes, decide: Decide, observe: Observe | None = None) -> dict[str, Any]:
    """Answer one AdmissionReview body (raises BadReview for a body that is not one)."""
    started = time.perf_counter()
    doc, work = parse(body)
    request = doc["request"]
    res = request["resource"]
    kind = RESOURCES.get((res.get("group", ""), res.get("version"), res.get("resource")))
    if kind is None or request.get("operation") != "CREATE" or request.get("subResource"):
        return answer(doc)  # not ours to mutate (the webhook configuration sends none of these)
    original = request["object"]
    namespace = (original.get("metadata") or {}).get("namespace") or request.get("namespace") or ""
    result = "error"
    try:
        changed, warnings = await decide(mode, kind, namespace, work)
        result = "admitted"
        # Unchanged (did not opt in, or injected already): no patch, whatever else was touched.
        return answer(doc, ops=json_patch(original, work) if changed else None, warnings=warnings)
    except kopf.AdmissionError as e:
        result = "refused"
        logger.info(f"refused {kind} {namespace}/{(original.get('metadata') or {}).get('name')}: {e}")
        return answer(doc, refused=(str(e) or repr(e), e.code or 500))
    except Exception as e:  # an answer still: the API server applies failurePolicy to errors only
        logger.exception(f"admission of {kind} in {namespace} failed")
        return answer(doc, refused=(str(e) or repr(e), 500))
    finally:
        if observe is not None:
            observe(mode.value, result, time.perf_counter() - started)


def review_cache(body: bytes, claim: Claim) -> dict[str, Any]:
    """Answer one AdmissionReview of a new DatasetCache. Never a refusal: whatever goes
    wrong, the cache is admitted as sent, and the controller adds the finalizer itself."""
    doc, work = parse(body)
    request = doc["request"]
    res = request["resource"]
    if (res.get("group"), res.get("resource")) != CACHES or request.get("operation") != "CREATE":
        return answer(doc)
    original = request["object"]
    namespace = (original.get("metadata") or {}).get("namespace") or request.get("namespace") or ""
    try:
        changed = claim(namespace, work)
    except Exception:
        logger.exception(f"admission of a DatasetCache in {namespace} failed; admitted as sent")
        return answer(doc)
    return answer(doc, ops=json_patch(original, work) if changed else None)


# --- the server ------------------------------------------------------------------------


class Server:
    """HTTPS on ``addr``:``port`` for the endpoints (with ``claim``, the caches' too);
    ``start()``, then ``stop()``."""

    def __init__(
        self,
        decide: Decide,
        *,
        addr: str,
        port: int,
        certfile: str,
        keyfile: str,
        observe: Observe | None = None,
        claim: Claim | None = None,
        cert_check_interval: float = 60.0,
    ) -> None:
        self.decide = decide
        self.observe = observe
        self.claim = claim
        self.addr = addr
        self.port = port
        self.certfile = certfile
        self.keyfile = keyfile
        self.cert_check_interval = cert_check_interval
        self.context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.context.load_cert_chain(certfile, keyfile)
        self._stamp = self._files_stamp()
        self._runner: web.AppRunner | None = None
        self._watch: asyncio.Task[None] | None = None

    async def _serve(self, request: web.Request) -> web.Response:
        mode = ENDPOINTS[request.path]
        try:
            out = await review(mode, await request.read(), self.decide, self.observe)
        except BadReview as e:
            raise web.HTTPBadRequest(reason=str(e)) from None
        return web.Response(body=json.dumps(out, separators=(",", ":")).encode(), content_type="application/json")

    async def _serve_cache(self, request: web.Request) -> web.Response:
        assert self.claim is not None
        try:
            out = review_cache(await request.read(), self.claim)
        except BadReview as e:
            raise web.HTTPBadRequest(reason=str(e)) from None
        return web.Response(body=json.dumps(out, separators=(",", ":")).encode(), content_type="application/json")

    async def start(self) -> None:
        app = web.Application()
        app.add_routes([web.post(path, self._serve) for path in ENDPOINTS])
        if self.claim is not None:
            app.add_routes([web.post(CACHES_ENDPOINT, self._serve_cache)])
        # No access log: one line per review is most of a review's cost at this rate.
        self._runner = web.AppRunner(app, handle_signals=False, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.addr or None, self.port, ssl_context=self.context, reuse_address=True)
        await site.start()
        self._watch = asyncio.create_task(self._watch_cert())
        paths = sorted([*ENDPOINTS, *([CACHES_ENDPOINT] if self.claim is not None else [])])
        logger.info(f"serving AdmissionReviews at https://{self.addr}:{self.port}{paths}")

    async def stop(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
        if self._runner is not None:
            await self._runner.cleanup()

    def _files_stamp(self) -> tuple[tuple[float, int], ...]:
        out = []
        for path in (self.certfile, self.keyfile):
            try:
                st = os.stat(path)
                out.append((st.st_mtime, st.st_size))
            except OSError:
                out.append((0.0, -1))
        return tuple(out)

    def reload_if_changed(self) -> bool:
        """Load the certificate and key again if their files changed; True if loaded.
        A pair that does not load (half-written, mismatched) keeps the old one until the
        next check."""
        stamp = self._files_stamp()
        if stamp == self._stamp:
            return False
        try:
            self.context.load_cert_chain(self.certfile, self.keyfile)
        except (OSError, ssl.SSLError) as e:
            logger.warning(f"the webhook's certificate changed but does not load yet ({e}); keeping the old one")
            return False
        self._stamp = stamp
        logger.info(f"reloaded the webhook's serving certificate from {self.certfile}")
        return True

    async def _watch_cert(self) -> None:
        while True:
            await asyncio.sleep(self.cert_check_interval)
            self.reload_if_changed()
