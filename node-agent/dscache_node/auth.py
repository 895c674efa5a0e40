"""Who may call this agent: Kubernetes identities, checked by the agent against the API server's
own keys, or by TokenReview (docs/security.md).

No shared key: a node holds nothing that lets it act on another node or for another
namespace.
- A stager shows its pod's projected ServiceAccount token (audience ``PEER_AUDIENCE``).
  The agent verifies it itself (jwks.py: signature against the API server's published keys,
  issuer, audience, expiry) and reads whose it is from its signed claims: the ServiceAccount,
  its namespace, the pod it is bound to. A token of another issuer, or any token while the
  keys cannot be fetched, is asked of the API server instead (TokenReview), which says the
  same. The agent then GETs the pod (a bound token dies with its pod) and serves only a pod of
  the cache's own namespace that names the cache (``dscache.io/cache``, as the webhook and the
  controller's pre-stage pods write it), and for a reservation or the peers question (which
  change this node's disk budget and Node labels) only such a pod on this node.
- The controller shows a token of its own ServiceAccount for the audience
  ``agent_audience(<this node>)``: a token captured by one node's agent opens no other.

Verified tokens are kept (bounded) until shortly before they expire, and a pod's
cache and node (neither changes for a scheduled pod's lifetime: the node never, the
annotation only by the tenant, inside its own namespace) for as long: an object request
of a known stager costs no API call, and a new stager one pod GET (issue 30: no longer a
TokenReview too, N x N per staging). Refusals are kept a few seconds, so a stager retrying
with a bad token is not checked again per request.
"""

from __future__ import annotations

import base64
import hashlib
import json
import threading
import time
import urllib.parse
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from dscache_contract import ANNOTATION_CACHE
from dscache_contract.peers import PEER_AUDIENCE, agent_audience

from .jwks import DEFER, IssuerKeys, LocalVerifier, NeedsFetch
from .kube import Kube

REVIEW_PATH = "/apis/authentication.k8s.io/v1/tokenreviews"
POD_NAME_EXTRA = "authentication.kubernetes.io/pod-name"
POD_UID_EXTRA = "authentication.kubernetes.io/pod-uid"
SA_PREFIX = "system:serviceaccount:"
#: Verified tokens (and pods) kept, at most; the least recently used goes first.
MAX_ENTRIES = 4096
#: A verified token is trusted until this long before its expiry, and never longer than MAX_TRUST_S
#: without asking again (a token of a deleted pod stops working within that).
EXPIRY_MARGIN_S = 30.0
MAX_TRUST_S = 300.0
#: A refused token is refused without asking again for this long.
REFUSED_TTL_S = 10.0
#: Longer is no token the API server issues (a JWT of a projected volume is ~1 kB).
MAX_TOKEN_LEN = 16384

K = TypeVar("K")
V = TypeVar("V")


class NeedsApi(Exception):
    """The answer needs a call to the API server (raised by ``offline`` checks on a cache miss)."""


class _Expiring(Generic[K, V]):
    """A bounded LRU map whose entries expire; thread-safe (the control pool's threads share it)."""

    def __init__(self, size: int, clock: Callable[[], float]) -> None:
        self.size, self.clock = size, clock
        self._d: OrderedDict[K, tuple[float, V]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: K) -> tuple[bool, V | None]:
        with self._lock:
            got = self._d.get(key)
            if got is None:
                return False, None
            if got[0] <= self.clock():
                del self._d[key]
                return False, None
            self._d.move_to_end(key)
            return True, got[1]

    def put(self, key: K, value: V, until: float) -> None:
        with self._lock:
            self._d[key] = (until, value)
            self._d.move_to_end(key)
            while len(self._d) > self.size:
                self._d.popitem(last=False)

    def __len__(self) -> int:
        return len(self._d)


@dataclass(frozen=True)
class Identity:
    """Whose a verified token is: the user, and for a ServiceAccount its namespace and the pod the
    token is bound to (None: not a pod's token)."""

    username: str
    namespace: str | None
    pod: str | None
    pod_uid: str | None


@dataclass(frozen=True)
class Refusal:
    status: int  # 401: no valid token for that audience; 403: valid, but not one that may do this
    message: str


def _expiry(token: str) -> float | None:
    """The ``exp`` of a JWT the API server has just verified (so its payload can be read unverified)."""
    try:
        payload = token.split(".")[1]
        claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
        return float(claims["exp"])
    except (IndexError, ValueError, KeyError, TypeError):
        return None


def _looks_like_jwt(token: str) -> bool:
    return 0 < len(token) <= MAX_TOKEN_LEN and token.count(".") == 2 and token.isascii()


def _from_claims(claims: dict[str, Any]) -> Identity | None:
    """Whose a token is, from its verified claims, as TokenReview names it: the ServiceAccount's
    username and namespace, and the pod it is bound to (``kubernetes.io``, written by the API
    server); None if the claims do not agree with each other."""
    k8s = claims.get("kubernetes.io")
    if not isinstance(k8s, dict):
        return None  # of the API server's issuer, yet no ServiceAccount token
    namespace = k8s.get("namespace")
    sa = k8s.get("serviceaccount")
    sa_name = sa.get("name") if isinstance(sa, dict) else None
    if not isinstance(namespace, str) or not isinstance(sa_name, str):
        return None
    username = f"{SA_PREFIX}{namespace}:{sa_name}"
    if claims.get("sub") != username:
        return None  # the subject and the namespace claim must name the same ServiceAccount
    pod = k8s.get("pod")
    if pod is None:
        return Identity(username, namespace, None, None)  # not bound to a pod (the controller's)
    name = pod.get("name") if isinstance(pod, dict) else None
    uid = pod.get("uid") if isinstance(pod, dict) else None
    if not (isinstance(name, str) and name and isinstance(uid, str) and uid):
        return None
    return Identity(username, namespace, name, uid)


class Reviews:
    """Whose a token is: verified here against the API server's keys when it is of its issuer
    (``local``), else by TokenReview; the verified answers kept (bounded) until shortly before
    the token expires."""

    def __init__(
        self,
        kube: Kube,
        clock: Callable[[], float] = time.time,
        size: int = MAX_ENTRIES,
        local: LocalVerifier | bool | None = True,
    ) -> None:
        """``local``: True: verify with the API server's keys, fetched through ``kube``; False or
        None: TokenReview only."""
        self.kube, self.clock = kube, clock
        self._ok: _Expiring[str, Identity] = _Expiring(size, clock)
        self._refused: _Expiring[str, bool] = _Expiring(size, clock)
        if local is True:
            local = LocalVerifier(IssuerKeys(kube), clock)
        self.local: LocalVerifier | None = local or None
        #: TokenReviews sent (tests and metrics: a cached token costs none, a local check neither).
        self.calls = 0
        self.on_review: Callable[[], None] | None = None
        #: Tokens checked here against the API server's keys (a kept verdict counts none).
        self.local_checks = 0
        self.on_local: Callable[[], None] | None = None

    def review(self, token: str, audience: str, offline: bool = False) -> Identity | None:
        """Whose ``token`` is, for ``audience``; None if the API server does not authenticate it.
        ``offline``: NeedsApi instead of asking. ApiError when the API server cannot answer."""
        if not _looks_like_jwt(token):
            return None
        key = hashlib.sha256(f"{audience}\n{token}".encode()).hexdigest()
        hit, ident = self._ok.get(key)
        if hit:
            return ident
        if self._refused.get(key)[0]:
            return None
        if self.local is not None:
            try:
                claims = self.local.verify(token, audience, offline)
            except NeedsFetch:
                raise NeedsApi from None
            if claims is not DEFER:
                # Final, whichever way: a token of the API server's issuer that fails here is
                # refused, never asked of TokenReview for a second opinion.
                self.local_checks += 1
                if self.on_local is not None:
                    self.on_local()
                if not isinstance(claims, dict):
                    return self._keep(key, None)
                return self._keep(key, _from_claims(claims), float(claims["exp"]))  # exp: checked a number
        if offline:
            raise NeedsApi
        body = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenReview",
            "spec": {"token": token, "audiences": [audience]},
        }
        self.calls += 1
        if self.on_review is not None:
            self.on_review()
        status = (self.kube.post(REVIEW_PATH, body) or {}).get("status") or {}
        if not status.get("authenticated") or audience not in (status.get("audiences") or []):
            return self._keep(key, None)
        user = status.get("user") or {}
        username = str(user.get("username") or "")
        extra = user.get("extra") or {}
        namespace = None
        if username.startswith(SA_PREFIX):
            namespace = username[len(SA_PREFIX) :].split(":")[0] or None
        pod = (extra.get(POD_NAME_EXTRA) or [None])[0]
        uid = (extra.get(POD_UID_EXTRA) or [None])[0]
        return self._keep(key, Identity(username, namespace, pod, uid), _expiry(token))

    def _keep(self, key: str, ident: Identity | None, exp: float | None = None) -> Identity | None:
        """``ident`` (None: refused), kept for the next ask: a refusal REFUSED_TTL_S, a verified
        token until EXPIRY_MARGIN_S before its expiry ``exp`` and never over MAX_TRUST_S."""
        now = self.clock()
        if ident is None:
            self._refused.put(key, True, now + REFUSED_TTL_S)
            return None
        until = now + MAX_TRUST_S if exp is None else min(exp - EXPIRY_MARGIN_S, now + MAX_TRUST_S)
        if until > now:
            self._ok.put(key, ident, until)
        return ident


@dataclass(frozen=True)
class _Pod:
    cache: str | None  # its dscache.io/cache annotation
    node: str | None


class Gate:
    """The agent's decisions: the controller's calls, and a consumer's (the stager's)."""

    def __init__(
        self,
        kube: Kube,
        node: str,
        controller: str,
        clock: Callable[[], float] = time.time,
        reviews: Reviews | None = None,
    ) -> None:
        """``controller``: the username of the controller's ServiceAccount
        (``system:serviceaccount:<namespace>:<name>``)."""
        self.kube, self.node, self.controller_user, self.clock = kube, node, controller, clock
        self.reviews = reviews or Reviews(kube, clock)
        self._pods: _Expiring[str, _Pod] = _Expiring(MAX_ENTRIES, clock)

    def controller(self, token: str, offline: bool = False) -> Refusal | None:
        """None if ``token`` is the controller's, for this node; else why not."""
        ident = self.reviews.review(token, agent_audience(self.node), offline)
        if ident is None:
            return Refusal(401, f"this call needs the controller's token for audience {agent_audience(self.node)}")
        if ident.username != self.controller_user:
            return Refusal(403, f"{ident.username} is not the dscache controller; only it may call this")
        return None

    def consumer(
        self, token: str, namespace: str, cache: str, this_node: bool, offline: bool = False
    ) -> Refusal | None:
        """None if ``token`` is the projected token of a pod of ``namespace`` that names ``cache``
        (and, ``this_node``, runs on this node); else why not."""
        ident = self.reviews.review(token, PEER_AUDIENCE, offline)
        if ident is None:
            return Refusal(401, f"{namespace}/{cache} needs a consumer pod's token for audience {PEER_AUDIENCE}")
        if ident.namespace != namespace or not ident.pod or not ident.pod_uid:
            return Refusal(403, f"{ident.username} is not a pod of namespace {namespace}")
        pod = self._pod(namespace, ident.pod, ident.pod_uid, offline)
        if pod is None:
            # A bound token dies with its pod. The API server's TokenReview learns of the deletion
            # from its own informer, a moment after the pod is gone from a GET: the same answer
            # either way, so the caller cannot tell which of the two noticed first.
            return Refusal(401, f"pod {namespace}/{ident.pod}, the one this token is bound to, no longer exists")
        if pod.cache != cache:
            return Refusal(403, f"pod {namespace}/{ident.pod} is not a consumer of {cache}")
        if this_node and pod.node != self.node:
            return Refusal(403, f"pod {namespace}/{ident.pod} does not run on node {self.node}")
        return None

    def _pod(self, namespace: str, name: str, uid: str, offline: bool) -> _Pod | None:
        hit, pod = self._pods.get(uid)
        if hit:
            return pod
        if offline:
            raise NeedsApi
        path = f"/api/v1/namespaces/{urllib.parse.quote(namespace)}/pods/{urllib.parse.quote(name)}"
        # From the API server's watch cache first (resourceVersion=0): no etcd read, ~40% less API
        # server and etcd CPU per GET (bench/token_checks.py), and these are N x N per staging. The
        # cache lags etcd by milliseconds: a pod deleted that moment ago may still be seen, well
        # inside the MAX_TRUST_S a pod is kept anyway. A pod not (yet) there, or another uid, is
        # asked of etcd before the token is refused: a stager's pod created a moment ago is not
        # refused because the cache has not seen it.
        got = self.kube.get(f"{path}?resourceVersion=0")
        if ((got or {}).get("metadata") or {}).get("uid") != uid:
            got = self.kube.get(path)
        meta = (got or {}).get("metadata") or {}
        if meta.get("uid") != uid:
            return None  # gone, or another pod of that name since: the token's pod no longer exists
        pod = _Pod(
            (meta.get("annotations") or {}).get(ANNOTATION_CACHE), ((got or {}).get("spec") or {}).get("nodeName")
        )
        if pod.node:  # an unscheduled pod's node is still to come: not kept
            self._pods.put(uid, pod, self.clock() + MAX_TRUST_S)
        return pod
