"""auth.py: who may call an agent, on a fake API server (TokenReview and pod GETs recorded).

The real API server's answers are exercised in tests/integration/test_agent_identity.py."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest

from dscache_contract.peers import PEER_AUDIENCE, agent_audience
from dscache_node.auth import (
    EXPIRY_MARGIN_S,
    MAX_TRUST_S,
    REFUSED_TTL_S,
    Gate,
    NeedsApi,
    Reviews,
)
from dscache_node.jwks import DISCOVERY_PATH, JWKS_MEDIA_TYPE, JWKS_PATH
from dscache_node.kube import ApiError

CONTROLLER = "system:serviceaccount:dscache-system:dscache-controller"
NOW = 1_800_000_000.0


def jwt(name: str, exp: float = NOW + 600) -> str:
    """A token-shaped string (the fake API server knows it by its name; only ``exp`` is read)."""

    def enc(obj: dict[str, Any]) -> str:
        return base64.urlsafe_b64encode(json.dumps(obj).encode()).rstrip(b"=").decode()

    return f"{enc({'alg': 'RS256'})}.{enc({'sub': name, 'exp': exp})}.sig"


def _name(token: str) -> str:
    body = token.split(".")[1]
    return str(json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))["sub"])


class FakeReviews:
    """TokenReview and pod GETs: ``tokens``: name -> (namespace, pod, pod uid) of a pod-bound token
    for PEER_AUDIENCE (or a username str: a ServiceAccount's token for ``audiences[name]``);
    ``pods``: uid -> (its dscache.io/cache, its node), and ``cached`` the watch cache's if it lags
    (None: the same). The issuer's discovery document and keys:
    ``keys`` (``{"issuer": ..., "jwks": ...}``; None: not served, 404, as before local checks;
    an ApiError: raised), their GETs in ``key_gets``."""

    def __init__(
        self,
        tokens: dict[str, tuple[str, str, str] | str],
        pods: dict[str, tuple[str | None, str]],
        audiences: dict[str, str] | None = None,
    ) -> None:
        self.tokens, self.pods, self.audiences = tokens, pods, audiences or {}
        self.reviews: list[str] = []
        self.gets: list[str] = []
        self.keys: dict[str, Any] | Exception | None = None
        self.cached: dict[str, tuple[str | None, str]] | None = None
        self.key_gets: list[str] = []

    @classmethod
    def gate(cls, node: str, tokens: dict[str, Any], pods: dict[str, Any], clock: Any = None) -> Gate:
        kube = cls(
            {**tokens, "controller": CONTROLLER, "controller-elsewhere": CONTROLLER},
            pods,
            {"controller": agent_audience(node), "controller-elsewhere": agent_audience("elsewhere")},
        )
        return Gate(kube, node, CONTROLLER, **({"clock": clock} if clock else {}))  # type: ignore[arg-type]

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        token, (audience,) = body["spec"]["token"], body["spec"]["audiences"]
        name = _name(token)
        self.reviews.append(name)
        who = self.tokens.get(name)
        if who is None or self.audiences.get(name, PEER_AUDIENCE) != audience:
            return {"status": {"authenticated": False, "error": "invalid"}}
        if isinstance(who, str):
            user: dict[str, Any] = {"username": who}
        else:
            ns, pod, uid = who
            user = {
                "username": f"system:serviceaccount:{ns}:default",
                "extra": {
                    "authentication.kubernetes.io/pod-name": [pod],
                    "authentication.kubernetes.io/pod-uid": [uid],
                },
            }
        return {"status": {"authenticated": True, "audiences": [audience], "user": user}}

    def get(self, path: str, accept: str = "application/json") -> dict[str, Any] | None:
        if path in (DISCOVERY_PATH, JWKS_PATH):
            self.key_gets.append(path)
            # As the API server: the key set in its own media type only (406 for application/json).
            if (path == JWKS_PATH) != (accept == JWKS_MEDIA_TYPE):
                raise ApiError(406, f"Not Acceptable: {accept}")
            if isinstance(self.keys, Exception):
                raise self.keys
            if self.keys is None:
                return None
            return {"issuer": self.keys["issuer"]} if path == DISCOVERY_PATH else self.keys["jwks"]
        self.gets.append(path)
        path, _, query = path.partition("?")
        name = path.rsplit("/", 1)[1]
        # resourceVersion=0: the API server's watch cache, ``cached`` when a test sets it apart.
        pods = self.cached if query == "resourceVersion=0" and self.cached is not None else self.pods
        for uid, (cache, node) in pods.items():
            who = next((w for w in self.tokens.values() if not isinstance(w, str) and w[2] == uid), None)
            if who is not None and who[1] == name:
                ann = {"dscache.io/cache": cache} if cache else {}
                return {"metadata": {"name": name, "uid": uid, "annotations": ann}, "spec": {"nodeName": node}}
        return None


class Clock:
    def __init__(self) -> None:
        self.t = NOW

    def __call__(self) -> float:
        return self.t


TOKENS = {
    "stager": ("ml", "s", "u1"),
    "elsewhere": ("ml", "e", "u2"),
    "bystander": ("ml", "b", "u3"),
    "tenant-b": ("team-b", "s", "u4"),
    "gone": ("ml", "g", "u5"),
}
PODS = {"u1": ("data", "n1"), "u2": ("data", "n2"), "u3": (None, "n1"), "u4": ("data", "n1")}


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def gate(clock: Clock) -> Gate:
    return FakeReviews.gate("n1", TOKENS, PODS, clock)


def test_consumers_of_the_cache_only(gate: Gate):
    assert gate.consumer(jwt("stager"), "ml", "data", this_node=True) is None
    assert gate.consumer(jwt("elsewhere"), "ml", "data", this_node=False) is None  # a peer's stager
    for token, ns, cache, here, status in (
        (jwt("elsewhere"), "ml", "data", True, 403),  # a reservation needs a pod on this node
        (jwt("bystander"), "ml", "data", False, 403),  # names no cache
        (jwt("stager"), "ml", "other", False, 403),  # another cache's
        (jwt("tenant-b"), "ml", "data", False, 403),  # another namespace's pod
        (jwt("gone"), "ml", "data", False, 401),  # its pod is not there (another uid, or none): the token is dead
        (jwt("nobody"), "ml", "data", False, 401),  # the API server does not vouch for it
        (jwt("controller"), "ml", "data", False, 401),  # the controller's audience is not the peers'
        ("not-a-jwt", "ml", "data", False, 401),
        ("", "ml", "data", False, 401),
    ):
        refused = gate.consumer(token, ns, cache, this_node=here)
        assert refused is not None and refused.status == status, (_name(token) if "." in token else token, refused)


def test_the_controller_for_this_node_only(gate: Gate):
    assert gate.controller(jwt("controller")) is None
    assert gate.controller(jwt("controller-elsewhere")).status == 401  # type: ignore[union-attr]
    assert gate.controller(jwt("stager")).status == 401  # type: ignore[union-attr]
    kube: FakeReviews = gate.kube  # type: ignore[assignment]
    kube.tokens["tenant-agent"] = "system:serviceaccount:ml:default"
    kube.audiences["tenant-agent"] = agent_audience("n1")
    assert gate.controller(jwt("tenant-agent")).status == 403  # type: ignore[union-attr]


def test_a_verified_token_is_kept_until_shortly_before_it_expires(gate: Gate, clock: Clock):
    kube: FakeReviews = gate.kube  # type: ignore[assignment]
    token = jwt("stager", exp=NOW + 120)
    for _ in range(3):
        assert gate.consumer(token, "ml", "data", this_node=True, offline=len(kube.reviews) > 0) is None
    assert (len(kube.reviews), len(kube.gets)) == (1, 1)
    clock.t = NOW + 120 - EXPIRY_MARGIN_S  # the margin before exp: asked again
    with pytest.raises(NeedsApi):
        gate.consumer(token, "ml", "data", this_node=True, offline=True)
    assert gate.consumer(token, "ml", "data", this_node=True) is None
    assert len(kube.reviews) == 2


def test_never_kept_longer_than_max_trust(gate: Gate, clock: Clock):
    kube: FakeReviews = gate.kube  # type: ignore[assignment]
    token = jwt("stager", exp=NOW + 10 * MAX_TRUST_S)
    assert gate.consumer(token, "ml", "data", this_node=True) is None
    clock.t = NOW + MAX_TRUST_S + 1
    assert gate.consumer(token, "ml", "data", this_node=True) is None
    assert len(kube.reviews) == 2


def test_a_refused_token_is_refused_without_asking_for_a_while(gate: Gate, clock: Clock):
    kube: FakeReviews = gate.kube  # type: ignore[assignment]
    for _ in range(5):
        assert gate.consumer(jwt("nobody"), "ml", "data", this_node=False, offline=bool(kube.reviews)) is not None
    assert len(kube.reviews) == 1
    clock.t = NOW + REFUSED_TTL_S + 1
    with pytest.raises(NeedsApi):
        gate.consumer(jwt("nobody"), "ml", "data", this_node=False, offline=True)


def test_the_cache_of_verified_tokens_is_bounded(clock: Clock):
    kube = FakeReviews({f"t{i}": ("ml", "s", "u1") for i in range(50)}, PODS)
    reviews = Reviews(kube, clock, size=10)  # type: ignore[arg-type]
    for i in range(50):
        assert reviews.review(jwt(f"t{i}"), PEER_AUDIENCE) is not None
    assert len(reviews._ok) == 10
    assert reviews.review(jwt("t49"), PEER_AUDIENCE, offline=True) is not None  # the latest are kept
    with pytest.raises(NeedsApi):
        reviews.review(jwt("t0"), PEER_AUDIENCE, offline=True)


def test_recreated_cache_gets_its_token(clock: Clock):
    """Issue 28 #9: a cache deleted and created again under its name lost its peer token for up
    to 6 h (the HMAC token's Secret went with the old cache's owner reference). There is no such
    token any more: a pod of the new cache shows its own projected token and is served at once,
    with nothing written for it first; the old cache's pod, gone, is not."""
    tokens = {"old-stager": ("ml", "s-old", "u-old"), "new-stager": ("ml", "s-new", "u-new")}
    gate = FakeReviews.gate("n1", tokens, {"u-old": ("data", "n1")}, clock)
    assert gate.consumer(jwt("old-stager"), "ml", "data", this_node=True) is None
    # The cache is deleted with its pods, and created again; its first new pod asks at once.
    kube: FakeReviews = gate.kube  # type: ignore[assignment]
    kube.pods = {"u-new": ("data", "n1")}
    assert gate.consumer(jwt("new-stager"), "ml", "data", this_node=True) is None
    clock.t += MAX_TRUST_S + 1  # what was verified of the old pod's token is asked again
    refused = gate.consumer(jwt("old-stager"), "ml", "data", this_node=True)
    assert refused is not None and refused.status == 401, refused
