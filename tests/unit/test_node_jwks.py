"""jwks.py and auth.py together: the agent verifies a ServiceAccount token itself (issue 30).

Tokens here are really signed (PyJWT with keys made for the test), the API server is the fake of
test_node_auth (its discovery document, its key set, TokenReview and pod GETs, all recorded), so
every test also says which API calls a check cost. The real API server's tokens and keys:
tests/integration/test_agent_identity.py."""

from __future__ import annotations

import base64
import hmac
import json
import logging
from typing import Any

import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from dscache_contract.peers import PEER_AUDIENCE, agent_audience
from dscache_node.auth import MAX_TRUST_S, Gate, NeedsApi, Reviews
from dscache_node.jwks import KEYS_MAX_AGE_S, REFETCH_MIN_S, RETRY_S, SKEW_S, IssuerKeys, LocalVerifier
from dscache_node.kube import ApiError
from dscache_node.settings import AgentSettings
from tests.unit.test_node_auth import CONTROLLER, NOW, Clock, FakeReviews

ISSUER = "https://kubernetes.default.svc"
PODS = {"u1": ("data", "n1"), "u2": ("data", "n2"), "u3": ("other", "n1")}


class Issuer:
    """The API server's signing side: keys by kid, and tokens as it mints them."""

    def __init__(self) -> None:
        self.keys: dict[str, Any] = {}
        self.add("k1", rsa.generate_private_key(public_exponent=65537, key_size=2048))

    def add(self, kid: str, key: Any) -> None:
        self.keys[kid] = key

    def jwks(self) -> dict[str, Any]:
        out = []
        for kid, key in self.keys.items():
            if isinstance(key, rsa.RSAPrivateKey):
                jwk = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(key.public_key()))
                jwk["alg"] = "RS256"
            else:
                jwk = json.loads(jwt.algorithms.ECAlgorithm.to_jwk(key.public_key()))
                jwk["alg"] = "ES256"
            out.append({**jwk, "kid": kid, "use": "sig"})
        return {"keys": out}

    def token(
        self,
        ns: str = "ml",
        pod: tuple[str, str] | None = ("s", "u1"),
        aud: str = PEER_AUDIENCE,
        iss: str = ISSUER,
        kid: str = "k1",
        alg: str | None = None,
        sa: str = "default",
        key: Any = None,
        **times: float,
    ) -> str:
        claims: dict[str, Any] = {
            "iss": iss,
            "aud": [aud],
            "sub": f"system:serviceaccount:{ns}:{sa}",
            "iat": int(NOW - 10),
            "nbf": int(NOW - 10),
            "exp": int(NOW + 600),
            "kubernetes.io": {"namespace": ns, "serviceaccount": {"name": sa, "uid": "sa-uid"}},
        }
        if pod is not None:
            claims["kubernetes.io"]["pod"] = {"name": pod[0], "uid": pod[1]}
        claims.update({k: int(v) for k, v in times.items()})
        signing = key if key is not None else self.keys[kid]
        algorithm = alg or ("RS256" if isinstance(signing, rsa.RSAPrivateKey) else "ES256")
        return jwt.encode(claims, signing, algorithm=algorithm, headers={"kid": kid})


@pytest.fixture
def issuer() -> Issuer:
    return Issuer()


@pytest.fixture
def clock() -> Clock:
    return Clock()


def make_gate(issuer: Issuer, clock: Clock, tokens: dict[str, Any] | None = None) -> tuple[Gate, FakeReviews]:
    kube = FakeReviews(
        {**(tokens or {}), "controller": CONTROLLER},
        PODS,
        {"controller": agent_audience("n1")},
    )
    # The fake's pod GET finds a pod by the tokens it knows (name, uid): the signed tokens' pods.
    kube.tokens.update({"#s": ("ml", "s", "u1"), "#e": ("ml", "e", "u2"), "#o": ("ml", "o", "u3")})
    kube.keys = {"issuer": ISSUER, "jwks": issuer.jwks()}
    local = LocalVerifier(IssuerKeys(kube, monotonic=clock), clock)  # type: ignore[arg-type]
    reviews = Reviews(kube, clock, local=local)  # type: ignore[arg-type]
    return Gate(kube, "n1", CONTROLLER, clock, reviews), kube  # type: ignore[arg-type]


@pytest.fixture
def gk(issuer: Issuer, clock: Clock) -> tuple[Gate, FakeReviews]:
    return make_gate(issuer, clock)


def status(gate: Gate, token: str, here: bool = False, cache: str = "data") -> int:
    refused = gate.consumer(token, "ml", cache, this_node=here)
    return 200 if refused is None else refused.status


def test_a_stager_token_is_verified_here_with_one_pod_get(gk, issuer: Issuer):
    gate, kube = gk
    token = issuer.token()
    for _ in range(3):
        assert status(gate, token, here=True) == 200
    assert kube.reviews == []  # no TokenReview at all
    assert kube.gets == ["/api/v1/namespaces/ml/pods/s?resourceVersion=0"]  # the pod, once, from the cache
    assert kube.key_gets == ["/.well-known/openid-configuration", "/openid/v1/jwks"]  # the keys, once
    assert gate.reviews.local_checks == 1 and gate.reviews.calls == 0
    assert status(gate, issuer.token(pod=("e", "u2"))) == 200  # a peer's stager, another node
    assert kube.key_gets == ["/.well-known/openid-configuration", "/openid/v1/jwks"]


def test_what_is_refused_and_never_asked_of_token_review(gk, issuer: Issuer):
    gate, kube = gk
    public_pem = (
        issuer.keys["k1"]
        .public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    good = issuer.token()
    head, body, sig = good.split(".")
    claims = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
    claims["kubernetes.io"]["namespace"] = "team-b"  # the same signature over other claims
    tampered = base64.urlsafe_b64encode(json.dumps(claims).encode()).rstrip(b"=").decode()
    claims["kubernetes.io"]["namespace"] = "ml"
    mismatched = {**claims, "sub": "system:serviceaccount:team-b:default"}

    def signed(header: dict[str, Any], payload: dict[str, Any], sign: Any) -> str:
        enc = lambda o: base64.urlsafe_b64encode(json.dumps(o).encode()).rstrip(b"=").decode()  # noqa: E731
        signing_input = f"{enc(header)}.{enc(payload)}"
        return f"{signing_input}.{base64.urlsafe_b64encode(sign(signing_input.encode())).rstrip(b'=').decode()}"

    cases = {
        "wrong audience": issuer.token(aud=agent_audience("n1")),
        "expired": issuer.token(exp=NOW - 1, iat=NOW - 700, nbf=NOW - 700),
        "not yet valid": issuer.token(nbf=NOW + SKEW_S + 5),
        "issued in the future": issuer.token(iat=NOW + SKEW_S + 5),
        "tampered payload": f"{head}.{tampered}.{sig}",
        "alg none": signed({"alg": "none", "kid": "k1"}, claims, lambda _: b""),
        # The key-confusion attack: HMAC keyed with the issuer's public key.
        "HS256": signed({"alg": "HS256", "kid": "k1"}, claims, lambda m: hmac.new(public_pem, m, "sha256").digest()),
        "signed by another key": issuer.token(key=rsa.generate_private_key(public_exponent=65537, key_size=2048)),
        "the subject and the namespace disagree": jwt.encode(
            mismatched, issuer.keys["k1"], "RS256", headers={"kid": "k1"}
        ),
        "no kid": jwt.encode(claims, issuer.keys["k1"], "RS256"),
        "garbage": "a.b.c",
    }
    for what, token in cases.items():
        assert status(gate, token) == 401, what
    assert kube.reviews == [] and kube.gets == []
    assert status(gate, issuer.token(nbf=NOW + SKEW_S - 5, iat=NOW + SKEW_S - 5)) == 200  # within the skew


def test_an_unknown_key_fetches_the_keys_again_at_most_so_often(issuer: Issuer, clock: Clock):
    # TokenReview authenticates the ServiceAccount's real tokens (as the API server does: it knows
    # every key it signs with), not those of another one ("mallory": the forgeries below).
    gate, kube = make_gate(issuer, clock, {"system:serviceaccount:ml:default": ("ml", "s", "u1")})
    assert status(gate, issuer.token()) == 200
    assert len(kube.key_gets) == 2
    issuer.add("k2", ec.generate_private_key(ec.SECP256R1()))  # the API server rotates (to ES256)
    kube.keys = {"issuer": ISSUER, "jwks": issuer.jwks()}
    # Within REFETCH_MIN_S of the last fetch: not fetched again, but not refused either: the key
    # may be newer than that fetch, so TokenReview judges it.
    assert status(gate, issuer.token(kid="k2")) == 200
    assert len(kube.key_gets) == 2 and kube.reviews == ["system:serviceaccount:ml:default"]
    clock.t += REFETCH_MIN_S + 1
    assert status(gate, issuer.token(kid="k2", iat=NOW + 1)) == 200  # fetched again, found: checked here
    assert len(kube.key_gets) == 4 and len(kube.reviews) == 1
    mallory = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    forged = issuer.token(kid="k9", key=mallory, sa="mallory")
    clock.t += REFETCH_MIN_S + 1
    assert status(gate, forged) == 401  # fetched again, still unknown: refused here
    assert len(kube.key_gets) == 6 and len(kube.reviews) == 1
    forged2 = issuer.token(kid="k8", key=mallory, sa="mallory")
    assert status(gate, forged2) == 401  # within REFETCH_MIN_S: TokenReview refuses it
    assert len(kube.key_gets) == 6  # not fetched again within REFETCH_MIN_S
    assert kube.reviews == ["system:serviceaccount:ml:default", "system:serviceaccount:ml:mallory"]


def test_the_pod_check_stays(gk, issuer: Issuer):
    gate, kube = gk
    assert status(gate, issuer.token(pod=("gone", "u9"))) == 401  # its pod is gone: a bound token dies with it
    assert status(gate, issuer.token(pod=("s", "u-old"))) == 401  # a pod of that name, another uid
    assert status(gate, issuer.token(pod=("o", "u3"))) == 403  # a pod of another cache
    assert status(gate, issuer.token(pod=("e", "u2")), here=True) == 403  # not on this node
    assert status(gate, issuer.token(ns="team-b", pod=("s", "u1"))) == 403  # another namespace's
    assert status(gate, issuer.token(pod=None)) == 403  # not bound to a pod
    assert kube.reviews == []


def test_the_controller(gk, issuer: Issuer):
    gate, kube = gk
    ns, sa = CONTROLLER.split(":")[2:]
    assert gate.controller(issuer.token(ns=ns, sa=sa, pod=None, aud=agent_audience("n1"))) is None
    other_node = gate.controller(issuer.token(ns=ns, sa=sa, pod=None, aud=agent_audience("n2")))
    assert other_node is not None and other_node.status == 401
    tenant = gate.controller(issuer.token(pod=None, aud=agent_audience("n1")))
    assert tenant is not None and tenant.status == 403
    # Checked without any API call once the keys are held: no thread, no NeedsApi.
    assert gate.controller(issuer.token(ns=ns, sa=sa, pod=None, aud=agent_audience("n1"), iat=NOW), True) is None
    assert kube.reviews == [] and kube.gets == []


def test_offline_needs_the_api_only_for_keys_and_pods(gk, issuer: Issuer):
    gate, kube = gk
    with pytest.raises(NeedsApi):
        gate.consumer(issuer.token(), "ml", "data", this_node=False, offline=True)  # no keys yet
    assert kube.key_gets == []
    assert status(gate, issuer.token()) == 200
    assert gate.consumer(issuer.token(iat=NOW - 5), "ml", "data", this_node=False, offline=True) is None  # pod kept
    with pytest.raises(NeedsApi):
        gate.consumer(issuer.token(pod=("e", "u2")), "ml", "data", this_node=False, offline=True)  # pod unknown


def test_another_issuer_is_asked_of_token_review(gk, issuer: Issuer, caplog):
    gate, kube = gk
    kube.tokens["system:serviceaccount:ml:default"] = ("ml", "s", "u1")  # the fake reviews by `sub`
    other = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    with caplog.at_level(logging.INFO, logger="dscache-node"):
        assert status(gate, issuer.token(iss="https://oidc.example", key=other)) == 200
        assert status(gate, issuer.token(iss="https://oidc.example", key=other, iat=NOW - 3)) == 200
    assert kube.reviews == ["system:serviceaccount:ml:default"] * 2
    assert sum("https://oidc.example" in r.message for r in caplog.records) == 1  # said once
    assert gate.reviews.calls == 2 and gate.reviews.local_checks == 0


@pytest.mark.parametrize(
    "failure, why",
    [
        (ApiError(403, "forbidden"), "403: the agent's ClusterRole lacks get"),
        (None, "not found"),
        (ConnectionRefusedError("refused"), "refused"),
    ],
)
def test_without_the_keys_token_review_and_said_once(issuer: Issuer, clock: Clock, caplog, failure, why):
    gate, kube = make_gate(issuer, clock, {"system:serviceaccount:ml:default": ("ml", "s", "u1")})
    kube.keys = failure
    token = issuer.token()
    with caplog.at_level(logging.INFO, logger="dscache-node"):
        assert status(gate, token) == 200
        assert status(gate, issuer.token(iat=NOW - 1)) == 200
        clock.t += RETRY_S + 1  # tried again: still failing, not said again
        assert status(gate, issuer.token(iat=NOW - 2)) == 200
    said = [r.message for r in caplog.records if "TokenReview" in r.message]
    assert len(said) == 1 and why in said[0], said
    assert len(kube.reviews) == 3 and gate.reviews.local_checks == 0
    assert len(kube.key_gets) == 2  # once, then once after RETRY_S
    # The keys become available (RBAC fixed): local from the next try on.
    kube.keys = {"issuer": ISSUER, "jwks": issuer.jwks()}
    clock.t += RETRY_S + 1
    assert status(gate, issuer.token(iat=NOW - 3)) == 200
    assert len(kube.reviews) == 3 and gate.reviews.local_checks == 1
    # Never open on a failed local check: a bad token of the issuer is refused, not reviewed.
    assert status(gate, issuer.token(aud="someone-else")) == 401
    assert len(kube.reviews) == 3


def test_the_keys_are_fetched_again_and_a_failed_refresh_drops_them(gk, issuer: Issuer, clock: Clock):
    gate, kube = gk
    kube.tokens["system:serviceaccount:ml:default"] = ("ml", "s", "u1")
    assert status(gate, issuer.token()) == 200
    # The API server stops trusting k1 (its key file replaced): dropped at the next refresh.
    old = issuer.keys.pop("k1")
    issuer.add("k2", rsa.generate_private_key(public_exponent=65537, key_size=2048))
    kube.keys = {"issuer": ISSUER, "jwks": issuer.jwks()}
    clock.t += KEYS_MAX_AGE_S + 1
    assert len(kube.key_gets) == 2
    assert status(gate, issuer.token(kid="k2", iat=NOW + 1)) == 200
    assert len(kube.key_gets) == 4
    # The old key's new token: not in the set just fetched, so not fetched again before REFETCH_MIN_S:
    # TokenReview's, which refuses it (the fake knows no ServiceAccount "retired").
    assert status(gate, issuer.token(kid="k1", key=old, iat=NOW + 1, sa="retired")) == 401
    assert kube.reviews == ["system:serviceaccount:ml:retired"]
    clock.t += REFETCH_MIN_S + 1
    assert status(gate, issuer.token(kid="k1", key=old, iat=NOW + 2, sa="retired")) == 401  # refused here
    assert len(kube.key_gets) == 6 and len(kube.reviews) == 1
    # A refresh that fails: not the stale keys, TokenReview (which asks the API server).
    kube.keys = ApiError(503, "unavailable")
    clock.t += KEYS_MAX_AGE_S + 1
    assert status(gate, issuer.token(kid="k2", iat=NOW + 2)) == 200
    assert kube.reviews == ["system:serviceaccount:ml:retired", "system:serviceaccount:ml:default"]


def test_a_verdict_is_kept_no_longer_than_before(gk, issuer: Issuer, clock: Clock):
    gate, _ = gk
    token = issuer.token()
    assert status(gate, token) == 200 and gate.reviews.local_checks == 1
    assert status(gate, token) == 200 and gate.reviews.local_checks == 1  # kept
    clock.t += MAX_TRUST_S + 1
    assert status(gate, token) == 200 and gate.reviews.local_checks == 2


def test_turned_off_every_token_goes_to_token_review(issuer: Issuer, clock: Clock):
    env = {"DSCACHE_NODE_NAME": "n1", "DSCACHE_CACHE_ROOT": "/x"}
    assert AgentSettings.from_env(env).local_token_check
    settings = AgentSettings.from_env({**env, "DSCACHE_LOCAL_TOKEN_CHECK": "false"})
    assert not settings.local_token_check
    kube = FakeReviews({"system:serviceaccount:ml:default": ("ml", "s", "u1")}, PODS)
    kube.keys = {"issuer": ISSUER, "jwks": issuer.jwks()}
    gate = Gate(kube, "n1", CONTROLLER, clock, Reviews(kube, clock, local=settings.local_token_check))  # type: ignore[arg-type]
    assert status(gate, issuer.token()) == 200
    assert kube.reviews == ["system:serviceaccount:ml:default"] and kube.key_gets == []


def test_the_pod_is_read_from_the_watch_cache_and_etcd_on_a_miss(gk, issuer: Issuer):
    """The pod GET is N x N per staging: from the API server's watch cache (no etcd read), and
    only when the pod is not there (or has another uid) from etcd, so a pod created a moment
    ago is not refused for the cache's lag."""
    gate, kube = gk
    kube.cached = {}  # the cache has not seen the stager's pod yet
    assert status(gate, issuer.token()) == 200
    assert kube.gets == ["/api/v1/namespaces/ml/pods/s?resourceVersion=0", "/api/v1/namespaces/ml/pods/s"]
    assert status(gate, issuer.token(pod=("gone", "u9"))) == 401  # in neither: gone
    assert kube.gets[2:] == ["/api/v1/namespaces/ml/pods/gone?resourceVersion=0", "/api/v1/namespaces/ml/pods/gone"]
    kube.cached = dict(PODS)  # caught up
    assert status(gate, issuer.token(pod=("e", "u2"))) == 200
    assert kube.gets[4:] == ["/api/v1/namespaces/ml/pods/e?resourceVersion=0"]


def test_only_rs256_and_es256_keys_of_the_set_are_used(gk, issuer: Issuer, clock: Clock):
    """A symmetric or malformed entry in the key set is skipped: a token naming it is refused."""
    gate, kube = gk
    secret = b"s" * 32
    jwks = issuer.jwks()
    jwks["keys"] += [
        {"kty": "oct", "k": base64.urlsafe_b64encode(secret).rstrip(b"=").decode(), "kid": "hs", "alg": "HS256"},
        {"kty": "RSA", "kid": "broken", "n": "!!", "e": "AQAB"},
        {"kty": "EC", "crv": "P-384", "kid": "p384", "x": "AA", "y": "AA"},
    ]
    kube.keys = {"issuer": ISSUER, "jwks": jwks}
    claims = jwt.decode(issuer.token(), options={"verify_signature": False})
    assert status(gate, jwt.encode(claims, secret, "HS256", headers={"kid": "hs"})) == 401
    assert status(gate, issuer.token()) == 200  # the good key still is
    assert kube.reviews == []
