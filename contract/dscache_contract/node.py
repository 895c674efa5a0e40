"""The node agent's side of the contract: what it publishes and what it answers.

Three parties meet here, so the names live in one place:
- the node agent (``dscache-node``, one per node) publishes its inventory on
  its Node: one *warm label* per complete, verified revision it holds, and one
  annotation with the inventory itself (JSON, bounded);
- the webhook reads which nodes are warm (its own index of Node labels) and
  adds node affinity on the warm label's key; the controller counts them in status;
- the stager asks its node's agent for room before it copies (a reservation),
  and the controller asks it to release leases and remove revisions (a wipe).

A warm label's key names the cache and the revision: two caches over the same
prefix share a revision id, but not a directory on the node, so a pod of one
must not be drawn to a node that holds only the other.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from .paths import validate_revision

#: The prefix of every warm label on a Node (``<prefix><cache digest>.<revision>``).
WARM_LABEL_PREFIX = "warm.dscache.io/"
#: The Node annotation with the agent's inventory (``Inventory`` as JSON).
INVENTORY_ANNOTATION = "dscache.io/inventory"
#: Label on Nodes where an agent runs (set by the agent itself at start; its value is the port).
AGENT_LABEL = "dscache.io/agent"
#: The agent's port (host network: the stager reaches it at its node's IP).
AGENT_PORT = 9477
#: Env var of the stager container: its node's IP (downward API status.hostIP).
ENV_NODE_IP = "DSCACHE_NODE_IP"
#: The agent's HTTP API.
RESERVE_PATH = "/v1/reserve"
WIPE_PATH = "/v1/wipe"
#: The header carrying the controller's token on wipe requests.
TOKEN_HEADER = "Authorization"

_WARM_RE = re.compile(r"^warm\.dscache\.io/([0-9a-f]{12})\.(r-[0-9a-f]{20})$")


def cache_digest(namespace: str, cache: str) -> str:
    """12 hex digits naming one DatasetCache in a label key (keys are at most 63 characters)."""
    return hashlib.sha256(f"{namespace}/{cache}".encode()).hexdigest()[:12]


def warm_label(namespace: str, cache: str, revision: str) -> str:
    """The Node label key saying: this node holds ``revision`` of ``namespace/cache``, complete."""
    return f"{WARM_LABEL_PREFIX}{cache_digest(namespace, cache)}.{validate_revision(revision)}"


def parse_warm_label(key: str) -> tuple[str, str] | None:
    """(cache digest, revision) of a warm label key; None for any other key."""
    m = _WARM_RE.match(key)
    return (m.group(1), m.group(2)) if m else None


@dataclass
class HeldRevision:
    """One revision on the node, as the agent read it from disk.

    Anyone who may read Nodes reads this, so it names no cache: ``namespace`` and ``cache`` are
    empty and ``digest`` is the cache's ``cache_digest`` (as in the warm labels); who holds a
    cache's name finds its copies with ``of``."""

    namespace: str
    cache: str
    revision: str
    bytes: int
    complete: bool
    leases: int
    #: epoch seconds of the last lease change (or of sealing, if never leased): the LRU clock
    released_at: float
    labelled: bool = False
    digest: str = ""

    def of(self, namespace: str, cache: str) -> bool:
        return self.digest == cache_digest(namespace, cache) or (self.namespace, self.cache) == (namespace, cache)


@dataclass
class Inventory:
    """What the agent publishes in INVENTORY_ANNOTATION (bounded: see ``to_json``)."""

    node: str
    budget: int
    held: int
    free: int
    revisions: list[HeldRevision] = field(default_factory=list)
    evicted_bytes: int = 0
    truncated: bool = False

    def to_json(self, limit: int = 100) -> str:
        body = asdict(self)
        if len(self.revisions) > limit:
            body["revisions"], body["truncated"] = body["revisions"][:limit], True
        return json.dumps(body, separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Inventory:
        data: dict[str, Any] = json.loads(text)
        revs = [HeldRevision(**r) for r in data.pop("revisions", [])]
        return cls(revisions=revs, **data)


@dataclass(frozen=True)
class ReserveRequest:
    """The stager asks for ``bytes`` more under the node's budget before copying ``revision``."""

    namespace: str
    cache: str
    revision: str
    bytes: int
    #: The revision's objects, when the stager knows them: the agent then counts the blocks they
    #: take (small files take far more than their bytes), not their bytes alone.
    objects: int | None = None
    #: True: a pre-stage pod's copy (spec.prestage). The agent evicts no other pre-staged copy and
    #: no copy in use to make room for it: it refuses instead, and the pod's failure says why in the
    #: cache's status (two pre-staged caches over one budget would otherwise evict each other forever).
    prestage: bool | None = None

    def to_json(self) -> str:
        return json.dumps({k: v for k, v in asdict(self).items() if v is not None})

    @classmethod
    def from_json(cls, text: str) -> ReserveRequest:
        data = json.loads(text)
        objects = data.get("objects")
        req = cls(
            str(data["namespace"]),
            str(data["cache"]),
            validate_revision(str(data["revision"])),
            int(data["bytes"]),
            None if objects is None else int(objects),
            True if data.get("prestage") is True else None,
        )
        if req.bytes < 0 or (req.objects or 0) < 0:
            raise ValueError("bytes and objects must not be negative")
        return req


@dataclass
class ReserveAnswer:
    """``ok``: the copy fits (after ``evicted`` copies went). Else ``message`` names both numbers."""

    ok: bool
    budget: int
    held: int
    available: int
    evicted: list[str] = field(default_factory=list)
    message: str = ""

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> ReserveAnswer:
        return cls(**json.loads(text))


@dataclass(frozen=True)
class WipeRequest:
    """The controller's wipe of one cache on one node (the agent runs ``dscache-stage wipe``'s logic).

    Exactly one of ``revision``, ``all_revisions`` or ``legacy``, as for WipeArgs."""

    namespace: str
    cache: str
    revision: str | None = None
    all_revisions: bool = False
    legacy: bool = False
    release: tuple[str, ...] = ()

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> WipeRequest:
        data = json.loads(text)
        return cls(
            namespace=str(data["namespace"]),
            cache=str(data["cache"]),
            revision=data.get("revision"),
            all_revisions=bool(data.get("all_revisions")),
            legacy=bool(data.get("legacy")),
            release=tuple(str(u) for u in data.get("release") or ()),
        )
