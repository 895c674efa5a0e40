"""The controller: source checks, consumer tracking, per-node state and wipes.

Everything is level-based: one timer per DatasetCache recomputes the wanted
status from read-only views of users' pods and Jobs (the informers of
informer.py, filtered by the webhook's ``dscache.io/consumer`` label) and from
the API server, and acts on the difference. A restarted operator therefore
converges: no node decision is made before both views have listed everything,
wipe helper pods have deterministic names, and a node's copy is wiped only
when no consumer is alive there.
"""

from __future__ import annotations

import asyncio
import datetime
import time
from typing import Any

import kopf

from . import common, sourcecheck, status as st, wipe
from .common import Runtime
from .consumers import fmt_time, job_finished, parse_time, plan_nodes, pod_info, pod_key
from .kube import ApiError
from .informer import MultiInformer
from .metrics import METRICS
from .models import CONSUMER_LABEL, GROUP, PLURAL, VERSION, DatasetCacheSpec, NodeStatus

registry = kopf.OperatorRegistry()
CACHES = (GROUP, VERSION, PLURAL)


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


class Consumers:
    """The controller's read-only views of users' pods and Jobs (see informer.py)."""

    pods: MultiInformer | None = None
    jobs: MultiInformer | None = None

    @classmethod
    def ready(cls) -> bool:
        # Not bool(informer): an informer with no objects is falsy (len 0) yet ready.
        return (cls.pods is not None and cls.jobs is not None
                and cls.pods.ready and cls.jobs.ready)


def _pod_extract(body: dict[str, Any]):
    key = pod_key(body)
    return (key, pod_info(body)) if key else None


def _job_extract(body: dict[str, Any]):
    meta = body.get("metadata") or {}
    return ((meta.get("namespace"), meta.get("name")), job_finished(body))


@kopf.on.startup(registry=registry)
async def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    common.configure_kopf(settings)
    kube = common.ensure_kube()
    namespaces = Runtime.settings.watch_namespaces
    selector = f"{CONSUMER_LABEL}=true"
    Consumers.pods = MultiInformer(kube, "/api/v1", "pods", namespaces, selector, _pod_extract)
    Consumers.jobs = MultiInformer(kube, "/apis/batch/v1", "jobs", namespaces, selector, _job_extract)
    Consumers.pods.start()
    Consumers.jobs.start()
    await common.start_metrics()


@kopf.on.login(registry=registry)
async def login(**kwargs: Any) -> kopf.AiohttpSession:
    return await common.login(**kwargs)


@kopf.on.cleanup(registry=registry)
async def cleanup(**_: Any) -> None:
    for informer in (Consumers.pods, Consumers.jobs):
        if informer is not None:
            await informer.stop()
    await common.shutdown()


def _job_lookup(namespace: str):
    def state(job: str) -> bool | None:
        values = Consumers.jobs.get((namespace, job)) if Consumers.jobs else []
        return values[0] if values else None
    return state


# --- source check -----------------------------------------------------------------

async def check_source(namespace: str, spec: DatasetCacheSpec) -> sourcecheck.CheckResult:
    creds = None
    secret_name = spec.source.secret_name
    if secret_name:
        try:
            secret = await common.kube().get_secret(namespace, secret_name)
        except ApiError as e:
            if e.status == 403:
                return sourcecheck.secret_forbidden(namespace, secret_name, Runtime.settings.namespace)
            raise kopf.TemporaryError(f"reading Secret {namespace}/{secret_name}: {e}", delay=5)
        got = sourcecheck.credentials_from_secret(secret, namespace, secret_name)
        if isinstance(got, sourcecheck.CheckResult):
            return got
        creds = got
    return await sourcecheck.check(spec.source, creds)


def _source_due(meta: Any, status: dict[str, Any], memo: Any) -> bool:
    if status.get("observedGeneration") != meta.get("generation"):
        return True
    if status.get("phase") == "Failed":
        last = getattr(memo, "last_check", 0.0)
        return time.monotonic() - last >= Runtime.settings.source_retry_interval
    return False


# --- wipes -------------------------------------------------------------------------

async def run_wipe(body: kopf.Body, namespace: str, name: str, entry: NodeStatus,
                   newest_use: datetime.datetime | None, logger: Any) -> bool:
    """Drive one node's wipe one step; True once the copy is gone (entry updated)."""
    kube = common.kube()
    settings = Runtime.settings
    pod_name = wipe.helper_name(namespace, name, entry.node)
    pod = await kube.get_pod(settings.namespace, pod_name)
    state = wipe.helper_state(pod)
    if state is not wipe.WipeState.ABSENT:
        created = parse_time((pod.get("metadata") or {}).get("creationTimestamp"))
        if newest_use and created and newest_use > created:
            # A stager started after this helper was created: its result is stale.
            await kube.delete_pod(settings.namespace, pod_name)
            return False
    if state is wipe.WipeState.ABSENT:
        created_pod = await kube.create_pod(settings.namespace, wipe.helper_pod(namespace, name, entry.node, settings))
        if created_pod is not None:
            METRICS.inc("dscache_wipes_total", "Wipe helper pods by outcome.", result="started")
            logger.info(f"wiping the copy on node {entry.node} with pod {pod_name}")
            kopf.event(body, type="Normal", reason="Wiping",
                       message=f"wiping the copy on node {entry.node} (helper pod "
                               f"{settings.namespace}/{pod_name})")
        return False
    if state is wipe.WipeState.RUNNING:
        return False
    if state is wipe.WipeState.FAILED:
        msg = wipe.helper_message(pod)
        METRICS.inc("dscache_wipes_total", "Wipe helper pods by outcome.", result="failed")
        kopf.event(body, type="Warning", reason="WipeFailed",
                   message=f"wiping node {entry.node} failed: {msg}; retrying")
        entry.message = f"wipe failed: {msg}"
        await kube.delete_pod(settings.namespace, pod_name)
        return False
    # Succeeded.
    created = (pod.get("metadata") or {}).get("creationTimestamp")
    entry.state = "Wiped"
    entry.wipedAt = created or fmt_time(_now())
    entry.message = None
    METRICS.inc("dscache_wipes_total", "Wipe helper pods by outcome.", result="succeeded")
    kopf.event(body, type="Normal", reason="Wiped", message=f"wiped the copy on node {entry.node}")
    await kube.delete_pod(settings.namespace, pod_name)
    return True


# --- the level-based reconciliation ----------------------------------------------------

def _events_for_transitions(body: kopf.Body, prior: dict[str, NodeStatus], entries: list[NodeStatus]) -> None:
    for e in entries:
        old = prior.get(e.node)
        if old is not None and old.state == e.state:
            continue
        if e.state == "Ready":
            kopf.event(body, type="Normal", reason="NodeReady",
                       message=f"node {e.node}: {e.objects} objects, {e.bytes} bytes staged in {e.seconds} s")
        elif e.state == "Failed":
            kopf.event(body, type="Warning", reason="NodeFailed", message=f"node {e.node}: {e.message}")


async def reconcile(*, body: kopf.Body, meta: Any, spec: Any, status: Any, namespace: str,
                    name: str, patch: kopf.Patch, memo: Any, logger: Any,
                    deleting: bool = False, **_: Any) -> tuple[int, int] | None:
    """Recompute and patch status; return (live consumers, copies not yet wiped),
    or None while the pod/Job views are still filling (no node decision then)."""
    cache = DatasetCacheSpec.model_validate(dict(spec))
    current: dict[str, Any] = dict(status)
    wanted: dict[str, Any] = {}
    now = _now()

    # 1. The source, on create/spec change (and retried while it is failing).
    if not deleting and _source_due(meta, current, memo):
        result = await check_source(namespace, cache)
        memo.last_check = time.monotonic()
        METRICS.inc("dscache_source_checks_total", "Source checks by reason.", reason=result.reason)
        generation = meta.get("generation")
        conditions = st.set_condition(
            current.get("conditions") or [], type=st.SOURCE_READY,
            status={True: "True", False: "False", None: "Unknown"}[result.ok], reason=result.reason,
            message=result.message, generation=generation, now=now)
        old = st.get_condition(current, st.SOURCE_READY)
        if not old or old.get("reason") != result.reason or old.get("observedGeneration") != generation:
            kopf.event(body, type="Warning" if result.ok is False else "Normal",
                       reason="SourceChecked" if result.ok else result.reason, message=result.message)
        wanted.update(conditions=conditions, observedGeneration=generation,
                      phase="Failed" if result.ok is False else "Ready",
                      **st.source_fragment(result.objects, result.bytes))
    elif not current.get("phase"):
        wanted["phase"] = "Pending"
    if deleting:
        wanted["phase"] = "Deleting"

    # 2. Consumers and node copies, only once the views of pods and Jobs are
    #    complete (a cold view would look like "no consumers" and wipe in-use copies).
    if not Consumers.ready():
        for key, value in st.changed(current, wanted).items():
            patch.status[key] = value
        return None
    prior = [NodeStatus.model_validate(n) for n in current.get("nodes") or []]
    pods = Consumers.pods.get((namespace, name))
    plans = plan_nodes(prior, pods, _job_lookup(namespace), cache.retention,
                       now, deleting=deleting)
    entries: list[NodeStatus] = []
    live = pending = 0
    for node, plan in plans.items():
        entry = plan.entry
        live += entry.consumers
        if plan.wipe:
            done = await run_wipe(body, namespace, name, entry, plan.relevant_since, logger)
            pending += 0 if done else 1
        elif entry.state != "Wiped" and entry.volume == "HostPath":
            pending += 1
        entries.append(entry)
    _events_for_transitions(body, {p.node: p for p in prior}, entries)
    wanted.update(st.nodes_fragment(entries))

    diff = st.changed(current, wanted)
    for key, value in diff.items():
        patch.status[key] = value
    METRICS.set_cache(namespace, name, wanted.get("phase") or current.get("phase") or "Pending",
                      [e.state for e in entries])
    return live, pending


class _Slots:
    """At most a few reconciliations at once: bounded API concurrency and memory."""

    sem: asyncio.Semaphore | None = None

    @classmethod
    def get(cls) -> asyncio.Semaphore:
        if cls.sem is None:
            cls.sem = asyncio.Semaphore(8)
        return cls.sem


@kopf.timer(*CACHES, interval=Runtime.settings.reconcile_interval, registry=registry)
async def reconcile_timer(**kwargs: Any) -> None:
    async with _Slots.get():
        await reconcile(**kwargs)


@kopf.on.delete(*CACHES, registry=registry)
async def finalize(body: kopf.Body, name: str, namespace: str, retry: int, **kwargs: Any) -> None:
    """Behind our finalizer: wait until no pod uses the cache, then wipe every node."""
    result = await reconcile(body=body, name=name, namespace=namespace, deleting=True, **kwargs)
    if result is None:
        raise kopf.TemporaryError("waiting for the pod and Job views to fill", delay=1)
    live, pending = result
    # Back off while waiting: each retry is logged (and posted as an Event).
    delay = min(60.0, max(1.0, Runtime.settings.reconcile_interval / 2) * (1 + retry))
    if live:
        if retry == 0:
            kopf.event(body, type="Normal", reason="DeletionWaiting",
                       message=f"{live} pod(s) still use this cache; its copies are wiped once they end")
        raise kopf.TemporaryError(f"{live} consumer pod(s) still alive", delay=delay)
    if pending:
        raise kopf.TemporaryError(f"{pending} node copies still being wiped", delay=delay)
    METRICS.forget_cache(namespace, name)
