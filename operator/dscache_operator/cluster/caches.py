"""The controller's view of one DatasetCache: what reconciliation reads, and nothing else.

At 10,000 caches what we keep per cache is the controller's memory. A watched
object in full (managedFields, every status field as nested dicts) is about
25 KiB of Python objects; kopf kept one per cache, plus a timer task, a cause,
a logger and a stopper. We keep:

- the spec, parsed once and shared between caches whose specs are equal
  (a fleet of caches over one bucket differs only in names);
- the status as its compact JSON text (about a tenth of the dicts it parses
  to), parsed only while the cache is being reconciled;
- the handful of metadata fields the controller acts on.
"""

from __future__ import annotations

import functools
import json
import sys
import time
from typing import Any, NamedTuple

from pydantic import ValidationError

from dscache_contract import RevisionRef

from ..api.models import FINALIZER, GROUP, KIND, REFRESH_ANNOTATION, VERSION, DatasetCacheSpec

Key = tuple[str, str]  # (namespace, name)


class CacheView(NamedTuple):
    namespace: str
    name: str
    uid: str
    generation: int | None
    deleting: bool
    finalizers: tuple[str, ...]
    #: The value of dscache.io/refresh, if set.
    refresh: str | None
    #: None: the spec does not validate (the CRD's schema makes that rare: a hand-edited older CRD).
    spec: DatasetCacheSpec | None
    status_json: str
    #: time.monotonic() when the controller got this version of the object: a source
    #: listing begun after it is fresh enough for a check this version asks for.
    observed: float
    #: metadata.resourceVersion: whether the view shows a status write of ours yet.
    resource_version: str = ""

    @property
    def key(self) -> Key:
        return (self.namespace, self.name)

    @property
    def finalized(self) -> bool:
        """Whether our finalizer is on it (its deletion waits for our wipes)."""
        return FINALIZER in self.finalizers

    def status(self) -> dict[str, Any]:
        """A fresh dict of the status (the caller may change it)."""
        data: dict[str, Any] = json.loads(self.status_json)
        return data

    def involved(self) -> dict[str, str]:
        """The Event's involvedObject."""
        return {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": KIND,
            "namespace": self.namespace,
            "name": self.name,
            "uid": self.uid,
        }


@functools.lru_cache(maxsize=1024)
def _spec(text: str) -> DatasetCacheSpec | None:
    """One parsed spec per distinct spec text: equal specs share one (read-only) model."""
    try:
        return DatasetCacheSpec.model_validate_json(text)
    except ValidationError:
        return None


def cache_view(body: dict[str, Any]) -> CacheView:
    meta = body.get("metadata") or {}
    return CacheView(
        namespace=sys.intern(meta.get("namespace", "")),
        name=meta.get("name", ""),
        uid=meta.get("uid", ""),
        generation=meta.get("generation"),
        deleting=bool(meta.get("deletionTimestamp")),
        finalizers=tuple(sys.intern(f) for f in meta.get("finalizers") or ()),
        refresh=(meta.get("annotations") or {}).get(REFRESH_ANNOTATION),
        spec=_spec(json.dumps(body.get("spec") or {}, sort_keys=True, separators=(",", ":"))),
        status_json=json.dumps(body.get("status") or {}, separators=(",", ":")),
        observed=time.monotonic(),
        resource_version=meta.get("resourceVersion", ""),
    )


def cache_extract(body: dict[str, Any]) -> tuple[Key, CacheView]:
    view = cache_view(body)
    return view.key, view


def wants_reconcile(old: CacheView | None, new: CacheView | None) -> bool:
    """Whether an event is news to act on now: not our own writes (status, our finalizer)
    coming back, which would only run the cache again on a view that may not show the
    status it just wrote yet (and list its bucket a second time)."""
    if old is None or new is None:
        return True
    return (old.generation, old.deleting, old.refresh, old.spec) != (
        new.generation,
        new.deleting,
        new.refresh,
        new.spec,
    )


# --- revisions as the status records them (the webhook pins new pods to them) ---


def _ref(rev: Any, as_of: Any) -> RevisionRef | None:
    # Status is written by this operator alone; one it cannot read (edited by
    # hand) counts as no revision rather than stopping the webhook's index.
    try:
        return RevisionRef(rev, as_of) if rev else None
    except ValueError:
        return None


def revision_ref(fragment: dict[str, Any] | None) -> RevisionRef | None:
    """The revision in a status.revision fragment (None: none, or unreadable)."""
    return _ref(fragment.get("id"), fragment.get("asOf")) if fragment else None


def owner_pin_ref(pin: dict[str, Any]) -> RevisionRef | None:
    """The revision in one status.owners item (None: none, or unreadable)."""
    return _ref(pin.get("revision"), pin.get("asOf"))
