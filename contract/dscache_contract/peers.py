"""Fetch once per cluster: how stagers on several nodes share one revision.

Four parties meet here:
- the stager asks its node's agent who else holds or is staging its revision
  (``PEERS_PATH``, a ``PeersRequest`` -> ``PeersAnswer``), and fetches objects
  from those peers' agents (``object_path``) instead of the bucket;
- the node agent publishes a *staging label* on its Node while a stager copies a
  revision there (value: when it started), serves the complete objects of its
  copies, and answers the peers question from Node labels;
- the stager shows every agent its pod's projected ServiceAccount token (audience
  ``PEER_AUDIENCE``, short-lived, mounted by the webhook into the stager only); an
  agent checks it with a TokenReview and serves only a pod of the cache's namespace
  that names the cache (``dscache.io/cache``), and takes a reservation or a peers
  question only from such a pod on its own node. No node holds a key that opens
  another node or another namespace (docs/security.md);
- the controller's calls (wipes) carry its own ServiceAccount token for the audience
  ``agent_audience(node)``: one node's token is worth nothing on another node;
- agents serve TLS (``PEER_CA_ENV``: the CA the clients trust, ``AGENT_TLS_NAME``:
  the name its certificate is checked against, whatever IP it is reached at).

Who fetches what from the bucket (``owner_ranking``): the stagers that started
within ``COHORT_WINDOW_S`` of the first one are the *cohort*; each object is
ranked over the cohort by rendezvous hashing (highest random weight), then over
the later ones. The first node of an object's ranking fetches it from the bucket;
every other node asks the nodes ranked above itself, in order, and falls back to
the bucket only when its turn comes. So one node per object reads the bucket, and
a dead node costs one more read of each of its objects, not one per node.
Nodes that hold the revision complete are asked first.

Who serves whom (``fetch_chain``, issue 30): the first node of the ranking is the object's
*root*; every other node takes it from its *parent* in a binary tree of the object's own (a
heap over the root and the other nodes in an order of the object's own): log2 N deep, each node
passes an object on to two nodes at most and about as many objects as it receives in all, so
every node that has a copy serves it on, and no early node serves everyone. A node
that is getting an object from a peer says so in its claims (a ``/`` before the path), so its
children wait for it (``?relay=1``); a parent that neither holds nor gets the object is skipped
for its own parent, up to the root.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import time
import urllib.parse
from dataclasses import asdict, dataclass, field
from enum import StrEnum

from .node import cache_digest
from .paths import tmp_dir, validate_revision

#: ``<prefix><cache digest>.<revision>`` on a Node while a stager copies that revision there;
#: the value is the copy's start (epoch seconds), which orders the cohort.
STAGING_LABEL_PREFIX = "staging.dscache.io/"
#: The stager asks its own agent who its peers are (with its pod's token: a consumer pod of the
#: cache on that node; the agent also checks that a stager holds the cache's lock).
PEERS_PATH = "/v1/peers"
#: ``GET /v1/objects/<namespace>/<cache>/<revision>/<path under data/>?wait=<s>`` with the pod's token.
OBJECTS_PATH = "/v1/objects/"
#: ``POST /v1/objects-batch`` with the pod's token and an ``ObjectsBatchRequest``: the small objects
#: that are whole on the node now, many in one answer (issue 30: one HTTP request per 16 KiB object
#: cost the agents ~0.25 ms of CPU each, more than the bytes). The answer (REVISION_HEADER set)
#: is, per path in order, a line ``<status> <length> <state>`` and ``<length>`` bytes: 200 and the
#: object's bytes; 404 and its state (``staging``: ask it alone, held; ``unclaimed``, ``absent``);
#: 413: larger than BATCH_OBJECT_MAX, ask it alone; 400: a path that is refused. Never held.
OBJECTS_BATCH_PATH = "/v1/objects-batch"
#: Paths in one batch, and the largest object a batch carries.
BATCH_MAX_OBJECTS = 64
BATCH_OBJECT_MAX = 64 << 10
#: The longest a peer holds a request for an object it is still fetching (``?wait=``).
MAX_WAIT_S = 20.0
#: Stagers that start this close to the first one split the bucket's objects between them;
#: later ones take from the cohort (the bucket is read once either way).
COHORT_WINDOW_S = 3.0
#: The audience of the stager's projected token (what it shows agents), and its lifetime: the
#: kubelet renews it at 80 % of that, and the stager reads the file again (TOKEN_TTL_S).
PEER_AUDIENCE = "dscache-peer"
PEER_TOKEN_EXPIRY_S = 600
PEER_TOKEN_DIR = "/var/run/dscache-peer"
PEER_TOKEN_KEY = "token"
PEER_TOKEN_FILE = f"{PEER_TOKEN_DIR}/{PEER_TOKEN_KEY}"
#: The stager's projected volume for that token.
PEER_VOLUME_NAME = "dscache-peer-token"
#: The audience prefix of the controller's tokens: one audience per node (``agent_audience``).
AGENT_AUDIENCE_PREFIX = "dscache-agent/"
#: Env var of the stager (and the controller): the PEM of the CA that signed the agents' serving
#: certificate; unset: the agents speak plain HTTP (tests, or TLS turned off in the chart).
PEER_CA_ENV = "DSCACHE_PEER_CA"
#: The name every agent's serving certificate carries (a DNS SAN), checked by every client in place
#: of the node IP it connects to (the chart makes one certificate for all agents: docs/security.md).
AGENT_TLS_NAME = "dscache-node.dscache.internal"


def agent_audience(node: str) -> str:
    """The audience of the controller's tokens for the agent of ``node``."""
    return f"{AGENT_AUDIENCE_PREFIX}{node}"


#: Answer header of an object: the revision it comes from (the receiver checks it).
REVISION_HEADER = "X-Dscache-Revision"
#: ``C/revs/<rev>/tmp/claims``: the paths (one per line) a stager has started to read from the
#: bucket, appended before each GET. A peer asking for one of them waits for it instead of reading
#: the bucket too; the file goes with tmp/ when the revision is sealed.
CLAIMS_NAME = "claims"
#: ``?probe=1``: answer at once unless the object is claimed here (in flight); see owner_ranking.
PROBE_PARAM = "probe"
#: ``&relay=1`` with a probe: a copy this node is taking from a peer counts as claimed too (a
#: ``/<path>`` line in the claims); without it only bucket reads do (the owner's check of its
#: earlier peers, which must not wait on a node that waits on it).
RELAY_PARAM = "relay"
#: The claims line of an object a node is taking from a peer (no path under data/ starts so).
RELAY_MARK = "/"
#: ``&size=<bytes>`` with a probe: the object's listed size, so that the peer may answer with the
#: bytes of its copy in progress (a grow file) as they come, under that Content-Length.
SIZE_PARAM = "size"
#: While its revision is shared, a node writes each object of at least this many bytes it reads
#: (from the bucket or a peer) into ``tmp/<grow_name(path)>`` as the body comes, and its agent
#: serves those bytes to the peers that ask meanwhile, following the file as it grows: each hop
#: of an object's tree costs a few packets, not the whole object (issue 30: a node passed an object
#: on only once whole, and the fan-out's last seconds were 1 MiB objects in store and forward).
#: The receiver checks the whole body against the ETag before it places it, as always; the
#: writer removes its file unless the body is whole and checks, and renames it into place if so.
GROW_MIN = 256 << 10
#: Such files' names start so (the native plane writes a temp file so named as it comes).
GROW_PREFIX = "grow-"
#: A grow file sized before its parts land (a large object's ranged parts, in any order) says in
#: this extended attribute how many bytes from its start are written; set (to 0) before the file
#: is sized, removed once it is whole. Without it, a grow file's size is what is written.
GROWN_XATTR = "user.dscache.grown"
#: How many nodes one node passes each object on to, at most (fetch_chain).
TREE_FANOUT = 2


class RevisionState(StrEnum):
    """A revision on an agent's node, as its 404 answer for an object says (``{"state": ...}``)."""

    COMPLETE = "complete"
    STAGING = "staging"  # a stager holds the cache's lock and the revision is not complete
    UNCLAIMED = "unclaimed"  # staging, but nobody there has started to read that object (a probe's answer)
    ABSENT = "absent"


_STAGING_RE = re.compile(r"^staging\.dscache\.io/([0-9a-f]{12})\.(r-[0-9a-f]{20})$")


def staging_label(namespace: str, cache: str, revision: str) -> str:
    return f"{STAGING_LABEL_PREFIX}{cache_digest(namespace, cache)}.{validate_revision(revision)}"


def parse_staging_label(key: str) -> tuple[str, str] | None:
    m = _STAGING_RE.match(key)
    return (m.group(1), m.group(2)) if m else None


def claims_path(c: str, rev: str) -> str:
    return os.path.join(tmp_dir(c, rev), CLAIMS_NAME)


def grow_name(path: str) -> str:
    """The name under the revision's tmp/ of the file ``path``'s body grows in (GROW_MIN)."""
    return GROW_PREFIX + hashlib.sha256(path.encode()).hexdigest()[:40]


def split_target(target: str, prefix: str) -> tuple[list[str], dict[str, list[str]]]:
    """A request target under ``prefix``: its path's components after it (unquoted) and its query.
    ValueError if the path is not under ``prefix``."""
    u = urllib.parse.urlsplit(target)
    if not u.path.startswith(prefix):
        raise ValueError(f"not a {prefix} path: {u.path}")
    return [urllib.parse.unquote(p) for p in u.path[len(prefix) :].split("/")], urllib.parse.parse_qs(u.query)


def query_wait(query: dict[str, list[str]], most: float) -> float:
    """A request's ``wait`` seconds, within 0..``most`` (NaN would pass min/max: it is 0)."""
    wait = float(query.get("wait", ["0"])[0])
    return 0.0 if math.isnan(wait) else min(max(wait, 0.0), most)


#: A target with nothing to unquote, no "+" (a space in a query) and nothing urlsplit would strip or
#: split off: split by hand (_split_plain), as split_target would split it. Every peer's object
#: request is one (each path component quoted only when it must be); urllib's way cost a tenth
#: of the agent's loop per object served (issue 30).
_PLAIN = re.compile(r"/v1/objects/[A-Za-z0-9._~/!$&'()*,;=:@-]*(\?[A-Za-z0-9._~/!$&'()*,;=:@?-]*)?")


#: Characters urllib.parse.quote leaves alone whatever ``safe`` says (RFC 3986's unreserved ones).
_UNRESERVED = re.compile(r"[A-Za-z0-9._~-]*")


def _quote(text: str, plus: bool = False) -> str:
    """urllib.parse.quote(text, safe="") (``plus``: quote_plus, as urlencode quotes a value)."""
    if _UNRESERVED.fullmatch(text):
        return text
    return urllib.parse.quote_plus(text, safe="") if plus else urllib.parse.quote(text, safe="")


def _split_plain(target: str) -> tuple[list[str], dict[str, list[str]]]:
    """split_target(target, OBJECTS_PATH) of a _PLAIN target."""
    path, _, query = target.partition("?")
    q: dict[str, list[str]] = {}
    for item in query.split("&"):
        name, eq, value = item.partition("=")
        if eq and value:  # parse_qs keeps neither "name" nor "name=" (keep_blank_values=False)
            q.setdefault(name, []).append(value)
    return path[len(OBJECTS_PATH) :].split("/"), q


@dataclass(frozen=True)
class ObjectRequest:
    """``GET /v1/objects/<namespace>/<cache>/<revision>/<path>?wait=<s>[&probe=1[&relay=1][&size=<n>]]``:
    ``wait``: how long a peer still copying the revision holds the request for the object;
    ``probe``: only while the object is claimed there (in flight), else answer at once; ``relay``:
    see RELAY_PARAM; ``size``: the object's listed size, so that a copy still growing there may
    answer as it comes (GROW_MIN)."""

    namespace: str
    cache: str
    revision: str
    path: str
    wait: float = 0.0
    probe: bool = False
    relay: bool = False
    size: int = 0

    def target(self) -> str:
        # What urllib's quote of each component and urlencode of the query make, without them for
        # what has nothing to quote: a stager builds a target each time it asks a peer for an
        # object (1.1 times per object taken from peers in a fan-out of 20,000 small files on 4
        # nodes); 2.2 us each, urllib's way 6.0 (issue 30: of ~75 us of event-loop CPU per object).
        parts = (self.namespace, self.cache, self.revision, *self.path.split("/"))
        quoted = "/".join(_quote(p) for p in parts)
        query = [f"wait={_quote(f'{self.wait:g}', plus=True)}"] if self.wait > 0 else []
        if self.probe:
            query.append(f"{PROBE_PARAM}=1")
            if self.relay:
                query.append(f"{RELAY_PARAM}=1")
            if self.size > 0:
                query.append(f"{SIZE_PARAM}={self.size}")
        return f"{OBJECTS_PATH}{quoted}" + (f"?{'&'.join(query)}" if query else "")

    @classmethod
    def parse(cls, target: str) -> ObjectRequest:
        """ValueError if malformed."""
        parts, q = _split_plain(target) if _PLAIN.fullmatch(target) else split_target(target, OBJECTS_PATH)
        if len(parts) < 4 or not all(parts):
            raise ValueError("an object path is /v1/objects/<namespace>/<cache>/<revision>/<path>")
        wait = query_wait(q, MAX_WAIT_S)
        probe = q.get(PROBE_PARAM) == ["1"]
        return cls(
            parts[0],
            parts[1],
            validate_revision(parts[2]),
            "/".join(parts[3:]),
            wait,
            probe,
            probe and q.get(RELAY_PARAM) == ["1"],
            _size(q) if probe else 0,
        )


def _size(query: dict[str, list[str]]) -> int:
    """A probe's ``size``: 0 when absent; ValueError unless a count of bytes."""
    given = query.get(SIZE_PARAM)
    if not given:
        return 0
    if not re.fullmatch(r"[0-9]{1,18}", given[0]):
        raise ValueError(f"{SIZE_PARAM}={given[0]!r} is not a number of bytes")
    return int(given[0])


@dataclass(frozen=True)
class PeersRequest:
    namespace: str
    cache: str
    revision: str

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> PeersRequest:
        data = json.loads(text)
        return cls(str(data["namespace"]), str(data["cache"]), validate_revision(str(data["revision"])))


@dataclass(frozen=True)
class ObjectsBatchRequest:
    """The body of ``POST OBJECTS_BATCH_PATH``: paths under the revision's data/, asked as a probe
    (``relay``: a copy the node takes from a peer counts as claimed, as RELAY_PARAM)."""

    namespace: str
    cache: str
    revision: str
    paths: tuple[str, ...]
    relay: bool = True

    def to_json(self) -> str:
        return json.dumps(
            {
                "namespace": self.namespace,
                "cache": self.cache,
                "revision": self.revision,
                "paths": list(self.paths),
                "relay": self.relay,
            }
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> ObjectsBatchRequest:
        data = json.loads(text)
        paths = data["paths"]
        if not isinstance(paths, list) or not all(isinstance(p, str) for p in paths):
            raise ValueError("paths: a list of strings")
        if not 0 < len(paths) <= BATCH_MAX_OBJECTS:
            raise ValueError(f"paths: 1 to {BATCH_MAX_OBJECTS}, not {len(paths)}")
        return cls(
            str(data["namespace"]),
            str(data["cache"]),
            validate_revision(str(data["revision"])),
            tuple(paths),
            bool(data.get("relay", True)),
        )


@dataclass(frozen=True)
class Peer:
    """One node's agent, as ``host:port``; ``since``: when its copy started (0: complete)."""

    addr: str
    since: float = 0.0


@dataclass
class PeersAnswer:
    """``me``: the asking node's own address as the others see it. ``staging``: nodes copying the
    revision now (the asking one among them); ``complete``: nodes that hold it whole."""

    me: str
    staging: list[Peer] = field(default_factory=list)
    complete: list[Peer] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> PeersAnswer:
        data = json.loads(text)
        return cls(
            me=str(data["me"]),
            staging=[Peer(str(p["addr"]), float(p.get("since", 0))) for p in data.get("staging") or []],
            complete=[Peer(str(p["addr"]), 0.0) for p in data.get("complete") or []],
        )


def _weight(addr: str, key: str) -> bytes:
    return hashlib.sha256(f"{addr}\n{key}".encode()).digest()


def owner_ranking(key: str, answer: PeersAnswer) -> list[str]:
    """The nodes to take ``key`` from, in order (addresses; ``answer.me`` is where this node's
    own turn to read the bucket comes): complete copies, then the cohort, then later stagers,
    each group by rendezvous hashing. Every node computes the same order from the same answer."""

    def by_weight(addrs: list[str]) -> list[str]:
        return sorted(addrs, key=lambda a: _weight(a, key), reverse=True)

    complete = [p.addr for p in answer.complete if p.addr != answer.me]
    staging = [p for p in answer.staging if p.addr not in complete]
    if not any(p.addr == answer.me for p in staging):
        staging.append(Peer(answer.me, time.time()))
    first = min(p.since for p in staging)
    cohort = [p.addr for p in staging if p.since <= first + COHORT_WINDOW_S]
    later = [p.addr for p in staging if p.since > first + COHORT_WINDOW_S]
    return by_weight(complete) + by_weight(cohort) + by_weight(later)


def fetch_chain(key: str, order: list[str], me: str, fanout: int = TREE_FANOUT) -> list[str]:
    """Where ``me`` takes ``key`` from: its parent in the object's tree, that one's parent, and so
    on up to the root ``order[0]`` ([]: ``me`` is the root, or not in ``order``). ``order``: an
    ``owner_ranking`` (without the nodes this one gave up on). The tree is a ``fanout``-ary heap
    over the root, then every other node in an order of the object's own (rendezvous hashing):
    each node sends each object to ``fanout`` nodes at most, about half the nodes send it to
    none, and which nodes do changes from object to object, so every node serves about as much
    as it receives, and a chain is log(N) long. (The cohort's other members are not put first:
    then they would send every object, the bottleneck issue 30 measured.)"""
    if me not in order or not order:
        return []
    root = order[0]
    tree = [root, *sorted(order[1:], key=lambda a: _weight(a, f"tree\n{key}"), reverse=True)]
    i = tree.index(me)
    chain: list[str] = []
    while i > 0:
        i = (i - 1) // fanout
        chain.append(tree[i])
    return chain
