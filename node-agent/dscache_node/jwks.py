"""A ServiceAccount token verified by the agent itself, against the API server's own keys (issue 30).

Why: a TokenReview per (agent, stager) was N x N API calls per staging (1,008 at N = 32; 65,536
at 256 nodes), each a stager's first request to that agent waiting on a busy API server. The API
server publishes the public keys its ServiceAccount tokens are signed with
(``/openid/v1/jwks``) and its issuer (``/.well-known/openid-configuration``); with them the
agent checks what TokenReview checked of the token: signature, issuer, audience, expiry, and reads
the same identity (ServiceAccount, namespace, bound pod) from the signed claims. What TokenReview
also checked and this does not: that the bound pod still exists (Gate GETs the pod, as before),
and that the ServiceAccount still exists (docs/security.md says what that leaves open).

The signature and the JWT rules are PyJWT's on ``cryptography``: no crypto here.

Only tokens of the API server's own issuer are checked here, and for those the answer is final:
a token that fails is refused, never handed to TokenReview for a second opinion. Tokens of another
issuer (an external OIDC issuer the API server trusts, a second ``--service-account-issuer``
during a migration, legacy Secret tokens) and every token while the keys cannot be fetched
(RBAC without the discovery URLs: 403; no discovery: 404; unreachable) go to TokenReview; the
agent says once in its log why. So does a token naming a key id the agent has not seen while the keys
were fetched less than REFETCH_MIN_S ago (a rotation just made: TokenReview knows the new key).
"""

from __future__ import annotations

import http.client
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import jwt

from .kube import ApiError, Kube

log = logging.getLogger("dscache-node")

DISCOVERY_PATH = "/.well-known/openid-configuration"
JWKS_PATH = "/openid/v1/jwks"
#: The only representation the API server serves the key set in (application/json: 406).
JWKS_MEDIA_TYPE = "application/jwk-set+json"
#: What the API server signs ServiceAccount tokens with (its key is RSA or P-256 ECDSA); anything
#: else (none, HS256, ...) is refused.
ALGORITHMS: Final = ("RS256", "ES256")
#: Clock skew allowed between the API server and this node, for ``nbf`` and ``iat``.
SKEW_S = 30.0
#: The keys are fetched again this often: a key the API server stopped trusting is dropped within
#: this (docs/security.md adds the verdict cache's MAX_TRUST_S to get the whole bound).
KEYS_MAX_AGE_S = 120.0
#: A token naming a key id not in the set fetches it again (the API server rotated its key), at
#: most this often: a caller inventing key ids costs one GET per this, not one per request.
REFETCH_MIN_S = 10.0
#: After the keys could not be fetched, TokenReview is used for this long before trying again.
RETRY_S = 60.0
#: Issuers named in the log as "checked by TokenReview", at most (a caller could invent many).
MAX_LOGGED_ISSUERS = 16


class Defer:
    """Not this module's to decide: ask TokenReview (another issuer, or no keys)."""


DEFER: Final = Defer()


class NeedsFetch(Exception):
    """The keys must be fetched first (raised to an ``offline`` caller)."""


@dataclass
class _KeySet:
    issuer: str
    keys: dict[str, jwt.PyJWK]
    fetched: float  # monotonic


class IssuerKeys:
    """The API server's issuer and signing keys, fetched with the agent's own credentials and
    kept; thread-safe (the check pool's threads share it)."""

    def __init__(self, kube: Kube, monotonic: Callable[[], float] = time.monotonic) -> None:
        self.kube, self.monotonic = kube, monotonic
        self._set: _KeySet | None = None
        #: After a failed fetch: TokenReview until then.
        self._retry_at = float("-inf")
        self._last_fetch = float("-inf")
        self._lock = threading.Lock()
        self._said: str | None = None
        self._issuers_logged: set[str] = set()

    def current(self, offline: bool) -> _KeySet | None:
        """The keys to verify with; None: use TokenReview (they cannot be had now)."""
        now = self.monotonic()
        s = self._set
        if s is not None and now - s.fetched < KEYS_MAX_AGE_S:
            return s
        if now < self._retry_at:
            return None
        if offline:
            raise NeedsFetch
        return self._fetch(stale=s)

    def key(self, keys: _KeySet, kid: str, offline: bool) -> jwt.PyJWK | Defer | None:
        """The key ``kid`` names; fetched again once if unknown (a rotation), at most every
        REFETCH_MIN_S; None: not in the set fetched afresh, so not the API server's (refused).
        An unknown kid that cannot be fetched yet is TokenReview's to judge (DEFER): the key may be
        newer than the last fetch, and its tokens were refused here for up to REFETCH_MIN_S (and
        that refusal kept for auth.REFUSED_TTL_S) right after a rotation. A caller inventing key
        ids then costs TokenReviews, as a token of another issuer does, within its share of the
        check pool."""
        got = keys.keys.get(kid)
        if got is not None:
            return got
        if self.monotonic() - self._last_fetch < REFETCH_MIN_S:
            return DEFER
        if offline:
            raise NeedsFetch
        fresh = self._fetch(stale=keys)
        return None if fresh is None else fresh.keys.get(kid)

    def _fetch(self, stale: _KeySet | None) -> _KeySet | None:
        with self._lock:
            now = self.monotonic()
            if self._set is not stale:  # another thread fetched meanwhile
                return self._set
            if now < self._retry_at:
                return None  # another thread failed to, a moment ago
            self._last_fetch = now
            try:
                got = self._get_set(now)
            except (ApiError, OSError, http.client.HTTPException, ValueError, jwt.PyJWTError) as e:
                # Not kept on failure, even if a set is held: past KEYS_MAX_AGE_S it may hold a key
                # the API server no longer trusts, and TokenReview (which asks the API server) is
                # the safe answer meanwhile.
                self._set = None
                self._retry_at = now + RETRY_S
                self._say(
                    f"checking tokens by TokenReview: the API server's ServiceAccount keys could not be fetched "
                    f"({_why(e)}); trying again every {RETRY_S:.0f} s"
                )
                return None
            self._set, self._retry_at = got, float("-inf")
            self._say(
                f"verifying ServiceAccount tokens of issuer {got.issuer} locally "
                f"({len(got.keys)} key(s) from {JWKS_PATH}); other issuers by TokenReview"
            )
            return got

    def _get_set(self, now: float) -> _KeySet:
        discovery = self.kube.get(DISCOVERY_PATH)
        if discovery is None:
            raise ValueError(f"{DISCOVERY_PATH} not found: the API server's issuer discovery is off")
        issuer = discovery.get("issuer")
        if not isinstance(issuer, str) or not issuer:
            raise ValueError(f"{DISCOVERY_PATH} names no issuer")
        jwks = self.kube.get(JWKS_PATH, accept=JWKS_MEDIA_TYPE)
        if jwks is None:
            raise ValueError(f"{JWKS_PATH} not found")
        keys: dict[str, jwt.PyJWK] = {}
        for entry in jwks.get("keys") or []:
            if not isinstance(entry, dict) or entry.get("use", "sig") != "sig" or not entry.get("kid"):
                continue
            try:
                k = jwt.PyJWK(entry)
            except (jwt.PyJWTError, ValueError, TypeError, KeyError):
                continue  # a key type or curve we do not verify with (or malformed): its tokens are refused
            if k.algorithm_name in ALGORITHMS:
                keys[str(entry["kid"])] = k
        if not keys:
            raise ValueError(f"{JWKS_PATH} holds no RS256 or ES256 key")
        return _KeySet(issuer, keys, now)

    def _say(self, line: str) -> None:
        """Logged when what the agent does changes, not at every retry."""
        if line != self._said:
            self._said = line
            log.info(line)

    def deferred_issuer(self, issuer: str, ours: str) -> None:
        if issuer not in self._issuers_logged and len(self._issuers_logged) < MAX_LOGGED_ISSUERS:
            self._issuers_logged.add(issuer)
            log.info(f"tokens of issuer {issuer!r} are checked by TokenReview: the agent verifies only {ours!r}'s")


def _why(e: Exception) -> str:
    if isinstance(e, ApiError) and e.status == 403:
        return (
            f"403: the agent's ClusterRole lacks get on the nonResourceURLs {DISCOVERY_PATH} and {JWKS_PATH} "
            "(the chart grants them)"
        )
    return str(e)[:300]


class LocalVerifier:
    """Checks a token of the API server's issuer, as TokenReview would, without asking it."""

    def __init__(self, keys: IssuerKeys, clock: Callable[[], float] = time.time) -> None:
        self.keys, self.clock = keys, clock

    def verify(self, token: str, audience: str, offline: bool) -> dict[str, Any] | Defer | None:
        """The verified token's claims (signature, issuer, audience, times); None: refused; DEFER:
        ask TokenReview. Whose it is, read from the claims, is auth.py's.
        NeedsFetch when ``offline`` and the keys must be fetched."""
        try:
            unverified = jwt.decode_complete(token, options={"verify_signature": False})
        except jwt.PyJWTError:
            return None  # not a JWT: no issuer would vouch for it
        header, payload = unverified["header"], unverified["payload"]
        keys = self.keys.current(offline)
        if keys is None:
            return DEFER
        iss = payload.get("iss")
        if iss != keys.issuer:
            self.keys.deferred_issuer(str(iss), keys.issuer)
            return DEFER
        alg, kid = header.get("alg"), header.get("kid")
        if alg not in ALGORITHMS or not isinstance(kid, str):
            return None
        key = self.keys.key(keys, kid, offline)
        if isinstance(key, Defer):
            return DEFER
        if key is None or key.algorithm_name != alg:
            return None
        try:
            claims: dict[str, Any] = jwt.decode(
                token,
                key,
                algorithms=[alg],
                audience=audience,
                issuer=keys.issuer,
                # Times are checked below against our clock (injectable: the tests move it).
                options={
                    "require": ["exp", "iat", "iss", "aud", "sub"],
                    "verify_exp": False,
                    "verify_nbf": False,
                    "verify_iat": False,
                },
            )
        except jwt.PyJWTError:
            return None
        return claims if _times_hold(claims, self.clock()) else None


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _times_hold(claims: dict[str, Any], now: float) -> bool:
    """``exp`` is ahead (no skew: an expired token is expired), ``iat`` and ``nbf`` not ahead by
    more than SKEW_S (a token just minted by an API server whose clock runs a little ahead)."""
    exp, iat = _number(claims.get("exp")), _number(claims.get("iat"))
    if exp is None or iat is None or now >= exp or iat > now + SKEW_S:
        return False
    if "nbf" in claims:
        nbf = _number(claims["nbf"])
        if nbf is None or nbf > now + SKEW_S:
            return False
    return True
