"""The controller: the level-based reconciliation of one DatasetCache, and its executor.

Everything is level-based: each DatasetCache, in turn (schedule.py), recomputes the wanted
status from read-only views of users' pods and Jobs (views.py) and from the
API server, and acts on the difference. A restarted operator therefore
converges: no node decision is made before the views have listed everything,
wipes are idempotent requests to the node's agent, and a node's copy is wiped
only when no consumer is alive there. The source check lives in sourcecheck.py,
the node plan and the wipes' bookkeeping in nodeplan.py, the request to a node's
agent in agentclient.py, pre-staging in prestage.py; when a steady cache's
reconciliation is skipped (nothing it reads has changed), in quiet.py.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import time
from typing import Any

import kopf

from dscache_contract import LABEL_CONSUMER, clock
from dscache_contract.clock import parse_time

from .. import context
from ..api.models import (
    FINALIZER,
    GROUP,
    PLURAL,
    VERSION,
    DatasetCacheSpec,
    NodeState,
    NodeStatus,
    Phase,
    parse_duration,
)
from ..cluster.caches import CacheView, Key, revision_ref
from ..cluster.nodes import NodeInfo
from ..cluster.views import Views
from ..kube.client import ApiError
from ..kube.events import Event, Poster
from ..kube.leader import LeaderElector, LeaseConfig
from ..kube.schedule import Scheduler
from . import agentclient, prestage, sourcecheck
from . import status as st
from .nodeplan import (
    NodePlan,
    Outcome,
    changes_by_time_at,
    judge_wipe,
    plan_nodes,
    record_wipe,
    release_next,
    request_for,
    settle,
)
from .quiet import Quiet, Seen
from .state import ControlContext, control_ctx

logger = logging.getLogger(__name__)

#: Reconciliations at once: bounded API concurrency and memory.
RECONCILE_WORKERS = 32
#: How soon a cache whose view does not show our last status write yet is looked at again
#: (the write's watch event makes it due sooner: ControlContext.on_cache).
WRITE_RECHECK_S = 1.0
#: At most this long the first reconciliations wait for every view to have listed.
VIEWS_LIST_WAIT = 60.0
#: The liveness probe fails once the API server has refused our credentials this long.
AUTH_FAILURE_LIMIT = 300.0
#: A cache whose reconciliations change nothing is still reconciled in full this often
#: (quiet.py: what it reads is then known not to have changed, but a full pass is cheap at this rate).
QUIET_AT_MOST = 300.0
#: When a wipe found a lease that the next plan releases (nodeplan.release_next), the cache is
#: due again this soon: the copy of a pod deleted before a reconciliation saw it finish goes
#: then, not a whole reconcile interval later.
RELEASE_AGAIN_S = 1.0


class Outbox:
    """What one reconciliation has to say: Events (posted by the executor) and the status patch."""

    def __init__(self, view: CacheView) -> None:
        self.view = view
        self.events: list[Event] = []
        self.status: dict[str, Any] = {}
        #: What it read, if another reconciliation with the same would change nothing until then.
        self.quiet: Quiet | None = None
        #: A wipe's answer that the next reconciliation acts on at once (RELEASE_AGAIN_S).
        self.again = False

    def event(self, type: str, reason: str, message: str) -> None:
        self.events.append(Event(self.view.involved(), type, reason, message))


def _events_for_transitions(out: Outbox, prior: dict[str, NodeStatus], entries: list[NodeStatus]) -> None:
    for e in entries:
        old = prior.get(e.node)
        if old is not None and old.state == e.state:
            continue
        if e.state == NodeState.READY:
            out.event(
                "Normal",
                reason="NodeReady",
                message=f"node {e.node}: {e.objects} objects, {e.bytes} bytes staged in {e.seconds} s",
            )
        elif e.state == NodeState.FAILED:
            out.event("Warning", reason="NodeFailed", message=f"node {e.node}: {e.message}")


async def reconcile(ctx: ControlContext, view: CacheView, out: Outbox) -> tuple[int, int] | None:
    """Recompute status into ``out.status`` (a merge patch); return (live consumers, copies
    not yet wiped), or None while the pod/Job views are still filling (no node decision then).

    1. the source, when due (sourcecheck.py); 2. pre-staging (prestage.py);
    3. the node plan (nodeplan.py), its wipes carried out by the nodes' agents
    (agentclient.py); 4. the Ready condition and the warm counts (status.py)."""
    cache = view.spec
    assert cache is not None
    namespace, name, deleting = view.namespace, view.name, view.deleting
    current = view.status()
    now = clock.now()
    wanted = await _check_source(ctx, view, cache, current, out, now)
    if deleting:
        wanted["phase"] = Phase.DELETING

    # Node decisions only once the views of pods and Jobs are complete (a cold view
    # would look like "no consumers" and wipe in-use copies).
    views: Views | None = ctx.views
    if views is None or not views.ready():
        out.status.update(st.changed(current, wanted))
        return None
    prior = [NodeStatus.model_validate(n) for n in current.get("nodes") or []]
    pods = views.pods.get((namespace, name))
    owners = Seen(views.owner_lookup(namespace))
    nodes_seen = views.nodes_seen()
    nodes = {n.name: n for n in views.all_nodes()}
    ctx.metrics.observe_stagers(namespace, name, pods)
    revision = revision_ref(wanted.get("revision", current.get("revision")))
    rev_bytes = (wanted.get("revision") or current.get("revision") or {}).get("bytes")

    chosen: list[NodeInfo] = []
    if cache.prestage is not None and revision is not None and not deleting:
        chosen = prestage.choose(cache.prestage, nodes.values(), namespace, name, revision.id)
        wanted["prestage"] = await prestage.keep(ctx, view, cache, revision, rev_bytes, chosen, pods, now)
    else:
        if current.get("prestage") is not None:
            wanted["prestage"] = None
        ctx.metrics.set_prestaged(namespace, name, {})
        await prestage.drop_pods(ctx, namespace, pods, keep=set())
    keep = {n.name: frozenset({revision.id}) for n in chosen} if revision is not None else {}

    plans = plan_nodes(prior, pods, owners, cache.retention, now, deleting=deleting, keep=keep)
    known = frozenset(p.uid for p in pods if p.uid)
    entries, live, pending = await _carry_out(ctx, out, plans, nodes, now, known)
    _events_for_transitions(out, {p.node: p for p in prior}, entries)
    wanted.update(st.nodes_fragment(entries))
    wanted["owners"] = st.owner_pins(pods, owners, current.get("owners") or [])
    wanted["warm"] = st.warm_fragment(namespace, name, revision, entries, nodes.values())

    conditions = wanted.get("conditions") or current.get("conditions") or []
    source = st.get_condition({"conditions": conditions}, st.SOURCE_READY)
    ready = st.ready_condition(source, revision, wanted.get("prestage", current.get("prestage")), deleting)
    wanted["conditions"] = st.set_condition(conditions, **ready, generation=view.generation, now=now)
    wanted["reason"] = ready["reason"]

    out.status.update(st.changed(current, wanted))
    ctx.metrics.set_cache(
        namespace, name, wanted.get("phase") or current.get("phase") or Phase.PENDING, [e.state for e in entries]
    )
    # Not with wipes planned: one that failed or found the agent busy is asked again next time.
    if not out.status and not out.events and not deleting and cache.prestage is None and not _any_wipe(plans):
        until = _quiet_until(ctx, view, cache, current, entries, now)
        if until is not None:
            out.quiet = Quiet(view, tuple(pods), tuple(owners.answers.items()), nodes_seen, until)
    return live, pending


def _any_wipe(plans: dict[str, NodePlan]) -> bool:
    return any(plan.wipes for plan in plans.values())


def _quiet_until(
    ctx: ControlContext,
    view: CacheView,
    cache: DatasetCacheSpec,
    current: dict[str, Any],
    entries: list[NodeStatus],
    now: datetime.datetime,
) -> float | None:
    """Until when (a timestamp) time alone changes nothing in this cache's next reconciliation
    (quiet.py); None: it may at any moment (a failed source check is retried)."""
    if current.get("phase") == Phase.FAILED:
        return None
    t = now.timestamp()
    at = [t + QUIET_AT_MOST]
    listed = parse_time((current.get("revision") or {}).get("listedAt"))
    if cache.refresh.interval != "Never" and listed is not None:
        at.append(listed.timestamp() + parse_duration(cache.refresh.interval))
    by_time = changes_by_time_at(entries, cache.retention, now)
    if by_time is not None:
        at.append(by_time.timestamp())
    return min(at)


async def _check_source(
    ctx: ControlContext,
    view: CacheView,
    cache: DatasetCacheSpec,
    current: dict[str, Any],
    out: Outbox,
    now: datetime.datetime,
) -> dict[str, Any]:
    """The status fields a source check changes, when one is due (on create, a spec or
    refresh change, the refresh interval, and retried while it is failing)."""
    wanted: dict[str, Any] = {}
    last = ctx.checked_at.get(view.key, 0.0)
    why = (
        None
        if view.deleting
        else sourcecheck.source_due(
            view.generation,
            view.refresh,
            current,
            last,
            ctx.settings.source_retry_interval,
            cache.refresh.interval,
            now,
        )
    )
    if why is None:
        if not current.get("phase"):
            wanted["phase"] = Phase.PENDING
        return wanted
    # How fresh the listing must be: begun after we saw the change that asks for it (a new
    # cache, a spec edit, the refresh annotation: the user's uploads before it are in it),
    # or, when it is due because time passed (a retry, the refresh interval), begun now.
    not_before = view.observed if why in ("spec", "annotation") else time.monotonic()
    result = await ctx.sources.check(ctx.api(), view.namespace, cache, not_before)
    ctx.checked_at[view.key] = time.monotonic()
    ctx.metrics.source_checked(result.reason)
    generation = view.generation
    conditions = st.set_condition(
        current.get("conditions") or [],
        type=st.SOURCE_READY,
        status="True" if result.ok else "False",
        reason=result.reason,
        message=result.message,
        generation=generation,
        now=now,
    )
    old = st.get_condition(current, st.SOURCE_READY)
    if not old or old.get("reason") != result.reason or old.get("observedGeneration") != generation:
        out.event(
            "Normal" if result.ok else "Warning",
            "SourceChecked" if result.ok else result.reason,
            result.message,
        )
    wanted.update(
        conditions=conditions,
        observedGeneration=generation,
        phase=Phase.READY if result.ok else Phase.FAILED,
        **st.source_fragment(result.objects, result.bytes),
    )
    if view.refresh is not None:
        wanted["observedRefresh"] = view.refresh
    if result.ok and result.revision is not None:
        old_rev = (current.get("revision") or {}).get("id")
        wanted["revision"] = st.revision_fragment(result.revision, result.objects, result.bytes, now)
        # A first pin is told by SourceChecked (its message names the revision): one Event, not two.
        if old_rev is not None and old_rev != result.revision.id:
            out.event(
                "Normal",
                reason="RevisionPinned",
                message=f"revision {result.revision.id} ({result.objects} objects, {result.bytes} "
                f"bytes) pinned ({why}); was {old_rev or 'none'}",
            )
    return wanted


async def _carry_out(
    ctx: ControlContext,
    out: Outbox,
    plans: dict[str, NodePlan],
    nodes: dict[str, NodeInfo],
    now: datetime.datetime,
    known: frozenset[str],
) -> tuple[list[NodeStatus], int, int]:
    """Send each planned wipe to its node's agent, and record what its answer means
    (nodeplan.py decides all of it). Returns the entries to show, the live consumers,
    and the copies not wiped yet. ``known``: the UIDs of the cache's pods in our view."""
    namespace, name = out.view.key
    gone = await _gone_nodes(ctx.api(), [node for node, plan in plans.items() if plan.wipes])
    entries: list[NodeStatus] = []
    live = pending = 0
    for node, plan in plans.items():
        entry = plan.entry
        if node in gone:
            # Its disk went with it: drop it from status, and never ask for a wipe there.
            out.event(
                "Normal",
                reason="NodeGone",
                message=f"node {node} no longer exists; dropped from status (no wipe needed)",
            )
            continue
        live += entry.consumers
        for step in plan.wipes:
            if step.release:
                step = step._replace(release=await _not_running(ctx.api(), namespace, node, step.release))
            answer = await agentclient.wipe(
                nodes.get(node), ctx.settings, request_for(namespace, name, step), ctx.api(), ctx.agent_tokens
            )
            result = judge_wipe(entry, step, answer, ctx.settings.namespace)
            record_wipe(entry, step, result, now)
            out.again |= release_next(step, result, known)
            ctx.metrics.wipe(namespace, name, result.metric)
            if result.event is not None:
                out.event(*result.event)
            pending += result.outcome is not Outcome.REMOVED
        pending += settle(entry, plan, now)
        entries.append(entry)
    return entries, live, pending


async def _not_running(kube: Any, namespace: str, node: str, release: tuple[str, ...]) -> tuple[str, ...]:
    """The pods of ``release`` that a fresh read shows not running on ``node``.

    A lease is released only on a fact that cannot be stale: the views may be relisting (a
    410 Gone, an API server restart) or lag behind a new pod by more than a reconciliation,
    and a pod they do not show may be reading the revision. So before a wipe releases leases,
    one consistent LIST (no resourceVersion: served from etcd, never a cache) of the
    namespace's consumer pods on that node, and every pod in it that has not finished keeps
    its lease. (A CSI volume's lease is the mount's besides: the agent releases it only on
    NodeUnpublishVolume, whatever a wipe asks.)"""
    data = await kube.request(
        "GET",
        f"/api/v1/namespaces/{namespace}/pods",
        params={"labelSelector": f"{LABEL_CONSUMER}=true", "fieldSelector": f"spec.nodeName={node}"},
    )
    running = {
        (p.get("metadata") or {}).get("uid")
        for p in data.get("items") or []
        if (p.get("status") or {}).get("phase") not in ("Succeeded", "Failed")
    }
    return tuple(u for u in release if u not in running)


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


# --- the executor: one reconciliation of one cache, its effects carried out ---------------------


async def run_once(ctx: ControlContext, key: Key) -> float | None:
    """Reconcile the cache ``key`` and carry out what that decided: the status patch, its
    Events, our finalizer. Returns when it is due again (None: it is gone)."""
    if not ctx.leading():
        return None  # leadership just lost: follow() drops this queue, the new leader acts
    views = ctx.views
    view = views.cache(key) if views is not None else None
    if view is None:  # deleted (its finalizer already removed), or not ours
        ctx.forget(key)
        return None
    if view.spec is None:
        logger.error(f"{view.namespace}/{view.name}: its spec does not validate against this operator's models")
        return ctx.settings.reconcile_interval
    if view.deleting and not view.finalized:
        ctx.forget(key)
        return None  # not ours to hold back
    if not ctx.written_shown(key, view.resource_version):
        return WRITE_RECHECK_S  # on_cache makes it due as soon as the view shows the write
    kube = ctx.api()
    if not view.deleting and not view.finalized:
        await kube.add_finalizer(cache_path(view), view.finalizers, FINALIZER)
    quiet = ctx.quiet.pop(key, None)
    if quiet is not None and quiet.holds(view, views, clock.now().timestamp()):
        ctx.quiet[key] = quiet  # nothing it reads has changed: it would change nothing
        return ctx.settings.reconcile_interval
    out = Outbox(view)
    result = await reconcile(ctx, view, out)
    if out.quiet is not None:
        ctx.quiet[key] = out.quiet
    if out.status:
        ctx.wrote(key, await kube.patch_status(cache_path(view), out.status))
    for e in out.events:
        ctx.post(e)
    if not view.deleting:
        return min(ctx.settings.reconcile_interval, RELEASE_AGAIN_S) if out.again else ctx.settings.reconcile_interval
    return await _finalize(ctx, view, result)


async def _finalize(ctx: ControlContext, view: CacheView, result: tuple[int, int] | None) -> float | None:
    """Behind our finalizer: wait until no pod uses the cache and every node's copy is wiped."""
    if result is None:
        return 1.0  # the pod and Job views are still filling
    live, pending = result
    tries = ctx.deleting[view.key] = ctx.deleting.get(view.key, 0) + 1
    # Back off while waiting.
    delay = min(60.0, max(1.0, ctx.settings.reconcile_interval / 2) * tries)
    if live:
        if tries == 1:
            ctx.post(
                Event(
                    view.involved(),
                    "Normal",
                    reason="DeletionWaiting",
                    message=f"{live} pod(s) still use this cache; its copies are wiped once they end",
                )
            )
        return delay
    if pending:
        return delay
    await ctx.api().remove_finalizer(cache_path(view), view.finalizers, FINALIZER)
    ctx.forget(view.key)
    return None


async def _reconcile_once_listed(ctx: ControlContext, scheduler: Scheduler) -> None:
    """Start reconciling once the views have listed: a cache reconciled before its pods
    are known gets its status written twice (without nodes, then with them), and at
    10,000 caches the API server's time is what convergence waits on."""
    assert ctx.views is not None
    await ctx.views.listed(VIEWS_LIST_WAIT)
    await scheduler.run()


def _lead(ctx: ControlContext) -> None:
    """This replica now holds the Lease: a fresh queue, every cache known due at once."""
    assert ctx.views is not None
    scheduler = Scheduler(lambda key: run_once(ctx, key), workers=RECONCILE_WORKERS)  # type: ignore[arg-type]
    for key in ctx.views.caches.held_keys():
        scheduler.touch(key)
    ctx.scheduler = scheduler
    ctx.reconciling = asyncio.create_task(_reconcile_once_listed(ctx, scheduler))
    ctx.metrics.leader.set(1)


async def _campaign(ctx: ControlContext, elector: LeaderElector) -> None:
    """Stand for the Lease once this replica is warm: its views listed, then one retry period.

    A leader that steps down on SIGTERM empties the Lease, and the first replica to try then
    takes it. The warm standby tries every retry period; the Deployment's replacement for the
    old leader starts seconds later and, were it to try at once, could win that race and
    lead with cold views (it would list first, then reconcile: a slower handover). Waiting
    a retry period after listing leaves a released Lease to the standby, which tries within
    one; it costs a fresh install 2 s before its first leader."""
    assert ctx.views is not None
    await ctx.views.listed(VIEWS_LIST_WAIT)
    await asyncio.sleep(elector.config.retry_period)
    await elector.run()


def cache_path(view: CacheView) -> str:
    return f"/apis/{GROUP}/{VERSION}/namespaces/{view.namespace}/{PLURAL}/{view.name}"


def make_registry(settings: Any) -> kopf.OperatorRegistry:
    """The controller's process: kopf logs in, serves the probes and runs start-up and
    clean-up; the caches are watched and reconciled by our own informer and scheduler
    (schedule.py says why not kopf's timers)."""
    registry = kopf.OperatorRegistry()

    @kopf.on.startup(registry=registry)
    async def configure(settings: kopf.OperatorSettings, memo: Any, **_: Any) -> None:
        ctx = control_ctx(memo)
        context.configure_kopf(settings)
        kube = ctx.ensure_kube()
        ctx.poster = Poster(kube)
        ctx.views = Views(kube, ctx.settings.watch_namespaces, on_cache=ctx.on_cache, touch=ctx.touch)
        ctx.views.start()
        ctx.background = [asyncio.create_task(ctx.poster.run())]
        s = ctx.settings
        if s.leader_election:
            # A standby keeps its views warm and reconciles nothing until it holds the Lease.
            ctx.elector = LeaderElector(
                kube, LeaseConfig(s.namespace, s.lease_name, s.pod_name), lambda: _lead(ctx), ctx.follow
            )
            ctx.metrics.leader.set(0)
            ctx.background.append(asyncio.create_task(_campaign(ctx, ctx.elector)))
        else:
            _lead(ctx)
        await context.start_metrics(ctx)

    @kopf.on.login(registry=registry)
    async def login(memo: Any, **kwargs: Any) -> kopf.AiohttpSession:
        return await context.login(control_ctx(memo), **kwargs)

    @kopf.on.probe(id="views", registry=registry)
    async def views_probe(memo: Any, **_: Any) -> bool:
        # A controller whose credentials the API server refuses for minutes is
        # blind: fail liveness so that it restarts (and reads its token afresh).
        views = control_ctx(memo).views
        failing = views.auth_failing_for() if views is not None else 0.0
        if failing > AUTH_FAILURE_LIMIT:
            raise RuntimeError(f"the API server has refused our credentials for {failing:.0f} s")
        return bool(views is not None and views.ready())

    @kopf.on.probe(id="leader", registry=registry)
    async def leader_probe(memo: Any, **_: Any) -> str:
        # Shown in /healthz (and dscache_controller_leader): never fails readiness, or a
        # standby would never be Ready and a rolling update would stall on it.
        ctx = control_ctx(memo)
        return "leader" if ctx.leading() else f"standby (leader: {ctx.elector.holder if ctx.elector else '?'})"

    @kopf.on.cleanup(registry=registry)
    async def cleanup(memo: Any, **_: Any) -> None:
        ctx = control_ctx(memo)
        ctx.follow()
        for task in ctx.background:
            task.cancel()
        await asyncio.gather(*ctx.background, return_exceptions=True)
        if ctx.elector is not None:
            await ctx.elector.release()  # the standby takes over on its next try, not in 15 s
        if ctx.scheduler is not None:
            await ctx.scheduler.stop()
        if ctx.views is not None:
            await ctx.views.stop()
        await context.shutdown(ctx)

    return registry
