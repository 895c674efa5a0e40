"""One cache's node copies: what each node holds, which wipes to send, and what their answers change (pure).

The whole wipe loop's bookkeeping lives here, as functions of state that return
actions; controller.run_once is the one executor that carries them out:

1. ``plan_nodes`` turns the consumer pods (workloads.py) and the previous
   ``status.nodes`` into new node entries and the wipes to send now (``Release``);
2. the executor sends each to the node's agent (agentclient.py);
3. ``judge_wipe`` says what the answer means (``WipeResult``: its outcome, the
   node's message, the Event and the metric), and ``record_wipe`` writes it
   into the node's entry, which the next plan reads.

It is level-based: it depends only on current state, so a restarted operator
reaches the same answer. The wipe itself is safe on its own (leases under the
stagers' lock): the plan decides when it is worth trying and which leases to release.
"""

from __future__ import annotations

import datetime
import enum
from collections.abc import Iterable
from typing import NamedTuple

import dscache_contract as contract
from dscache_contract import STAGER_CONTAINER_NAME
from dscache_contract.clock import fmt_time, parse_time

from ..api.models import (
    NODE_MODES,
    NodeRevision,
    NodeState,
    NodeStatus,
    Retention,
    RetentionPolicy,
    VolumeMode,
    parse_duration,
)
from ..cluster.workloads import InitState, OwnerLookup, PodInfo, holds
from ..metrics.cacheseries import WipeCount

#: Stray leases recorded per (node, revision) are capped: status must stay small.
MAX_STRAY_LEASES = 200
#: How long a revision that a wipe found held by what it could not release
#: waits before the next wipe request, unless a lease it found can be released
#: by then. Without it a stray entry (a file someone left under leases/, which no
#: pod's end will ever release) sent a wipe every reconciliation.
KEPT_RETRY_S = 300.0
#: How long a wiped revision (and a wiped node) stays listed, so that the finished
#: pods that used it do not bring it back.
KEEP_WIPED_S = 3600.0

#: The pseudo-revision of a node's version 1 copy: the data that version 1 staged
#: straight into the top of C. Read only by pods without a revision annotation
#: (they mount C itself); removed by ``wipe --legacy``. Listed in
#: status.nodes[].revisions like a real revision (never an "r-" id), so it gets
#: the same consumers, lastUsed, retention and wipedAt bookkeeping.
LEGACY = "legacy"


class Release(NamedTuple):
    """One wipe to send: remove ``revision`` (None: the whole cache dir, on
    deletion; LEGACY: the version 1 copy) on the node once the leases of ``release``
    are deleted."""

    revision: str | None
    release: tuple[str, ...]


class NodePlan(NamedTuple):
    entry: NodeStatus
    wipes: list[Release]


class Scope(NamedTuple):
    """What holds for every node of one cache in one plan."""

    owners: OwnerLookup
    retention: Retention
    now: datetime.datetime
    deleting: bool = False
    #: revisions of unscheduled live pods (they may land on any node)
    blocked_everywhere: frozenset[str] = frozenset()
    #: an unscheduled live pod of unknown revision exists: keep everything everywhere
    block_all: bool = False
    #: UIDs of every pod of the cache that still holds its revision
    live_anywhere: frozenset[str] = frozenset()
    keep_wiped: float = KEEP_WIPED_S


# --- planning ------------------------------------------------------------------------------


def plan_nodes(
    prior: list[NodeStatus],
    pods: Iterable[PodInfo],
    owners: OwnerLookup,
    retention: Retention,
    now: datetime.datetime,
    deleting: bool = False,
    keep: dict[str, frozenset[str]] | None = None,
) -> dict[str, NodePlan]:
    """The node entries to show and the wipes to send. ``keep``: per node, the
    revisions pre-staged there (spec.prestage), never wiped while so."""
    pods = list(pods)
    by_node: dict[str, list[PodInfo]] = {}
    blocked: set[str] = set()
    block_all = False
    for p in pods:
        if p.node:
            by_node.setdefault(p.node, []).append(p)
        elif not p.finished and p.mode in NODE_MODES:
            # Not scheduled yet: it may land on any node, so its revision stays everywhere.
            if p.revision:
                blocked.add(p.revision)
            else:
                block_all = True
    live = frozenset(p.uid for p in pods if p.uid and holds(p, owners, deleting))
    scope = Scope(owners, retention, now, deleting, frozenset(blocked), block_all, live)
    prior_by_node = {n.node: n for n in prior}
    plans = {}
    for node in sorted(set(by_node) | set(prior_by_node)):
        old = prior_by_node.get(node)
        if old is not None and node not in by_node and old.state == NodeState.WIPED:
            wiped = parse_time(old.wipedAt)
            if wiped is None or (now - wiped).total_seconds() > scope.keep_wiped:
                continue  # keep status bounded: forget long-wiped nodes no pod refers to
        plan = plan_node(node, old, by_node.get(node, []), scope, (keep or {}).get(node, frozenset()))
        if plan is not None:
            plans[node] = plan
    return plans


def plan_node(
    node: str, prior: NodeStatus | None, pods: list[PodInfo], scope: Scope, keep: frozenset[str] = frozenset()
) -> NodePlan | None:
    """One node's entry and wipes (None: nothing of the cache is or was there)."""
    wiped_at = parse_time(prior.wipedAt) if prior is not None else None
    consumers = [p for p in pods if holds(p, scope.owners, scope.deleting)]
    relevant = [p for p in pods if p in consumers or _started_after(p, wiped_at)]
    if prior is None and not relevant:
        return None  # only old, finished pods: nothing of theirs is on the node any more
    # A copy of the entry's own fields: its revisions are copied by _revisions, which replaces the list.
    entry = prior.model_copy() if prior is not None else NodeStatus(node=node, state=NodeState.STAGING)
    if relevant:
        _set_state(entry, consumers, relevant)
        if entry.message is None and prior is not None and any(r.keptAt for r in entry.revisions):
            # A wipe's "kept: ..." (what holds the copy, e.g. an entry to remove by hand) stays
            # while the revision waits to be asked again, not only until the next reconciliation.
            entry.message = prior.message
    if len(consumers) != entry.consumers or (prior is None and relevant):
        entry.lastUsed = fmt_time(scope.now)
    entry.consumers = len(consumers)
    entry.revisions = _revisions(entry, prior, consumers, relevant, scope)
    holds_copy = entry.state != NodeState.WIPED and (prior is not None or bool(relevant))
    done_here = [p for p in pods if p not in consumers]
    wipes = _wipes(entry, prior, consumers, done_here, holds_copy, scope, keep)
    return NodePlan(entry, wipes)


def _set_state(entry: NodeStatus, consumers: list[PodInfo], relevant: list[PodInfo]) -> None:
    """The node's state and figures, from its pods' stagers."""
    # A node copy if any pod staged one there (CSI first: that is what new pods get).
    on_node = {VolumeMode(p.mode) for p in relevant if p.mode in NODE_MODES}
    entry.volume = min(on_node, key=list(VolumeMode).index) if on_node else VolumeMode.EMPTY_DIR
    # Ready means: what the live consumers hold is on disk. So while any
    # consumer's stager has not finished (it may be re-staging a revision a
    # wipe just removed), the node is Staging, even if older pods were Ready.
    pending = [p for p in consumers if p.init in (None, InitState.WAITING, InitState.RUNNING)]
    basis = consumers if consumers else relevant
    ok = [p for p in basis if p.init == InitState.OK]
    failed = [p for p in basis if p.init == InitState.FAILED]
    if pending:
        entry.state, entry.message = NodeState.STAGING, None
    elif ok:
        best = max(ok, key=lambda p: p.started or "")
        entry.state, entry.message = NodeState.READY, None
        if best.summary is not None:
            s = best.summary
            entry.bytes, entry.objects, entry.seconds = s.bytes, s.objects, s.seconds
            entry.bucketBytes, entry.peerBytes = s.bucket_bytes, s.peer_bytes
    elif failed:
        last = max(failed, key=lambda p: p.started or "")
        entry.state = NodeState.FAILED
        entry.message = (last.message or "the stager failed; see kubectl logs -c " + STAGER_CONTAINER_NAME)[:4096]


def _revisions(
    entry: NodeStatus, prior: NodeStatus | None, consumers: list[PodInfo], relevant: list[PodInfo], scope: Scope
) -> list[NodeRevision]:
    """Revisions on the node, and the pods that have (had) a lease on each.

    A wiped revision stays listed (wipedAt) for keep_wiped, so that the finished
    pods that used it do not bring it back; a pod holding it, or one that
    started staging it after the wipe, does."""
    now = scope.now
    revs: dict[str, NodeRevision] = {}
    for r in entry.revisions:
        wiped = parse_time(r.wipedAt)
        if wiped is None or (now - wiped).total_seconds() <= scope.keep_wiped:
            revs[r.id] = _copy(r)
    if prior is not None and not prior.revisions and prior.volume in NODE_MODES and prior.state != NodeState.WIPED:
        # An entry written before revisions existed: its node holds a version 1 copy.
        revs[LEGACY] = NodeRevision(id=LEGACY, lastUsed=prior.lastUsed or fmt_time(now))
    for p in relevant:
        if p.mode not in NODE_MODES:
            continue
        rid = p.revision or LEGACY  # a pod without a revision staged (and reads) the version 1 copy
        known = revs.get(rid)
        if known is None:
            revs[rid] = NodeRevision(id=rid, lastUsed=fmt_time(now))
        elif known.wipedAt is not None:
            if p not in consumers and not _started_after(p, parse_time(known.wipedAt)):
                continue
            known.wipedAt, known.strayLeases, known.lastUsed, known.keptAt = None, [], fmt_time(now), None
    for r in revs.values():
        n = sum(1 for p in consumers if (p.revision or LEGACY) == r.id)
        if n != r.consumers:
            r.consumers, r.lastUsed, r.keptAt = n, fmt_time(now), None
    return [revs[k] for k in sorted(revs)]


def _copy(r: NodeRevision) -> NodeRevision:
    """A copy of ``r`` that changes nothing of ``r`` when changed. Not model_copy(deep=True): a
    generic deepcopy of every entry was half of a steady reconciliation's CPU, and the one
    list here (strayLeases) is copied just as well by hand."""
    return r.model_copy(update={"strayLeases": list(r.strayLeases)})


def _wipes(
    entry: NodeStatus,
    prior: NodeStatus | None,
    consumers: list[PodInfo],
    done_here: list[PodInfo],
    holds_copy: bool,
    scope: Scope,
    keep: frozenset[str],
) -> list[Release]:
    """The wipes worth sending to this node now (and the entry Wiped when nothing is left)."""
    now = scope.now
    if entry.volume == VolumeMode.EMPTY_DIR:
        if holds_copy and not consumers and (scope.deleting or _ttl_passed(entry.lastUsed, scope.retention, now)):
            # The kubelet removes emptyDir volumes with their pods: nothing of ours remains.
            entry.state, entry.wipedAt, entry.revisions = NodeState.WIPED, fmt_time(now), []
        return []
    if scope.block_all or not holds_copy:
        return []  # an unscheduled pod of unknown revision may land here: keep everything
    if scope.deleting:
        return _whole_cache_wipe(entry, consumers, done_here, scope)
    wipes = _revision_wipes(entry, consumers, done_here, scope, keep)
    # Nothing of any revision left here (a version 1 copy is LEGACY, listed until wiped).
    left = any(r.wipedAt is None for r in entry.revisions)
    if not left and not consumers and prior is not None and entry.state != NodeState.WIPED:
        entry.state, entry.wipedAt = NodeState.WIPED, fmt_time(now)
    return wipes


def _releasable(r: NodeRevision, live_anywhere: frozenset[str]) -> set[str]:
    """The stray leases an earlier wipe of ``r`` reported that belong to no pod holding it.

    A wipe releases these besides the leases of this node's pods that no longer
    hold the revision. A lease is written by a running stager, whose pod carries
    our label from admission on, so the pod view shows it within the watch lag; a
    UID still unknown one reconciliation after a wipe reported it is a pod deleted
    meanwhile (e.g. while the operator was down), and keeping its lease would keep
    the revision forever."""
    return {u for u in r.strayLeases if u not in live_anywhere}


def _whole_cache_wipe(
    entry: NodeStatus, consumers: list[PodInfo], done_here: list[PodInfo], scope: Scope
) -> list[Release]:
    """On deletion: one wipe removes C itself once no lease at all remains."""
    # A whole-cache wipe that was kept marked every revision (record_wipe).
    kept = [r for r in entry.revisions if r.keptAt]
    waits = bool(kept) and all(_kept_waits(r, scope.live_anywhere, scope.now) for r in kept)
    if consumers or scope.blocked_everywhere or waits:
        return []
    release = {p.uid for p in done_here if p.uid}
    for r in entry.revisions:
        if r.wipedAt is None:
            release |= _releasable(r, scope.live_anywhere)
    return [Release(None, tuple(sorted(release)))]


def _revision_wipes(
    entry: NodeStatus, consumers: list[PodInfo], done_here: list[PodInfo], scope: Scope, keep: frozenset[str]
) -> list[Release]:
    """One wipe per revision that nothing holds and whose retention has passed."""
    # A pod without a revision annotation mounts C itself, so it sees every
    # revision and the version 1 copy: while one holds here, nothing is removed.
    if any(not p.revision for p in consumers):
        return []
    now, live = scope.now, scope.live_anywhere
    wipes: list[Release] = []
    for r in entry.revisions:
        if r.wipedAt is not None or r.consumers or r.id in scope.blocked_everywhere or r.id in keep:
            continue
        if not _ttl_passed(r.lastUsed, scope.retention, now) or _kept_waits(r, live, now):
            continue
        if r.id == LEGACY:
            # Why no reader of the version 1 copy ever sees its files vanish:
            # only a pod admitted without a revision annotation reads it (it
            # mounts C; every other container mounts revs/<rev>/data). We get
            # here only when no such pod holds on this node (above) and none is
            # unscheduled anywhere (block_all, in _wipes), judged on complete
            # views (the controller waits for them). This webhook never admits
            # a pod without a revision (webhook.no_revision), so once every
            # webhook replica runs it that set only shrinks and the condition
            # stays true. What is left is a rolling upgrade, where an old
            # replica may admit such a pod that our view does not show yet;
            # the agent's wipe closes that on disk (dscache_stager.wipe): while its
            # stager stages it holds version 1's lock (the wipe is busy), once
            # it finished the copy changed less than LEGACY_QUIET_S ago (busy
            # too), and before it starts its pod reads nothing and it stages a
            # fresh copy. Either way the next plan sees the pod and waits.
            # No leases to release: version 1 wrote none.
            wipes.append(Release(LEGACY, ()))
            continue
        release = {p.uid for p in done_here if p.uid and p.revision == r.id} | _releasable(r, live)
        wipes.append(Release(r.id, tuple(sorted(release))))
    return wipes


def _started_after(pod: PodInfo, wiped_at: datetime.datetime | None) -> bool:
    started = parse_time(pod.started)
    if started is None:
        return False
    return wiped_at is None or started >= wiped_at


def _ttl(retention: Retention) -> float:
    """Seconds an unused copy is kept (0: wiped as soon as nothing holds it)."""
    if retention.policy == RetentionPolicy.WIPE_ON_JOB_COMPLETION:
        return 0.0
    return parse_duration(retention.ttlAfterLastUse or "0s")


def _ttl_passed(last_used: str | None, retention: Retention, now: datetime.datetime) -> bool:
    if retention.policy == RetentionPolicy.WIPE_ON_JOB_COMPLETION:
        return True  # whatever lastUsed says (even a time ahead of this clock)
    last = parse_time(last_used) or now
    return (now - last).total_seconds() >= _ttl(retention)


def _kept_waits(r: NodeRevision, live_anywhere: frozenset[str], now: datetime.datetime) -> bool:
    """Whether the next wipe of ``r`` waits: a wipe found it held (keptAt) less than
    KEPT_RETRY_S ago, and none of the leases it found can be released now."""
    kept = parse_time(r.keptAt)
    if kept is None or (now - kept).total_seconds() >= KEPT_RETRY_S:
        return False
    return not any(u not in live_anywhere for u in r.strayLeases)


def changes_by_time_at(
    entries: list[NodeStatus], retention: Retention, now: datetime.datetime, keep_wiped: float = KEEP_WIPED_S
) -> datetime.datetime | None:
    """When time alone (the pods, their owners and these entries as they are) would first make
    the next plan differ from these entries; None: never. What time decides above: a copy
    whose retention runs out (_ttl_passed), a kept revision whose next wipe stops waiting
    (_kept_waits), and a wiped revision or node that is forgotten (keep_wiped)."""
    wait = datetime.timedelta(seconds=_ttl(retention))
    at: list[datetime.datetime] = []

    def when(stamp: str | None, after: datetime.timedelta) -> None:
        t = parse_time(stamp)
        at.append(now if t is None else t + after)  # unreadable: judged every time, as the plan does

    for e in entries:
        if e.wipedAt is not None or e.state == NodeState.WIPED:
            when(e.wipedAt, datetime.timedelta(seconds=keep_wiped))
        if e.consumers == 0 and e.volume == VolumeMode.EMPTY_DIR:
            when(e.lastUsed, wait)
        for r in e.revisions:
            if r.wipedAt is not None:
                when(r.wipedAt, datetime.timedelta(seconds=keep_wiped))
            elif r.consumers == 0:
                when(r.lastUsed, wait)
            if r.keptAt is not None:
                when(r.keptAt, datetime.timedelta(seconds=KEPT_RETRY_S))
    return min(at, default=None)


# --- a wipe's answer --------------------------------------------------------------------------


class Outcome(enum.Enum):
    IN_PROGRESS = "in-progress"  # not done this time (busy, or the agent could not be asked): asked again later
    REMOVED = "removed"  # gone (or it was never there)
    KEPT = "kept"  # leases the controller did not release still hold it


class NoAgent(NamedTuple):
    """No agent could be asked: none runs on the node (or it has no address)."""


class AgentFailed(NamedTuple):
    """The agent could not carry the wipe out now; busy: a stager holds the cache's lock."""

    message: str
    busy: bool = False


Answer = contract.WipeSummary | NoAgent | AgentFailed


class Say(NamedTuple):
    """An Event to post about the cache."""

    type: str  # Normal | Warning
    reason: str
    message: str


class WipeResult(NamedTuple):
    outcome: Outcome
    metric: WipeCount
    message: str | None  # the node entry's message from now on (None: none)
    event: Say | None = None
    leases: tuple[str, ...] = ()  # KEPT: the pod UIDs whose leases kept it


def request_for(namespace: str, name: str, step: Release) -> contract.WipeRequest:
    legacy = step.revision == LEGACY
    return contract.WipeRequest(
        namespace=namespace,
        cache=name,
        revision=None if legacy else step.revision,
        all_revisions=step.revision is None,
        legacy=legacy,
        release=() if legacy else tuple(step.release),
    )


def describe(step: Release) -> str:
    if step.revision == LEGACY:
        return "the copy that predates revisions"
    return f"revision {step.revision}" if step.revision else "the whole cache dir"


def judge_wipe(entry: NodeStatus, step: Release, answer: Answer, operator_namespace: str) -> WipeResult:
    """What one wipe's answer means for its node."""
    what = describe(step)
    if isinstance(answer, NoAgent):
        return _failed(
            entry,
            f"no dscache-node agent runs on node {entry.node}: {what} cannot be wiped until one does "
            f"(check the chart's nodeAgent.nodeSelector and tolerations, and kubectl get pods -n "
            f"{operator_namespace} -l app.kubernetes.io/name=dscache-node)",
        )
    if isinstance(answer, AgentFailed):
        if answer.busy:  # a stager holds the cache's lock right now: simply try again
            return WipeResult(Outcome.IN_PROGRESS, WipeCount.BUSY, entry.message)
        return _failed(entry, f"wiping {what} on node {entry.node} failed: {answer.message}")
    if answer.existed and not answer.removed:
        uids = lease_uids(answer.leases)
        why = []
        if uids:
            why.append(f"lease(s) of pod(s) {', '.join(uids[:5])}{' ...' if len(uids) > 5 else ''} remain")
        if answer.stray:
            # Not a pod's lease, so no pod's end will release it: say where it is.
            why.append(
                f"{len(answer.stray)} entry(ies) under {answer.cache} that are no lease: "
                f"{', '.join(answer.stray[:5])}{' ...' if len(answer.stray) > 5 else ''} (remove them by hand)"
            )
        message = f"{what} kept: {'; '.join(why) or 'no reason given'}"[:4096]
        return WipeResult(Outcome.KEPT, WipeCount.KEPT, message, leases=tuple(uids))
    done = f"wiped {what} on node {entry.node}"
    return WipeResult(Outcome.REMOVED, WipeCount.SUCCEEDED, None, Say("Normal", reason="Wiped", message=done))


def _failed(entry: NodeStatus, message: str) -> WipeResult:
    # One Event per new reason, not one per reconciliation.
    new = entry.message != message[:4096]
    event = Say("Warning", reason="WipeFailed", message=f"{message}; retrying") if new else None
    return WipeResult(Outcome.IN_PROGRESS, WipeCount.FAILED, message[:4096], event)


def record_wipe(entry: NodeStatus, step: Release, result: WipeResult, now: datetime.datetime) -> None:
    """What one wipe's result changes in its node's entry."""
    entry.message = result.message
    for r in entry.revisions:
        if step.revision not in (None, r.id):
            continue
        if result.outcome is Outcome.REMOVED:
            r.wipedAt, r.strayLeases, r.consumers, r.keptAt = fmt_time(now), [], 0, None
        elif result.outcome is Outcome.KEPT:
            # Leases of pods we did not release: looked at again next time (see
            # _releasable for why an unknown one is then released, and _kept_waits
            # for why a revision kept by nothing releasable waits before the next try).
            r.strayLeases, r.keptAt = sorted(set(result.leases))[:MAX_STRAY_LEASES], fmt_time(now)


def release_next(step: Release, result: WipeResult, known: frozenset[str]) -> bool:
    """Whether a wipe kept by leases it did not release found one of a pod that is in no view
    of ours (``known``: the cache's pods we see): the next plan releases it (_releasable), so
    the cache is worth reconciling again at once, not at the next interval. A pod that ran and
    was deleted before a reconciliation saw it finish leaves exactly that (its lease, and no
    pod to release it with). A lease the wipe already asked to release does not count: a
    kept answer to that is not asked again sooner. (One that a fresh read showed still running,
    so not asked, is asked again each RELEASE_AGAIN_S until our view shows its pod, the watch's
    lag: only a pod our webhook admitted runs a stager, which writes leases.)"""
    return result.outcome is Outcome.KEPT and any(u not in known and u not in step.release for u in result.leases)


def settle(entry: NodeStatus, plan: NodePlan, now: datetime.datetime) -> bool:
    """After the node's wipes: mark it Wiped when nothing is left; True if a copy remains there."""
    if plan.wipes and not entry.consumers and all(r.wipedAt for r in entry.revisions):
        if entry.state != NodeState.WIPED:
            entry.state, entry.wipedAt = NodeState.WIPED, fmt_time(now)
        return False
    return not plan.wipes and entry.state != NodeState.WIPED and entry.volume in NODE_MODES


def lease_uids(leases: list[str]) -> list[str]:
    """The pod UIDs a wipe reported, checked: they go back as ``release``, which
    WipeRequest accepts only as plain UIDs (anything else is left out)."""
    out = set()
    for uid in leases:
        try:
            out.add(contract.validate_pod_uid(uid))
        except ValueError:
            continue
    return sorted(out)
