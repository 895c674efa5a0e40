"""Pod identity for the source check: S3 credentials of a cache's ServiceAccount.

A DatasetCache with ``spec.source.serviceAccountName`` is listed as that
ServiceAccount, the way Flux's object-level workload identity does it: the
controller asks the API server for a short-lived token of the ServiceAccount
(TokenRequest, audience ``sts.amazonaws.com`` unless the admin sets another),
and exchanges it at STS (AssumeRoleWithWebIdentity) for the role the
ServiceAccount's IRSA annotation names. The credentials are kept until a few
minutes before they expire, so a fleet of caches over one ServiceAccount
costs one exchange per hour, not one per check.

The token only ever goes to the STS endpoint the admin configured (or AWS's
own): never to an endpoint named in a cache's spec, which a tenant writes and
could point at a server of their own to collect tokens for replay.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import time
from typing import Any

from ..api.models import ROLE_ARN_ANNOTATION
from ..kube.client import ApiError, Kube

DEFAULT_AUDIENCE = "sts.amazonaws.com"
#: The shortest lifetime the API server grants a TokenRequest: it is spent within seconds.
TOKEN_SECONDS = 600
#: Credentials are renewed this long before STS says they expire.
RENEW_BEFORE = 300.0
#: At most this many ServiceAccounts' credentials are kept.
MOST = 1024


class IdentityError(Exception):
    """The ServiceAccount could not be turned into credentials: ``reason`` and the fix."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason, self.message = reason, message


@dataclasses.dataclass(frozen=True)
class Credentials:
    access_key_id: str
    secret_access_key: str
    session_token: str
    #: time.time() at which STS says they expire.
    expires: float


def role_arn(service_account: dict[str, Any]) -> str | None:
    """The IAM role a ServiceAccount's tokens are exchanged for (IRSA's annotation)."""
    value = ((service_account.get("metadata") or {}).get("annotations") or {}).get(ROLE_ARN_ANNOTATION)
    return (value.strip() or None) if isinstance(value, str) else None


def token_request(audience: str, seconds: int = TOKEN_SECONDS) -> dict[str, Any]:
    return {
        "apiVersion": "authentication.k8s.io/v1",
        "kind": "TokenRequest",
        "spec": {"audiences": [audience], "expirationSeconds": seconds},
    }


def session_name(namespace: str, name: str) -> str:
    """RoleSessionName: 2-64 of [\\w+=,.@-]; names the cache's ServiceAccount in CloudTrail."""
    return f"dscache-{namespace}.{name}"[:64]


def assume_role_sync(
    endpoint: str | None, region: str, role: str, token: str, session: str, timeout: float
) -> Credentials:
    """AssumeRoleWithWebIdentity (unsigned: the token is the proof). Raises botocore's errors."""
    import boto3
    from botocore import UNSIGNED
    from botocore.config import Config

    cfg = Config(
        signature_version=UNSIGNED,
        connect_timeout=min(timeout, 5),
        read_timeout=timeout,
        retries={"max_attempts": 2, "mode": "standard"},
    )
    # endpoint None: boto3's own choice (AWS_ENDPOINT_URL_STS in our environment, else AWS's regional STS).
    sts = boto3.session.Session().client("sts", endpoint_url=endpoint, region_name=region, config=cfg)
    got = sts.assume_role_with_web_identity(RoleArn=role, RoleSessionName=session, WebIdentityToken=token)
    c = got["Credentials"]
    return Credentials(c["AccessKeyId"], c["SecretAccessKey"], c["SessionToken"], c["Expiration"].timestamp())


def _refused(exc: BaseException, namespace: str, name: str, role: str, audience: str, where: str) -> IdentityError:
    from botocore.exceptions import ClientError, ConnectTimeoutError, EndpointConnectionError, ReadTimeoutError

    subject = f"system:serviceaccount:{namespace}:{name}"
    if isinstance(exc, (EndpointConnectionError, ConnectTimeoutError, ReadTimeoutError)):
        return IdentityError(
            "STSUnreachable",
            f"cannot reach STS at {where} to exchange ServiceAccount {namespace}/{name}'s token: {exc}; "
            f"check the chart's podIdentity.stsEndpoint and that the operator can reach it.",
        )
    if isinstance(exc, ClientError):
        err = exc.response.get("Error", {})
        code, text = err.get("Code", ""), err.get("Message", "")
        if exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 400) >= 500:
            return IdentityError(
                "STSError",
                f"STS at {where} failed exchanging ServiceAccount {namespace}/{name}'s token ({code}: {text}); "
                f"the check is retried on its own.",
            )
        return IdentityError(
            "IdentityRefused",
            f"STS at {where} refused ServiceAccount {namespace}/{name}'s token for role {role} "
            f"({code}: {text}); the role's trust policy must allow sts:AssumeRoleWithWebIdentity "
            f"for subject {subject} with audience {audience}, from the cluster's OIDC issuer.",
        )
    return IdentityError("IdentityRefused", f"exchanging ServiceAccount {namespace}/{name}'s token failed: {exc}")


class Identities:
    """Credentials per (namespace, ServiceAccount, role), exchanged once and renewed before expiry."""

    def __init__(
        self,
        executor: concurrent.futures.Executor,
        audience: str = DEFAULT_AUDIENCE,
        sts_endpoint: str | None = None,
        timeout: float = 20.0,
    ) -> None:
        self.executor, self.audience, self.sts_endpoint, self.timeout = executor, audience, sts_endpoint, timeout
        self._held: dict[tuple[str, str, str], Credentials] = {}
        #: One exchange at a time per ServiceAccount: a burst of its caches waits for the first.
        self._locks: dict[tuple[str, str, str], asyncio.Lock] = {}
        #: Exchanges made (a test reads it to see the cache at work).
        self.exchanges = 0

    async def credentials(self, kube: Kube, namespace: str, name: str, region: str) -> Credentials:
        """Credentials of ServiceAccount ``namespace/name``'s role; IdentityError says what is wrong.
        Another API error is raised as is: the scheduler retries the cache after a backoff."""
        role = await self.role(kube, namespace, name)
        key = (namespace, name, role)
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:
            held = self._held.get(key)
            if held is not None and held.expires - RENEW_BEFORE > time.time():
                return held
            got = await self._exchange(kube, namespace, name, role, region)
            if len(self._held) >= MOST:
                now = time.time()
                self._held = {k: v for k, v in self._held.items() if v.expires - RENEW_BEFORE > now}
            self._held[key] = got
            return got

    async def role(self, kube: Kube, namespace: str, name: str) -> str:
        """The role ServiceAccount ``namespace/name`` names; IdentityError says what is wrong."""
        try:
            sa = await kube.get(f"/api/v1/namespaces/{namespace}/serviceaccounts/{name}")
        except ApiError as e:
            if e.status == 403:
                raise IdentityError(
                    "ServiceAccountForbidden",
                    f"the operator may not read ServiceAccount {namespace}/{name} "
                    f"(spec.source.serviceAccountName); the chart's RBAC grants serviceaccounts get.",
                ) from e
            raise
        if sa is None:
            raise IdentityError(
                "ServiceAccountNotFound",
                f"ServiceAccount {namespace}/{name} named in spec.source.serviceAccountName does not exist; "
                f"create it with the annotation {ROLE_ARN_ANNOTATION}: <the IAM role that may read the bucket>.",
            )
        role = role_arn(sa)
        if role is None:
            raise IdentityError(
                "RoleNotAnnotated",
                f"ServiceAccount {namespace}/{name} (spec.source.serviceAccountName) has no annotation "
                f"{ROLE_ARN_ANNOTATION}; annotate it with the IAM role that may list and read the bucket.",
            )
        return role

    async def _exchange(self, kube: Kube, namespace: str, name: str, role: str, region: str) -> Credentials:
        path = f"/api/v1/namespaces/{namespace}/serviceaccounts/{name}/token"
        try:
            answer = await kube.request("POST", path, token_request(self.audience))
        except ApiError as e:
            if e.status == 403:
                raise IdentityError(
                    "ServiceAccountForbidden",
                    f"the operator may not request a token of ServiceAccount {namespace}/{name}; the chart's "
                    f"RBAC grants serviceaccounts/token create.",
                ) from e
            raise
        token = (answer.get("status") or {}).get("token")
        if not token:
            raise IdentityError("IdentityRefused", f"the API server returned no token for {namespace}/{name}")
        self.exchanges += 1
        loop = asyncio.get_running_loop()
        where = self.sts_endpoint or "AWS STS"
        try:
            return await loop.run_in_executor(
                self.executor,
                assume_role_sync,
                self.sts_endpoint,
                region,
                role,
                token,
                session_name(namespace, name),
                self.timeout,
            )
        except Exception as exc:
            raise _refused(exc, namespace, name, role, self.audience, where) from exc
