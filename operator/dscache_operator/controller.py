"""The controller: kopf handlers and the level-based reconciliation of one DatasetCache.

Everything is level-based: one timer per DatasetCache recomputes the wanted
status from read-only views of users' pods and Jobs (views.py) and from the
API server, and acts on the difference. A restarted operator therefore
converges: no node decision is made before the views have listed everything,
wipes are idempotent requests to the node's agent, and a node's copy is wiped
only when no consumer is alive there. The source check lives in sourcecheck.py,
the wipe request in wipe.py, the planning in consumers.py, pre-staging in
prestage.py.
"""

from __future__ import annotations

import datetime
import time
from typing import Any

import kopf

import dscache_contract as contract
from dscache_contract import RevisionRef

from . import common, prestage, sourcecheck, wipe
from . import status as st
from .common import Context, ctx_of
from .consumers import MAX_STRAY_LEASES, NodePlan, PodInfo, Release, fmt_time, parse_time, plan_nodes
from .kube import ApiError
from .models import (
    GROUP,
    PLURAL,
    REFRESH_ANNOTATION,
    VERSION,
    DatasetCacheSpec,
    NodeState,
    NodeStatus,
    Phase,
    PodPhase,
    PrestageStatus,
    VolumeMode,
)
from .nodes import NodeInfo
from .views import Views

CACHES = (GROUP, VERSION, PLURAL)
#: A pre-stage pod that succeeded while its node is still not warm is replaced after this long.
PRESTAGE_RETRY_S = 300.0
#: A failed pre-stage pod is replaced after this long (its message is in status meanwhile).
PRESTAGE_FAILED_RETRY_S = 60.0
#: The liveness probe fails once the API server has refused our credentials this long.
AUTH_FAILURE_LIMIT = 300.0


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _events_for_transitions(body: kopf.Body, prior: dict[str, NodeStatus], entries: list[NodeStatus]) -> None:
    for e in entries:
        old = prior.get(e.node)
        if old is not None and old.state == e.state:
            continue
        if e.state == NodeState.READY:
            kopf.event(
                body,
                type="Normal",
                reason="NodeReady",
                message=f"node {e.node}: {e.objects} objects, {e.bytes} bytes staged in {e.seconds} s",
            )
        elif e.state == NodeState.FAILED:
            kopf.event(body, type="Warning", reason="NodeFailed", message=f"node {e.node}: {e.message}")


async def reconcile(
    ctx: Context,
    *,
    body: kopf.Body,
    meta: Any,
    spec: Any,
    status: Any,
    namespace: str,
    name: str,
    patch: kopf.Patch,
    memo: Any,
    logger: Any,
    deleting: bool = False,
    **_: Any,
) -> tuple[int, int] | None:
    """Recompute and patch status; return (live consumers, copies not yet wiped),
    or None while the pod/Job views are still filling (no node decision then).

    1. the source, when due (sourcecheck.py); 2. pre-staging (prestage.py);
    3. the node plan (consumers.py), its wipes carried out by the nodes' agents
    (wipe.py); 4. the Ready condition and the warm counts (status.py)."""
    cache = DatasetCacheSpec.model_validate(dict(spec))
    current: dict[str, Any] = dict(status)
    now = _now()
    wanted = await _check_source(ctx, body, meta, cache, namespace, current, memo, deleting, now)
    if deleting:
        wanted["phase"] = Phase.DELETING
    elif ctx.settings.peers:
        key = wipe.read_token(ctx.settings)
        await ctx.tokens.ensure(ctx.api(), key, namespace, name, meta.get("uid") or "", now.timestamp())

    # Node decisions only once the views of pods and Jobs are complete (a cold view
    # would look like "no consumers" and wipe in-use copies).
    views: Views | None = ctx.views
    if views is None or not views.ready():
        for key, value in st.changed(current, wanted).items():
            patch.status[key] = value
        return None
    prior = [NodeStatus.model_validate(n) for n in current.get("nodes") or []]
    pods = views.pods.get((namespace, name))
    owners = views.owner_lookup(namespace)
    nodes = {n.name: n for n in views.all_nodes()}
    ctx.metrics.observe_stagers(namespace, name, pods)
    revision = st.revision_ref(wanted.get("revision", current.get("revision")))
    rev_bytes = (wanted.get("revision") or current.get("revision") or {}).get("bytes")

    chosen: list[NodeInfo] = []
    if cache.prestage is not None and revision is not None and not deleting:
        chosen = prestage.choose(cache.prestage, nodes.values(), namespace, name, revision.id)
        wanted["prestage"] = await _prestage(
            ctx, meta, cache, namespace, name, revision, rev_bytes, chosen, pods, now, logger
        )
    else:
        if current.get("prestage") is not None:
            wanted["prestage"] = None
        ctx.metrics.set_prestaged(namespace, name, {})
        await _drop_prestage_pods(ctx, namespace, pods, keep=set())
    keep = {n.name: frozenset({revision.id}) for n in chosen} if revision is not None else {}

    plans = plan_nodes(prior, pods, owners, cache.retention, now, deleting=deleting, keep=keep)
    entries, live, pending = await _carry_out(ctx, body, namespace, name, plans, nodes, now, logger)
    _events_for_transitions(body, {p.node: p for p in prior}, entries)
    wanted.update(st.nodes_fragment(entries))
    wanted["owners"] = st.owner_pins(pods, owners, current.get("owners") or [])
    wanted["warm"] = st.warm_fragment(namespace, name, revision, entries, nodes.values())

    conditions = wanted.get("conditions") or current.get("conditions") or []
    source = st.get_condition({"conditions": conditions}, st.SOURCE_READY)
    ready = st.ready_condition(source, revision, wanted.get("prestage", current.get("prestage")), deleting)
    wanted["conditions"] = st.set_condition(conditions, **ready, generation=meta.get("generation"), now=now)
    wanted["reason"] = ready["reason"]

    for key, value in st.changed(current, wanted).items():
        patch.status[key] = value
    ctx.metrics.set_cache(
        namespace, name, wanted.get("phase") or current.get("phase") or Phase.PENDING, [e.state for e in entries]
    )
    return live, pending


async def _check_source(
    ctx: Context,
    body: kopf.Body,
    meta: Any,
    cache: DatasetCacheSpec,
    namespace: str,
    current: dict[str, Any],
    memo: Any,
    deleting: bool,
    now: datetime.datetime,
) -> dict[str, Any]:
    """The status fields a source check changes, when one is due (on create, a spec or
    refresh change, the refresh interval, and retried while it is failing)."""
    wanted: dict[str, Any] = {}
    why = (
        None
        if deleting
        else sourcecheck.source_due(
            meta, current, memo, ctx.settings.source_retry_interval, cache.refresh.interval, now
        )
    )
    if why is None:
        if not current.get("phase"):
            wanted["phase"] = Phase.PENDING
        return wanted
    result = await sourcecheck.check_source(ctx.api(), namespace, cache, ctx.settings.namespace)
    memo.last_check = time.monotonic()
    ctx.metrics.source_checked(result.reason)
    generation = meta.get("generation")
    conditions = st.set_condition(
        current.get("conditions") or [],
        type=st.SOURCE_READY,
        status={True: "True", False: "False", None: "Unknown"}[result.ok],
        reason=result.reason,
        message=result.message,
        generation=generation,
        now=now,
    )
    old = st.get_condition(current, st.SOURCE_READY)
    if not old or old.get("reason") != result.reason or old.get("observedGeneration") != generation:
        kopf.event(
            body,
            type="Warning" if result.ok is False else "Normal",
            reason="SourceChecked" if result.ok else result.reason,
            message=result.message,
        )
    wanted.update(
        conditions=conditions,
        observedGeneration=generation,
        phase=Phase.FAILED if result.ok is False else Phase.READY,
        **st.source_fragment(result.objects, result.bytes),
    )
    token = (meta.get("annotations") or {}).get(REFRESH_ANNOTATION)
    if token is not None:
        wanted["observedRefresh"] = token
    if result.ok and result.revision is not None:
        old_rev = (current.get("revision") or {}).get("id")
        wanted["revision"] = st.revision_fragment(result.revision, result.objects, result.bytes, now)
        if old_rev != result.revision.id:
            kopf.event(
                body,
                type="Normal",
                reason="RevisionPinned",
                message=f"revision {result.revision.id} ({result.objects} objects, {result.bytes} "
                f"bytes) pinned ({why}); was {old_rev or 'none'}",
            )
    elif result.ok is None and current.get("revision"):
        wanted["revision"] = None  # nothing verifiable to pin any more
    return wanted


async def _carry_out(
    ctx: Context,
    body: kopf.Body,
    namespace: str,
    name: str,
    plans: dict[str, NodePlan],
    nodes: dict[str, NodeInfo],
    now: datetime.datetime,
    logger: Any,
) -> tuple[list[NodeStatus], int, int]:
    """Send each planned wipe to its node's agent and record the outcomes in the node entries.
    Returns the entries to show, the live consumers, and the copies not wiped yet."""
    gone = await _gone_nodes(ctx.api(), [node for node, plan in plans.items() if plan.wipe])
    entries: list[NodeStatus] = []
    live = pending = 0
    for node, plan in plans.items():
        entry = plan.entry
        if node in gone:
            # Its disk went with it: drop it from status, and never ask for a wipe there.
            kopf.event(
                body,
                type="Normal",
                reason="NodeGone",
                message=f"node {node} no longer exists; dropped from status (no wipe needed)",
            )
            continue
        live += entry.consumers
        for step in plan.wipes:
            outcome, leases = await wipe.drive(
                ctx.settings, ctx.metrics, body, namespace, name, entry, step, nodes.get(node), logger
            )
            record_outcome(entry, step, outcome, leases, now)
            pending += outcome is not wipe.Outcome.REMOVED
        if plan.wipe and not entry.consumers and all(r.wipedAt for r in entry.revisions):
            if entry.state != NodeState.WIPED:
                entry.state, entry.wipedAt = NodeState.WIPED, fmt_time(now)
        elif not plan.wipe and entry.state != NodeState.WIPED and entry.volume == VolumeMode.HOST_PATH:
            pending += 1
        entries.append(entry)
    return entries, live, pending


def record_outcome(
    entry: NodeStatus, step: Release, outcome: wipe.Outcome, leases: list[str], now: datetime.datetime
) -> None:
    """What one wipe's outcome changes in its node's revisions."""
    for r in entry.revisions:
        if step.revision not in (None, r.id):
            continue
        if outcome is wipe.Outcome.REMOVED:
            r.wipedAt, r.strayLeases, r.consumers, r.keptAt = fmt_time(now), [], 0, None
        elif outcome is wipe.Outcome.KEPT:
            # Leases of pods we did not release: looked at again next time (see
            # consumers.plan_node for why an unknown one is then released, and
            # why a revision kept by nothing releasable waits before the next try).
            r.strayLeases, r.keptAt = sorted(set(leases))[:MAX_STRAY_LEASES], fmt_time(now)


async def _prestage(
    ctx: Context,
    meta: Any,
    cache: DatasetCacheSpec,
    namespace: str,
    name: str,
    revision: RevisionRef,
    nbytes: int | None,
    chosen: list[NodeInfo],
    pods: list[PodInfo],
    now: datetime.datetime,
    logger: Any,
) -> dict[str, Any]:
    """Make every chosen node hold ``revision``: one pre-stage pod per node that does not yet.

    A succeeded pod whose node is still not warm (its copy was evicted, or the agent has
    not labelled it yet) is replaced after PRESTAGE_RETRY_S; a failed one after
    PRESTAGE_FAILED_RETRY_S, its message shown meanwhile."""
    kube = ctx.api()
    key = contract.warm_label(namespace, name, revision.id)
    mine = {p.name: p for p in pods if p.name.startswith(prestage.POD_PREFIX)}
    wanted_names = set()
    ready, problems = 0, []
    for node in chosen:
        pod_name = prestage.pod_name(namespace, name, node.name, revision.id)
        wanted_names.add(pod_name)
        if key in node.warm:
            ready += 1
            continue
        pod = mine.get(pod_name)
        if pod is None:
            body = prestage.build_pod(
                namespace, name, meta.get("uid", ""), node.name, cache, ctx.settings, revision, nbytes
            )
            try:
                if await kube.create_pod(namespace, body) is not None:
                    logger.info(f"pre-staging {revision.id} onto node {node.name} (pod {pod_name})")
            except ApiError as e:
                problems.append(f"{node.name}: cannot create the pre-stage pod: {e}")
            continue
        finished = parse_time(pod.init_finished)
        age = (now - finished).total_seconds() if finished else 0.0
        if pod.phase == PodPhase.FAILED or pod.init == "failed":
            problems.append(f"{node.name}: {pod.message or 'the pre-stage pod failed'}")
            if age > PRESTAGE_FAILED_RETRY_S:
                await kube.delete_pod(namespace, pod_name)
        elif pod.phase == PodPhase.SUCCEEDED and age > PRESTAGE_RETRY_S:
            await kube.delete_pod(namespace, pod_name)  # staged, yet not warm: stage again
    await _drop_prestage_pods(ctx, namespace, pods, keep=wanted_names)
    ctx.metrics.set_prestaged(namespace, name, {n.name: nbytes or 0 for n in chosen if key in n.warm})
    message = None
    if not chosen:
        message = "no ready node with a dscache-node agent matches spec.prestage (nodeSelector, tolerations)"
    elif problems:
        message = "; ".join(problems)[:4000]
    return PrestageStatus(
        wanted=len(chosen), ready=ready, nodes=sorted(n.name for n in chosen)[:256], message=message
    ).model_dump(exclude_none=True)


async def _drop_prestage_pods(ctx: Context, namespace: str, pods: list[PodInfo], keep: set[str]) -> None:
    """Delete finished pre-stage pods that are no longer wanted (an older revision, a node
    no longer chosen, prestage removed); running ones finish first."""
    for p in pods:
        if p.name.startswith(prestage.POD_PREFIX) and p.name not in keep and p.finished:
            await ctx.api().delete_pod(namespace, p.name)


async def _gone_nodes(kube: Any, nodes: list[str]) -> set[str]:
    """Nodes (among those about to get a wipe) that the API server no longer has."""
    gone = set()
    for node in nodes:
        try:
            if await kube.get(f"/api/v1/nodes/{node}") is None:
                gone.add(node)
        except ApiError as e:
            if e.status != 403:  # without RBAC on nodes, assume it exists (the wipe says why it waits)
                raise
    return gone


def make_registry(settings: Any) -> kopf.OperatorRegistry:
    """The controller's handlers. Built at start-up (not import time), because the
    timer's interval is a setting; the handlers find the Context in ``memo.ctx``."""
    registry = kopf.OperatorRegistry()

    @kopf.on.startup(registry=registry)
    async def configure(settings: kopf.OperatorSettings, memo: Any, **_: Any) -> None:
        ctx = ctx_of(memo)
        common.configure_kopf(settings)
        ctx.views = Views(ctx.ensure_kube(), ctx.settings.watch_namespaces)
        ctx.views.start()
        await common.start_metrics(ctx)

    @kopf.on.login(registry=registry)
    async def login(memo: Any, **kwargs: Any) -> kopf.AiohttpSession:
        return await common.login(ctx_of(memo), **kwargs)

    @kopf.on.probe(id="views", registry=registry)
    async def views_probe(memo: Any, **_: Any) -> bool:
        # A controller whose credentials the API server refuses for minutes is
        # blind: fail liveness so that it restarts (and reads its token afresh).
        views = ctx_of(memo).views
        failing = views.auth_failing_for() if views is not None else 0.0
        if failing > AUTH_FAILURE_LIMIT:
            raise RuntimeError(f"the API server has refused our credentials for {failing:.0f} s")
        return bool(views is not None and views.ready())

    @kopf.on.cleanup(registry=registry)
    async def cleanup(memo: Any, **_: Any) -> None:
        ctx = ctx_of(memo)
        if ctx.views is not None:
            await ctx.views.stop()
        await common.shutdown(ctx)

    @kopf.timer(*CACHES, interval=settings.reconcile_interval, registry=registry)
    async def reconcile_timer(memo: Any, **kwargs: Any) -> None:
        ctx = ctx_of(memo)
        async with ctx.reconcile_slots():
            await reconcile(ctx, memo=memo, **kwargs)

    @kopf.on.delete(*CACHES, registry=registry)
    async def finalize(body: kopf.Body, name: str, namespace: str | None, retry: int, memo: Any, **kwargs: Any) -> None:
        """Behind our finalizer: wait until no pod uses the cache, then wipe every node."""
        assert namespace is not None  # DatasetCache is namespaced
        ctx = ctx_of(memo)
        result = await reconcile(ctx, body=body, name=name, namespace=namespace, memo=memo, deleting=True, **kwargs)
        if result is None:
            raise kopf.TemporaryError("waiting for the pod and Job views to fill", delay=1)
        live, pending = result
        # Back off while waiting: each retry is logged (and posted as an Event).
        delay = min(60.0, max(1.0, ctx.settings.reconcile_interval / 2) * (1 + retry))
        if live:
            if retry == 0:
                kopf.event(
                    body,
                    type="Normal",
                    reason="DeletionWaiting",
                    message=f"{live} pod(s) still use this cache; its copies are wiped once they end",
                )
            raise kopf.TemporaryError(f"{live} consumer pod(s) still alive", delay=delay)
        if pending:
            raise kopf.TemporaryError(f"{pending} node copies still being wiped", delay=delay)
        ctx.metrics.forget_cache(namespace, name)
        ctx.tokens.forget(namespace, name)

    return registry
