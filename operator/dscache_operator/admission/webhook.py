"""The mutating admission webhook: what it decides (served over TLS by server.py).

Two endpoints, one per volume mode; the MutatingWebhookConfiguration chooses
by namespace labels (see operator/deploy/webhook.yaml):
- ``/dscache-hostpath``: a node-level copy under cacheRoot (the default);
- ``/dscache-emptydir``: a per-pod emptyDir, for namespaces labelled
  ``dscache.io/volume=emptyDir`` or enforcing Pod Security baseline/restricted.
And ``/dscache-caches``: every new DatasetCache gets the controller's finalizer
(``claim_cache``).

Cache view: every DatasetCache's CacheView, kept by our own list+watch
(informer.py), not a kopf index: kopf handled each watch event of a cache
with its per-object machinery (a worker, a cause, a body, a logger), about
1.5 ms of CPU each; at 10,000 caches converging (each written two or three
times) that was a quarter of a core beside the API server, on the same cores.
Cold view: it fills after the server starts listening.
A miss in the index (cold, or a cache created a moment ago) falls through to
one GET from the API server, so a valid cache is never refused and an unknown
one is always refused. A cache the index still sees as unchecked (Pending)
is also read fresh, so a source check that just failed is not missed. If the
API server cannot be asked, the request is
refused with a retryable message (fail closed: a Job that asks for a cache
never starts without it).

Node index: each Node's warm label keys and byte budget (placement.py), for
warm-node placement of Pods and the capacity warning. Cold, it knows no warm
node: Preferred then adds nothing (the pod copies, as before warm nodes
existed), Required still adds its term (and warns that no node is known to
hold the revision), and no capacity warning is given.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import re
import time
from typing import Any, NamedTuple

import kopf
import pydantic

from dscache_contract import ANNOTATION_AS_OF, ANNOTATION_CACHE, ANNOTATION_REVISION, RevisionRef, warm_label

from .. import context
from ..api.models import (
    FINALIZER,
    GROUP,
    PLURAL,
    VERSION,
    DatasetCacheSpec,
    Phase,
    PlacementMode,
    VolumeMode,
)
from ..cluster.caches import owner_pin_ref, revision_ref
from ..context import Context, ctx_of
from ..kube.client import ApiError
from ..kube.informer import MultiInformer
from . import placement, server, webidentity
from .injection import InjectionError, direct_owner_uid, inject_object, requested_cache

#: kopf's index id: the kwarg name the startup handler receives it under.
NODES_INDEX = "dscache_nodes"
_DNS1123 = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")


class CacheView(NamedTuple):
    spec: DatasetCacheSpec | None
    phase: str | None
    reason: str | None
    message: str | None
    deleting: bool
    invalid: str | None = None
    #: status.revision: what a workload that carries none yet is given
    revision: RevisionRef | None = None
    #: owner UID -> the revision its pods already stage (status.owners; None: unreadable)
    pins: dict[str, RevisionRef | None] | None = None
    #: status.revision.bytes: the size of ``revision`` (None: unknown), for the capacity warning
    revision_bytes: int | None = None


def cache_view(body: Any) -> CacheView:
    status = body.get("status") or {}
    cond: dict[str, Any] = next((c for c in status.get("conditions") or [] if c.get("type") == "SourceReady"), {})
    deleting = bool((body.get("metadata") or {}).get("deletionTimestamp"))
    try:
        spec = DatasetCacheSpec.model_validate(dict(body.get("spec") or {}))
        invalid = None
    except pydantic.ValidationError as e:
        spec, invalid = None, str(e).splitlines()[0]
    pins = {o["uid"]: owner_pin_ref(o) for o in status.get("owners") or [] if o.get("uid")}
    size = (status.get("revision") or {}).get("bytes")
    return CacheView(
        spec,
        status.get("phase"),
        cond.get("reason"),
        cond.get("message"),
        deleting,
        invalid,
        revision_ref(status.get("revision")),
        pins,
        size if isinstance(size, int) and not isinstance(size, bool) else None,
    )


def cache_extract(body: dict[str, Any]) -> tuple[tuple[str, str], CacheView]:
    """The cache view's key and value of one DatasetCache (informer.py)."""
    meta = body.get("metadata") or {}
    return (meta.get("namespace", ""), meta.get("name", "")), cache_view(body)


def index_nodes(name: str, labels: Any, annotations: Any, **_: Any) -> dict[Any, Any]:
    """A Node's warm label keys (-> its name) and its byte budget; nothing else of it is kept."""
    return placement.node_entries(name, labels or {}, annotations or {})


#: How long admission waits for a just-created cache's first revision (the
#: source check usually takes well under a second; our webhooks time out at 5 s).
FIRST_REVISION_WAIT = 3.0


def _settled(view: CacheView) -> bool:
    """Enough to decide: broken or being deleted, or checked with a revision pinned."""
    checked = view.phase not in (None, Phase.PENDING)
    # A cache the operator cannot list (no identity) is Failed (NoIdentity), so it settles above.
    return view.phase == Phase.FAILED or view.deleting or (checked and view.revision is not None)


async def lookup(
    ctx: Context, namespace: str, name: str, index: Any, wait: float = FIRST_REVISION_WAIT
) -> CacheView | None:
    store = index.get((namespace, name)) if index is not None else None
    if store:
        indexed: CacheView = next(iter(store))
        if _settled(indexed):
            # The index learns of a deletion a moment after the API server. A pod
            # admitted in between is an unfinished consumer like any other: the
            # wipe waits for it (nodeplan.py), so the window is late, never unsafe.
            return indexed
        # Not checked yet (as far as the index knows): ask the API server, whose
        # answer may already say Ready or Failed.
    deadline = time.monotonic() + wait
    while True:
        try:
            body = await ctx.api().get_cache(namespace, name)
        except (ApiError, OSError, kopf.TemporaryError) as e:
            raise kopf.AdmissionError(
                f"DatasetCache {namespace}/{name}: dscache could not look it up ({e}); retry shortly.", code=503
            ) from e
        view = cache_view(body) if body is not None else None
        if view is None or _settled(view) or time.monotonic() >= deadline:
            return view
        # A cache created together with its Job (one kubectl apply): its first
        # revision is usually pinned within a second; wait for it briefly.
        await asyncio.sleep(0.25)


def refusal(namespace: str, name: str, view: CacheView | None) -> str | None:
    ref = f"DatasetCache {namespace}/{name}"
    if view is None:
        return (
            f"{ref} does not exist. Create it (kubectl apply -f <datasetcache.yaml> -n {namespace}) "
            f"or fix the annotation {ANNOTATION_CACHE}."
        )
    if view.deleting:
        return f"{ref} is being deleted; recreate it or point {ANNOTATION_CACHE} at another cache."
    if view.invalid or view.spec is None:
        return f"{ref} has an invalid spec ({view.invalid}); fix the DatasetCache."
    if view.phase == Phase.FAILED:
        return (
            f"{ref} is broken: {view.reason}: {view.message} (see kubectl describe datasetcache {name} -n {namespace})."
        )
    return None


def choose_revision(view: CacheView, obj: dict[str, Any]) -> RevisionRef | None:
    """The revision a new Job or Pod gets when it carries none: the one its owner's
    pods already stage (status.owners), else the cache's pinned revision.

    Remaining window: a workload whose first pods are admitted before the
    controller has recorded its pin (one reconcile interval) while a refresh
    changes status.revision in between can get two revisions; Jobs are immune
    (the revision is set on the Job's pod template at Job admission).

    An owner pin that cannot be read (status edited by hand) refuses the pod:
    falling back to status.revision could give the owner's pods two revisions."""
    owner = direct_owner_uid(obj)
    if owner and view.pins and owner in view.pins:
        pinned = view.pins[owner]
        if pinned is None:
            raise InjectionError(
                f"the revision status.owners pins for its owner (uid {owner}) is unreadable; the operator "
                f"rewrites it from the owner's pods at its next reconcile: retry shortly."
            )
        return pinned
    return view.revision


def versioning_mismatch(namespace: str, name: str, view: CacheView, carried: RevisionRef) -> str | None:
    """A carried revision the cache knows (status.revision or an owner's pin) must
    agree with it on being versioned. A versioned id digests versionIds, an
    unversioned one does not, so the same id is never both: a pair that disagrees
    can only fail in the stager, and one missing its as-of time is fixable here."""
    for known in (view.revision, *(view.pins or {}).values()):
        if known is None or known.id != carried.id or known.versioned == carried.versioned:
            continue
        ref = f"DatasetCache {namespace}/{name}: annotation {ANNOTATION_REVISION}={carried.id}"
        if known.as_of is not None:
            return (
                f"{ref} is a revision of a versioned bucket, but {ANNOTATION_AS_OF} is missing: without it "
                f"the stager cannot find its versions. Add {ANNOTATION_AS_OF}={known.as_of}, or remove "
                f"{ANNOTATION_REVISION} to get the cache's current revision."
            )
        return (
            f"{ref} is a revision of an unversioned listing, but {ANNOTATION_AS_OF}={carried.as_of} is set: "
            f"remove {ANNOTATION_AS_OF}."
        )
    return None


def warm_placement(
    obj: dict[str, Any],
    *,
    kind: str,
    namespace: str,
    cache_name: str,
    view: CacheView,
    revision: RevisionRef,
    weight: int,
    nodes: Any,
) -> tuple[bool, list[str]]:
    """Node affinity toward the nodes that hold ``revision`` (Pods only) and this
    admission's warnings (Jobs and Pods). Mutates ``obj``; returns (changed, warnings).

    Pods only: a Job's template is injected when the Job is created, but which
    nodes are warm matters when each of its pods is, and they pass through here
    too (with the template's annotations). A Job's own placement annotation is
    copied onto its template (as the cache annotation is), or its pods would
    never see it. Raises PlacementError on an invalid placement annotation."""
    assert view.spec is not None
    carried = False
    if kind == "Job":
        # inject_object has set up the template's spec and metadata.
        template = obj["spec"]["template"]
        pod_spec, meta = template["spec"], template["metadata"]
        carried = placement.carry_to_template((obj.get("metadata") or {}).get("annotations") or {}, meta)
    else:
        pod_spec, meta = obj.setdefault("spec", {}), obj.get("metadata") or {}
    by_cache = view.spec.placement.mode == PlacementMode.REQUIRED
    mode = placement.effective_mode(view.spec.placement.mode, meta.get("annotations") or {})
    if not placement.uses_node_copy(pod_spec):
        return carried, []  # an emptyDir copy is the pod's own: no node holds it for anyone
    ref = f"DatasetCache {namespace}/{cache_name}"
    notes: list[str] = []
    # The size is known for the cache's current revision only; a carried older one is not judged.
    if view.revision is not None and view.revision.id == revision.id:
        too_big = placement.capacity_warning(ref, revision.id, view.revision_bytes, placement.largest_budget(nodes))
        if too_big:
            notes.append(too_big)
    if kind == "Pod" and pod_spec.get("nodeName"):
        return carried, notes  # bound already: the scheduler never sees it, so affinity could only make it fail
    key = warm_label(namespace, cache_name, revision.id)
    warm = placement.warm_nodes(nodes, key)
    if mode == PlacementMode.REQUIRED and not warm:
        notes.append(placement.cold_required_warning(ref, revision.id, by_cache))
    changed = kind == "Pod" and placement.place(pod_spec, key, mode, warm, weight)
    return changed or carried, notes


def no_revision(namespace: str, name: str, view: CacheView) -> str:
    why = f"{view.reason}: {view.message}" if view.reason else "the source has not been listed yet"
    return (
        f"DatasetCache {namespace}/{name} has no pinned revision yet ({why}). Every pod stages the "
        f"revision the operator pinned by listing the source, so the operator must be able to list "
        f"it: set spec.source.serviceAccountName (a ServiceAccount of {namespace} whose "
        f"eks.amazonaws.com/role-arn may read the bucket) or spec.source.credentials.secretRef, or "
        f"retry in a few seconds if the cache was just created."
    )


async def mutate(
    ctx: Context,
    raw: dict[str, Any],
    *,
    mode: VolumeMode,
    kind: str,
    namespace: str,
    caches: Any = None,
    nodes: Any = None,
) -> tuple[bool, list[str]]:
    """Inject the cache into an opted-in Job or Pod (``raw``, changed in place), and place
    Pods on warm nodes. Returns (changed, warnings): unchanged, the review carries no patch.

    ``caches``: the cache view (a MultiInformer of CacheView); ``nodes``: kopf's node index.
    The warnings go into AdmissionReview response.warnings: kubectl prints them (the
    object is still admitted). Raises kopf.AdmissionError to refuse the object."""
    cache_name = requested_cache(raw, kind)
    if cache_name is None:
        return False, []  # the object did not opt in
    namespace = namespace or (raw.get("metadata") or {}).get("namespace") or ""
    if not _DNS1123.match(cache_name):
        raise kopf.AdmissionError(
            f"{ANNOTATION_CACHE}: {cache_name!r} is not a DatasetCache name; use the name of one "
            f"DatasetCache in namespace {namespace}.",
            code=400,
        )
    view = await lookup(ctx, namespace, cache_name, caches)
    reason = refusal(namespace, cache_name, view)
    if reason:
        raise kopf.AdmissionError(reason, code=400)
    assert view is not None and view.spec is not None
    target_meta = (
        ((raw.get("spec") or {}).get("template") or {}).get("metadata") if kind == "Job" else raw.get("metadata")
    ) or {}
    try:
        # A revision the object already carries wins (a Job's pods inherit the
        # template's); refused here when malformed, never replaced.
        revision = RevisionRef.from_annotations(target_meta.get("annotations") or {}, cache_name)
    except ValueError as e:
        raise kopf.AdmissionError(str(e), code=400) from e
    if revision is not None:
        reason = versioning_mismatch(namespace, cache_name, view, revision)
        if reason:
            raise kopf.AdmissionError(reason, code=400)
    else:
        try:
            revision = choose_revision(view, raw)
        except InjectionError as e:
            raise kopf.AdmissionError(f"DatasetCache {namespace}/{cache_name}: {e}", code=503) from e
        if revision is None:
            raise kopf.AdmissionError(no_revision(namespace, cache_name, view), code=400)
    web_identity, identity_notes = await webidentity.stager_identity(
        ctx.ensure_kube, ctx.settings, namespace, raw, kind, view.spec
    )
    try:
        changed = inject_object(
            raw,
            kind=kind,
            namespace=namespace,
            cache_name=cache_name,
            spec=view.spec,
            settings=ctx.settings,
            mode=mode,
            revision=revision,
            # Its size, for the stager's request for room on its node: known for the pinned revision.
            nbytes=view.revision_bytes if view.revision is not None and revision.id == view.revision.id else None,
            web_identity=web_identity,
        )
    except InjectionError as e:
        raise kopf.AdmissionError(str(e), code=400) from e
    try:
        placed, notes = warm_placement(
            raw,
            kind=kind,
            namespace=namespace,
            cache_name=cache_name,
            view=view,
            revision=revision,
            weight=ctx.settings.placement_weight,
            nodes=nodes,
        )
    except placement.PlacementError as e:
        raise kopf.AdmissionError(f"DatasetCache {namespace}/{cache_name}: {e}", code=400) from e
    return changed or placed, identity_notes + notes


def claim_cache(watched: tuple[str, ...], namespace: str, obj: dict[str, Any]) -> bool:
    """Put the controller's finalizer on a new DatasetCache (in place; True if added), so that
    the controller need not write it: at 10,000 caches that write cost the API server 4-5 ms
    of CPU each, and every watcher one more event. Not in a namespace the controller
    does not watch: nothing would ever remove it there. The controller still adds it to a
    cache that came without it (created while this webhook was down: failurePolicy Ignore)."""
    if watched and namespace not in watched:
        return False
    meta = obj.setdefault("metadata", {})
    finalizers = list(meta.get("finalizers") or [])
    if FINALIZER in finalizers:
        return False
    meta["finalizers"] = [*finalizers, FINALIZER]
    return True


def make_decider(ctx: Context, caches: Any, nodes: Any) -> server.Decide:
    """What the admission server asks for each review: mutate() over the cache and node views."""

    async def decide(mode: VolumeMode, kind: str, namespace: str, obj: dict[str, Any]) -> tuple[bool, list[str]]:
        return await mutate(ctx, obj, mode=mode, kind=kind, namespace=namespace, caches=caches, nodes=nodes)

    return decide


def make_registry(settings: Any = None) -> kopf.OperatorRegistry:
    """The webhook's handlers, built at start-up; they find the Context in ``memo.ctx``.

    kopf runs the process (log-in, the node index, liveness); the AdmissionReviews are
    answered by our own server (server.py), started here with the cache view (informer.py)."""
    registry = kopf.OperatorRegistry()
    servers: list[server.Server] = []
    views: list[MultiInformer] = []

    # kopf hands every handler, startup ones too, each index under its id (NODES_INDEX:
    # explicit, or kopf would name a nested function by its qualname,
    # make_registry.<locals>...); a missing one fails the start-up, never admission.
    @kopf.on.startup(registry=registry)
    async def configure(settings: kopf.OperatorSettings, memo: Any, **kwargs: Any) -> None:
        ctx = ctx_of(memo)
        context.configure_kopf(settings)
        # This process has no deletion handler; with the controller's finalizer name,
        # kopf would "clean up" that finalizer as its own stale one on what it watches.
        # A name it never finds keeps it read-only.
        settings.persistence.finalizer = f"{GROUP}/webhook-never-set"
        s = ctx.settings
        if not s.webhook_cert or not s.webhook_key:
            raise kopf.PermanentError("DSCACHE_WEBHOOK_CERT and DSCACHE_WEBHOOK_KEY must name the serving certificate")
        caches = MultiInformer(
            ctx.ensure_kube(), f"/apis/{GROUP}/{VERSION}", PLURAL, s.watch_namespaces, "", cache_extract
        )
        caches.start()
        views.append(caches)
        srv = server.Server(
            make_decider(ctx, caches, kwargs[NODES_INDEX]),
            addr=s.webhook_addr,
            port=s.webhook_port,
            certfile=s.webhook_cert,
            keyfile=s.webhook_key,
            observe=ctx.metrics.admission,
            claim=functools.partial(claim_cache, s.watch_namespaces),
        )
        await srv.start()
        servers.append(srv)
        await context.start_metrics(ctx)
        # What start-up loaded (kopf, aiohttp, pydantic, our modules: ~53,000 objects) lives
        # as long as the process; out of the collector's sight, a full collection no longer
        # walks it. Serving 1,000 reviews/s promotes enough short-lived objects for one
        # now and then (one in a 16 s run): it took 54 ms, and every review waiting behind
        # it as long; with the freeze, 1 ms (bench/operator.py, load average 2).
        gc.freeze()

    @kopf.on.login(registry=registry)
    async def login(memo: Any, **kwargs: Any) -> kopf.AiohttpSession:
        return await context.login(ctx_of(memo), **kwargs)

    @kopf.on.cleanup(registry=registry)
    async def cleanup(memo: Any, **_: Any) -> None:
        for srv in servers:
            await srv.stop()
        for view in views:
            await view.stop()
        await context.shutdown(ctx_of(memo))

    # Nodes: which hold which revision (warm labels) and their byte budgets, for
    # placement and the capacity warning. Needs list/watch on nodes (cluster-wide:
    # kopf watches a cluster-scoped resource cluster-wide even in namespaced mode).
    @kopf.index("", "v1", "nodes", id=NODES_INDEX, registry=registry)
    def dscache_nodes(**kwargs: Any) -> dict[Any, Any]:
        return index_nodes(**kwargs)

    return registry
