"""The node agent's work: read the disk, publish it on the Node, make room, wipe.

Every action that removes a copy runs the stager's own wipe (dscache_stager.wipe)
under the cache's flock, so the rules are the ones a stager obeys: a copy with
a lease is never removed, and a stager that takes the lock after a removal
stages again. The warm label comes off the Node before the copy goes (the
wipe's ``before_remove``), and goes on only after the copy was verified
against its manifest, so a label never names a copy that is not whole.
"""

from __future__ import annotations

import fcntl
import functools
import logging
import os
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import dscache_contract as contract
from dscache_contract import (
    INVENTORY_ANNOTATION,
    WARM_LABEL_PREFIX,
    HeldRevision,
    Inventory,
    PeersAnswer,
    PeersRequest,
    ReserveAnswer,
    ReserveRequest,
    WipeArgs,
    WipeRequest,
    WipeSummary,
    cache_digest,
    clock,
    human_bytes,
    warm_label,
)
from dscache_contract.csi import lease_mount
from dscache_contract.peers import STAGING_LABEL_PREFIX, RevisionState, parse_staging_label, staging_label
from dscache_stager.errors import BusyError
from dscache_stager.layout import cache_lock
from dscache_stager.wipe import wipe as run_wipe

from . import budget, disk, reservations
from .kube import ApiError, Kube
from .metrics import AgentMetrics
from .peers import Directory, revision_state
from .remover import Remover
from .settings import AgentSettings

log = logging.getLogger("dscache-node")

#: A reservation not turned into a complete copy within this long is forgotten.
RESERVATION_TTL = 6 * 3600.0


class _Event(NamedTuple):
    """An Event to post on a DatasetCache, once the agent's lock is let go."""

    namespace: str
    cache: str
    reason: str
    message: str


@dataclass
class PodView:
    """This node's consumer pods, from the watch (pods.py): UID -> finished."""

    finished: dict[str, bool] = field(default_factory=dict)
    synced: bool = False


class Agent:
    def __init__(self, settings: AgentSettings, kube: Kube | None, metrics: AgentMetrics) -> None:
        self.s = settings
        self.kube = kube
        self.metrics = metrics
        self.pods = PodView()
        # One mutation at a time: scans, reservations, evictions and wipes all read
        # the disk and then act on what they read. Held only for that: verifying a copy
        # against its manifest and removing a tree (the remover) run without it, and the
        # peers question takes only ``_state``, so no call waits behind slow work.
        self.lock = threading.RLock()
        # The in-memory state below (staging, reservations, what was published).
        self._state = threading.Lock()
        # One publication at a time; and the copies whose warm label was taken off on their way
        # out ((namespace, cache, revision, sealed)): never labelled again by a pass that read
        # the disk before they went.
        self._publishing = threading.Lock()
        self._doomed: set[tuple[str, str, str, tuple[int, int] | None]] = set()
        self.remover = Remover()
        self._verified: dict[tuple[str, str, str], tuple[int, int]] = {}
        # Reservations of copies in progress, kept on the disk across restarts (epoch seconds).
        self._reserved: dict[tuple[str, str, str], tuple[int, float]] = reservations.load(settings.cache_root)
        # Copies pre-stage pods made (spec.prestage), kept on the disk too: a pre-stage evicts none
        # of them to make room for itself (two pre-staged caches over one budget took turns forever).
        self._prestaged: set[tuple[str, str, str]] = reservations.load_prestaged(settings.cache_root)
        self._published: tuple[dict[str, str], str] | None = None
        # Copies in progress that asked for peers: (namespace, cache, revision) -> start (epoch s).
        # Published as staging labels while a stager holds the cache's lock; lost on restart, and
        # then asked for again by the stager within a second.
        self._staging: dict[tuple[str, str, str], float] = {}
        self._adopted = False
        self.directory = Directory(kube, settings.node) if kube is not None else None
        self.evicted_bytes = 0
        self.last_refresh = 0.0

    # --- reading the disk, publishing it --------------------------------------------------

    def c(self, namespace: str, cache: str) -> str:
        return contract.cache_dir(self.s.cache_root, namespace, cache)

    def refresh(self) -> list[disk.OnDisk]:
        """One pass: finish interrupted removals, release leases of finished pods, keep
        within the budget, verify new copies, publish labels and inventory."""
        events: list[_Event] = []
        with self.lock:
            queued = self.remover.queued()
            left = [p for p in disk.leftovers(self.s.cache_root) if p not in queued]
            for p in left:
                self.remover.remove(p, 0)
            if left:
                log.info(f"finishing {len(left)} removal(s) a killed process had left")
            revs = disk.scan(self.s.cache_root)
            if self._release_finished(revs):
                revs = disk.scan(self.s.cache_root)
            self._forget_reservations(revs)
            if self._enforce_budget(revs, events):
                revs = disk.scan(self.s.cache_root)
        self._post_events(events)
        # Off the lock: verifying a new copy reads its whole manifest.
        self._publish(revs)
        self.last_refresh = time.monotonic()
        return revs

    def _warm(self, revs: list[disk.OnDisk]) -> list[disk.OnDisk]:
        """Complete, verified copies, most wanted first, at most max_labels of them."""
        ok = []
        for r in revs:
            if not r.complete or r.sealed is None:
                continue
            key = (r.namespace, r.cache, r.revision)
            if self._verified.get(key) != r.sealed:
                problem = disk.verify(self.c(r.namespace, r.cache), r.revision)
                if problem is not None:
                    log.warning(
                        f"{r.namespace}/{r.cache} {r.revision} does not match its manifest: {problem}; not labelled"
                    )
                    continue
                self._verified[key] = r.sealed
            ok.append(r)
        # In use first, then the most recently released: the copies Jobs will want next.
        ok.sort(key=lambda r: (bool(r.leases), r.released_at), reverse=True)
        return ok[: self.s.max_labels]

    def _publish(self, revs: list[disk.OnDisk]) -> None:
        warm = self._warm(revs)
        with self._publishing:
            self._publish_locked(revs, warm)

    def _publish_locked(self, revs: list[disk.OnDisk], warm: list[disk.OnDisk]) -> None:
        # A copy taken off before ``revs`` was read is not in it: forget it (its id may come again).
        on_disk = {(r.namespace, r.cache, r.revision, r.sealed) for r in revs}
        self._doomed &= on_disk
        warm = [r for r in warm if (r.namespace, r.cache, r.revision, r.sealed) not in self._doomed]
        labels = {warm_label(r.namespace, r.cache, r.revision): "true" for r in warm}
        labels.update(self._staging_labels(revs))
        size, free = disk.filesystem(self.s.cache_root)
        current = self._room(revs)
        # Free space moves with every write: published in steps of 1% of the filesystem,
        # so that a copy in progress does not patch the Node at every pass.
        step = max(1, size // 100)
        inventory = Inventory(
            node=self.s.node,
            budget=current.budget,
            held=current.held,
            free=free // step * step,
            evicted_bytes=self.evicted_bytes,
            revisions=[
                HeldRevision(
                    "",  # no tenant's names on the Node: the digest, as in the labels
                    "",
                    r.revision,
                    r.bytes,
                    r.complete,
                    len(r.leases),
                    round(r.released_at, 3),
                    warm_label(r.namespace, r.cache, r.revision) in labels,
                    cache_digest(r.namespace, r.cache),
                )
                for r in sorted(revs, key=lambda r: r.released_at, reverse=True)
            ],
        )
        self.metrics.observe(self.s.node, current, revs, self.evicted_bytes)
        text = inventory.to_json()
        with self._state:
            if self._published == (labels, text):
                return
        self._patch_node(labels, text)
        with self._state:
            self._published = (labels, text)

    def _adopt_staging(self, node: dict[str, Any]) -> None:
        """After a restart: keep the staging labels of copies still in progress, with their start
        (a new start would move the node out of its cohort and reshuffle who reads what)."""
        by_digest = {cache_digest(ns, cache): (ns, cache) for ns, cache in disk.caches(self.s.cache_root)}
        for key, value in ((node.get("metadata") or {}).get("labels") or {}).items():
            parsed = parse_staging_label(key)
            if parsed is None or parsed[0] not in by_digest:
                continue
            ns, cache = by_digest[parsed[0]]
            c = self.c(ns, cache)
            if _locked(c) and not os.path.exists(contract.complete_path(c, parsed[1])):
                self._staging.setdefault((ns, cache, parsed[1]), _float(value))

    def _staging_labels(self, revs: list[disk.OnDisk]) -> dict[str, str]:
        """Staging labels of the copies still in progress (a stager holds the lock, not complete yet)."""
        if not self._adopted and self.kube is not None:
            try:
                self._adopt_staging(self.kube.get(f"/api/v1/nodes/{self.s.node}") or {})
                self._adopted = True
            except ApiError as e:
                log.warning(f"could not read this node's staging labels: {e}")
        complete = {(r.namespace, r.cache, r.revision) for r in revs if r.complete}
        with self._state:
            staging = dict(self._staging)
        gone = {key for key in staging if key in complete or not _locked(self.c(key[0], key[1]))}
        with self._state:
            for key in gone:
                if self._staging.get(key) == staging[key]:
                    del self._staging[key]
            return {staging_label(*key): f"{since:.3f}" for key, since in self._staging.items()}

    def _patch_node(self, labels: dict[str, str], inventory: str) -> None:
        if self.kube is None:
            return
        node = self.kube.get(f"/api/v1/nodes/{self.s.node}") or {}
        have = {
            k: v
            for k, v in ((node.get("metadata") or {}).get("labels") or {}).items()
            if k.startswith((WARM_LABEL_PREFIX, STAGING_LABEL_PREFIX))
        }
        patch: dict[str, Any] = {k: None for k in have.keys() - labels.keys()}
        patch.update({k: v for k, v in labels.items() if have.get(k) != v})
        # The agent's label names its port, so the controller finds it at the node's IP.
        patch[contract.AGENT_LABEL] = str(self.s.port)
        self.kube.merge_patch(
            f"/api/v1/nodes/{self.s.node}",
            {"metadata": {"labels": patch, "annotations": {INVENTORY_ANNOTATION: inventory}}},
        )

    def _unlabel(self, namespace: str, cache: str, revision: str | None) -> None:
        """Take the warm label(s) off the Node before a copy goes (raises if it cannot)."""
        with self._publishing:
            # A pass that read the disk before this copy goes must not label it again.
            c = self.c(namespace, cache)
            revs = [revision] if revision is not None else [r.revision for r in disk.scan_cache(c, namespace, cache)]
            for rev in revs:
                self._doomed.add((namespace, cache, rev, disk.read_revision(c, namespace, cache, rev).sealed))
            self._unlabel_locked(namespace, cache, revision)

    def _unlabel_locked(self, namespace: str, cache: str, revision: str | None) -> None:
        if self.kube is None:
            return
        if revision is not None:
            keys = {warm_label(namespace, cache, revision)}
        else:
            prefix = f"{WARM_LABEL_PREFIX}{cache_digest(namespace, cache)}."
            node = self.kube.get(f"/api/v1/nodes/{self.s.node}") or {}
            keys = {k for k in (node.get("metadata") or {}).get("labels") or {} if k.startswith(prefix)}
        if keys:
            self.kube.merge_patch(f"/api/v1/nodes/{self.s.node}", {"metadata": {"labels": dict.fromkeys(keys)}})
        with self._state:
            self._published = None  # publish afresh next time

    # --- leases -----------------------------------------------------------------------------

    def _release_finished(self, revs: list[disk.OnDisk]) -> bool:
        """Delete the leases of pods that finished (or are gone) on this node, but never one
        a published volume holds (contract.csi: the mount is the lease).

        A finished pod reads nothing, so its lease only kept the copy from the
        budget's eviction; whether the copy stays for its Job is the controller's
        call (owner-aware wipes). A lease of a pod never seen is released only
        when the view is complete and the lease is older than the grace period.
        """
        if not self.pods.synced:
            return False
        released = False
        now = time.time()
        for r in revs:
            gone = []
            c = self.c(r.namespace, r.cache)
            for uid in r.leases:
                finished = self.pods.finished.get(uid)
                if finished is False:
                    continue
                if lease_mount(contract.lease_path(c, r.revision, uid)) is not None:
                    continue  # a published CSI volume holds it: only NodeUnpublishVolume releases it
                if finished is None:
                    try:
                        age = now - os.lstat(contract.lease_path(c, r.revision, uid)).st_mtime
                    except (OSError, ValueError):
                        continue
                    if age < self.s.unknown_lease_grace:
                        continue
                gone.append(uid)
            if gone and self._release(c, r.revision, gone):
                released = True
        return released

    def _release(self, c: str, rev: str, uids: list[str]) -> bool:
        try:
            with cache_lock(c, blocking=False):
                for uid in uids:
                    try:
                        os.unlink(contract.lease_path(c, rev, uid))
                    except (FileNotFoundError, ValueError, IsADirectoryError):
                        pass
            return True
        except BlockingIOError:
            return False  # a stager is at work here: next pass

    # --- the budget -------------------------------------------------------------------------

    def _reserved_bytes(self) -> int:
        with self._state:
            return sum(b for b, _ in self._reserved.values())

    def _forget_reservations(self, revs: list[disk.OnDisk]) -> None:
        complete = {(r.namespace, r.cache, r.revision) for r in revs if r.complete}
        now = time.time()
        with self._state:
            # A pre-staged copy that is gone (evicted by a Job's need, wiped) is forgotten; one still
            # reserved may not have its directory yet.
            present = {r.key for r in revs} | set(self._reserved)
            if not self._prestaged <= present:
                self._prestaged &= present
                reservations.save_prestaged(self.s.cache_root, self._prestaged)
            gone = [
                key
                for key, (_, at) in self._reserved.items()
                if key in complete or now - at > RESERVATION_TTL or not _locked(self.c(key[0], key[1]))
            ]
            for key in gone:
                del self._reserved[key]
            if gone:
                reservations.save(self.s.cache_root, self._reserved)

    def _room(self, revs: list[disk.OnDisk], promised: bool = True) -> budget.Room:
        """``promised``: count reservations against the filesystem too. A copy in progress has
        written part of its reservation already, so that counts some bytes twice: right when
        answering a reservation (err on the safe side), wrong when deciding to evict."""
        size, free = disk.filesystem(self.s.cache_root)
        # Trees on their way out (the remover) free their blocks soon: counted as free already.
        free += self.remover.pending()
        reserved = self._reserved_bytes()
        return budget.room(
            self.s.budget.of(size), free, self.s.headroom.of(size), revs, reserved, reserved if promised else 0
        )

    def _enforce_budget(self, revs: list[disk.OnDisk], events: list[_Event]) -> bool:
        """Over budget (it was lowered), or the disk is past its headroom: evict unleased copies."""
        current = self._room(revs, promised=False)
        if min(current.budget - current.held, current.fs_room) >= 0:
            return False
        candidates = budget.evictable(revs)
        chosen = budget.victims(0, current, candidates) or candidates
        return bool(self._evict(chosen, "the node was over its dscache budget or its disk headroom", events))

    def reserve(self, req: ReserveRequest) -> ReserveAnswer:
        """Room for a copy in progress (its blocks: ``req.bytes`` and, when known, ``req.objects``),
        evicting LRU unleased copies if needed. A copy resumed after an interruption has part of
        itself on the disk already: the filesystem must give only the rest."""
        c = self.c(req.namespace, req.cache)
        if not _locked(c):
            # Only a stager at work holds the lock: without it, this is no copy in progress.
            return ReserveAnswer(False, 0, 0, 0, message=f"no stager holds the lock of {c}: nothing to reserve for")
        key = (req.namespace, req.cache, req.revision)
        need = disk.footprint(req.bytes, req.objects or 0, disk.block_size(self.s.cache_root))
        # Measured off the lock (a partial copy may hold many files); only its own stager writes there.
        on_disk = (
            0
            if os.path.exists(contract.complete_path(c, req.revision))
            else disk.usage(contract.revision_dir(c, req.revision))
        )
        need_fs = max(0, need - on_disk)
        events: list[_Event] = []
        try:
            with self.lock:
                revs = disk.scan(self.s.cache_root)
                with self._state:
                    self._reserved.pop(key, None)
                # A copy completed since the last pass counts as held now: its reservation must not
                # count besides (a CSI volume's lease goes at unpublish, before any pass runs).
                self._forget_reservations(revs)
                current = self._room(revs)
                evicted: list[str] = []
                if not budget.fits(need, current, need_fs):
                    candidates = budget.evictable(revs, keep=frozenset({(req.namespace, req.cache)}))
                    if req.prestage:
                        # A pre-stage is no work to make room for: it takes only what no other
                        # pre-staged copy (and no copy in use: evictable() has none) holds.
                        with self._state:
                            candidates = [r for r in candidates if r.key not in self._prestaged]
                    chosen = budget.victims(need, current, candidates, need_fs)
                    if chosen:
                        # The Event in the evicted copy's namespace names no other tenant's cache.
                        log.info(f"making room for {req.namespace}/{req.cache} {req.revision}")
                        evicted = self._evict(chosen, "making room for another copy on this node", events)
                        revs = disk.scan(self.s.cache_root)
                        current = self._room(revs)
                if not budget.fits(need, current, need_fs):
                    self.metrics.refused.inc()
                    return self._refusal(req, need, need_fs, current, revs, evicted)
                with self._state:
                    self._reserved[key] = (need, time.time())
                    reservations.save(self.s.cache_root, self._reserved)
                    if req.prestage and key not in self._prestaged:
                        self._prestaged.add(key)
                        reservations.save_prestaged(self.s.cache_root, self._prestaged)
                    self._published = None
                return ReserveAnswer(True, current.budget, current.held, current.available, evicted)
        finally:
            self._post_events(events)

    def _refusal(
        self,
        req: ReserveRequest,
        need: int,
        need_fs: int,
        current: budget.Room,
        revs: list[disk.OnDisk],
        evicted: list[str],
    ) -> ReserveAnswer:
        held_by_leases = sum(r.held for r in revs if r.complete and r.leases)
        resumed = f" ({need - need_fs} of them on the disk already)" if need_fs < need else ""
        if req.prestage:
            with self._state:
                others = [
                    r
                    for r in revs
                    if r.complete and r.key in self._prestaged and r.key[:2] != (req.namespace, req.cache)
                ]
            # No other tenant's names: how many copies and bytes, not whose.
            message = (
                f"not pre-staged on node {self.s.node}: revision {req.revision} of {req.namespace}/{req.cache} "
                f"needs {need} bytes ({human_bytes(need)}){resumed} and the node's dscache budget of "
                f"{human_bytes(current.budget)} can give it {human_bytes(current.available)} without evicting "
                f"another pre-staged copy ({len(others)} of them hold {human_bytes(sum(r.held for r in others))}) "
                f"or one in use ({human_bytes(held_by_leases)}); a pre-stage never evicts those (pre-staged "
                f"caches would take turns on the node forever). Raise nodeAgent.budget, or pre-stage fewer "
                f"caches onto this node (spec.prestage.nodeSelector, spec.prestage.nodes)"
            )
        else:
            message = (
                f"revision {req.revision} of {req.namespace}/{req.cache} needs {need} bytes "
                f"({human_bytes(need)}){resumed} but node {self.s.node} can give at most {current.available} "
                f"bytes ({human_bytes(current.available)}) even after evicting every unused copy: its dscache "
                f"budget is {current.budget} bytes ({human_bytes(current.budget)}), {held_by_leases} of them "
                f"held by copies pods are using. Raise the chart value nodeAgent.budget, free the "
                f"node's cache disk, or narrow the cache with include/exclude"
            )
        return ReserveAnswer(False, current.budget, current.held, current.available, evicted, message=message)

    def _evict(self, chosen: Iterable[disk.OnDisk], why: str, events: list[_Event]) -> list[str]:
        """Evict ``chosen`` (under self.lock): each copy is renamed out of the way here, its tree
        removed by the remover; the Events to post (after the lock) go to ``events``."""
        done = []
        for r in chosen:
            args = WipeArgs(cache_dir=self.c(r.namespace, r.cache), root=self.s.cache_root, revision=r.revision)
            try:
                summary = run_wipe(
                    args,
                    before_remove=functools.partial(self._unlabel, r.namespace, r.cache),
                    remove=functools.partial(self.remover.remove, nbytes=r.held),
                )
            except BusyError:
                continue  # a stager is at work on that cache: its copy may be about to get a lease
            except (ApiError, OSError) as e:
                log.warning(f"could not evict {r.namespace}/{r.cache} {r.revision}: {e}")
                continue
            if not summary.removed:
                continue  # a lease appeared since the scan
            self.evicted_bytes += r.bytes
            self.metrics.evicted.inc(r.bytes)
            done.append(f"{r.namespace}/{r.cache}/{r.revision}")
            message = (
                f"evicted revision {r.revision} ({human_bytes(r.bytes)}) from node {self.s.node}: {why}; it was "
                f"unused since {_iso(r.released_at)} (least recently used first, never a copy in use)"
            )
            log.info(f"{r.namespace}/{r.cache}: {message}")
            events.append(_Event(r.namespace, r.cache, reason="Evicted", message=message))
        return done

    def _post_events(self, events: list[_Event]) -> None:
        for namespace, cache, reason, message in events:
            self._event(namespace, cache, reason=reason, message=message)

    # --- fetch once per cluster -------------------------------------------------------------

    def peers(self, req: PeersRequest) -> PeersAnswer | None:
        """Publish that this node copies ``req.revision`` (a staging label, before answering, so
        a peer that asks next sees it), then answer who else stages or holds it. None: no stager
        here is copying that revision (it must hold the cache's lock, and the revision's data dir
        be there and not complete), so there is no copy in progress to share.

        One staging label per cache at most (one stager holds a cache's lock, and copies one
        revision): asking for another revision moves the label, it never adds one, so no
        sequence of requests grows the Node's labels. Only the in-memory state is locked here,
        never behind an eviction or a verification."""
        c = self.c(req.namespace, req.cache)
        if not _locked(c) or revision_state(c, req.revision, True) is not RevisionState.STAGING:
            return None
        key = (req.namespace, req.cache, req.revision)
        with self._state:
            fresh = key not in self._staging
            dropped = [k for k in self._staging if k[:2] == key[:2] and k != key]
            for k in dropped:
                del self._staging[k]
            if fresh:
                self._staging[key] = time.time()
                self._published = None
            since = self._staging[key]
        if fresh and self.directory is not None:
            self.directory.prepare(*key)  # its views list while the label is written (issue 30)
        if (fresh or dropped) and self.kube is not None:
            labels: dict[str, str | None] = {staging_label(*k): None for k in dropped}
            labels[staging_label(*key)] = f"{since:.3f}"
            node = self.kube.merge_patch(f"/api/v1/nodes/{self.s.node}", {"metadata": {"labels": labels}})
            if self.directory is not None:
                self.directory.learn(node)
        if self.directory is None:
            return PeersAnswer(me="")
        return self.directory.answer(*key, fresh=fresh, since=since)

    # --- the controller's wipes -------------------------------------------------------------

    def wipe(self, req: WipeRequest) -> WipeSummary:
        args = WipeArgs(
            cache_dir=self.c(req.namespace, req.cache),
            root=self.s.cache_root,
            revision=req.revision,
            all_revisions=req.all_revisions,
            legacy=req.legacy,
            release=req.release,
        )
        with self.lock:
            summary = run_wipe(
                args,
                before_remove=lambda rev: self._unlabel(req.namespace, req.cache, rev),
                remove=self.remover.remove,
            )
            with self._state:
                self._published = None
        what = "legacy copy" if req.legacy else req.revision or "whole cache dir"
        log.info(
            f"wipe {req.namespace}/{req.cache} {what} release={','.join(req.release) or '-'}: "
            f"{'removed' if summary.removed else 'kept' if summary.existed else 'absent'}"
            + (f" (leases {','.join(summary.leases)})" if summary.leases else "")
        )
        return summary

    def _event(self, namespace: str, cache: str, reason: str, message: str) -> None:
        if self.kube is None:
            return
        try:
            dsc = self.kube.get(f"/apis/dscache.io/v1alpha1/namespaces/{namespace}/datasetcaches/{cache}")
            if dsc is None:
                return
            now = clock.fmt_time(clock.now())
            self.kube.post(
                f"/api/v1/namespaces/{namespace}/events",
                {
                    "metadata": {"generateName": f"{cache}.", "namespace": namespace},
                    "involvedObject": {
                        "apiVersion": "dscache.io/v1alpha1",
                        "kind": "DatasetCache",
                        "name": cache,
                        "namespace": namespace,
                        "uid": dsc["metadata"]["uid"],
                    },
                    "reason": reason,
                    "message": message[:1000],
                    "type": "Normal",
                    "source": {"component": "dscache-node", "host": self.s.node},
                    "reportingComponent": "dscache.io/node",
                    "reportingInstance": self.s.node,
                    "firstTimestamp": now,
                    "lastTimestamp": now,
                    "count": 1,
                },
            )
        except (ApiError, OSError, KeyError) as e:
            log.warning(f"could not post an Event on {namespace}/{cache}: {e}")


def _locked(c: str) -> bool:
    """Whether some process holds C's flock right now (we take it and let go if we can)."""
    try:
        fd = os.open(contract.lock_path(c), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return time.time()


def _iso(t: float) -> str:
    return clock.fmt_epoch(t) if t else "never"
