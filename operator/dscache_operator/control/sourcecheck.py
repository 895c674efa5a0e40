"""Check a DatasetCache's source before any Job runs: list it, count it.

The controller lists the bucket itself (boto3, in a worker thread), with the
keys from the Secret named in the spec, as the ServiceAccount named in the spec
(pod identity: cluster/identity.py exchanges its token at STS), or with its own
identity when the spec names neither. The outcome is either object/byte counts
or one precise reason: NoSuchBucket, AccessDenied, EndpointUnreachable,
SecretNotFound, SecretKeyMissing, SecretForbidden, ServiceAccountNotFound,
ServiceAccountForbidden, RoleNotAnnotated, IdentityRefused, STSUnreachable,
NoObjects or SourceError. With neither and no S3 identity of the operator's own,
the result is NoIdentity: SourceReady=False, phase Failed, and the message says
what to add (no revision can be pinned, so no Job could be admitted).
"""

from __future__ import annotations

import asyncio
import base64
import collections
import concurrent.futures
import dataclasses
import datetime
import hashlib
import json
import threading
import time
from typing import Any

import dscache_contract as contract
from dscache_contract.clock import parse_time

from ..api.models import DatasetCacheSpec, Phase, Source, parse_duration
from ..cluster.identity import DEFAULT_AUDIENCE, Identities, IdentityError
from ..kube.client import ApiError, Kube
from ..kube.coalesce import Coalescer
from ..metrics.registry import Metrics

KEY_ID = "AWS_ACCESS_KEY_ID"
SECRET_KEY = "AWS_SECRET_ACCESS_KEY"
TOKEN = "AWS_SESSION_TOKEN"
OWN_IDENTITY = "the operator's own identity"


@dataclasses.dataclass(frozen=True)
class CheckResult:
    ok: bool  # listed (as the Secret's keys, or as the ServiceAccount the cache names)
    reason: str
    message: str
    objects: int | None = None
    bytes: int | None = None
    #: The listing's revision (id, and in a versioned bucket its versions time), when listed.
    revision: contract.RevisionRef | None = None


def credentials_from_secret(secret: dict[str, Any] | None, namespace: str, name: str) -> dict[str, str] | CheckResult:
    if secret is None:
        return CheckResult(
            False,
            "SecretNotFound",
            f"Secret {namespace}/{name} named in spec.source.credentials.secretRef "
            f"does not exist; create it with keys {KEY_ID} and {SECRET_KEY}.",
        )
    data = secret.get("data") or {}
    missing = [k for k in (KEY_ID, SECRET_KEY) if not data.get(k)]
    if missing:
        return CheckResult(
            False,
            "SecretKeyMissing",
            f"Secret {namespace}/{name} lacks key(s) {', '.join(missing)}; "
            f"add them (the stager reads {KEY_ID}, {SECRET_KEY} and optionally {TOKEN}).",
        )
    out = {k: base64.b64decode(data[k]).decode() for k in (KEY_ID, SECRET_KEY, TOKEN) if data.get(k)}
    return out


def secret_forbidden(namespace: str, name: str, operator_namespace: str) -> CheckResult:
    """The API server refused our `get` on the Secret: the chart narrowed Secret
    reading (sourceCheck.secretNamespaces) or turned it off (readSecrets=false).
    Name the chart values that grant it, not the watched namespaces: changing
    those would switch the operator to namespaced mode."""
    upgrade = f"helm upgrade dscache charts/dscache -n {operator_namespace} --reuse-values"
    return CheckResult(
        False,
        "SecretForbidden",
        f"the operator may not read Secret {namespace}/{name} (spec.source.credentials.secretRef), so it "
        f"cannot list the bucket with the cache's keys. The chart's sourceCheck values forbid it: let it "
        f"read Secrets in every namespace it serves with `{upgrade} --set sourceCheck.readSecrets=true "
        f"--set-json 'sourceCheck.secretNamespaces=[]'`, or add {namespace} to the namespaces already listed "
        f"with `{upgrade} --set 'sourceCheck.secretNamespaces={{<listed>,{namespace}}}'` (use your release "
        f"name and chart path). The check is retried on its own.",
    )


def no_identity() -> CheckResult:
    """Neither a Secret nor a ServiceAccount, and the operator has no S3 identity of its own."""
    return CheckResult(
        False,
        "NoIdentity",
        "the cache names no identity to list its source with, so no revision can be pinned and no "
        "Job can use it: add spec.source.serviceAccountName (pod identity: a ServiceAccount of this "
        "namespace annotated eks.amazonaws.com/role-arn with a role that may list and read the "
        "bucket) or spec.source.credentials.secretRef (a Secret with AWS_ACCESS_KEY_ID and "
        "AWS_SECRET_ACCESS_KEY).",
    )


def selected(rel: str, include: list[str], exclude: list[str]) -> bool:
    """The contract's include/exclude rule (the stager uses the same code)."""
    return contract.selected(rel, include, exclude)


def _classify(exc: BaseException, source: Source, identity: str) -> CheckResult:
    from botocore.exceptions import (
        ClientError,
        ConnectTimeoutError,
        EndpointConnectionError,
        NoCredentialsError,
        ReadTimeoutError,
    )

    where = source.endpoint or "AWS S3"
    if isinstance(exc, (EndpointConnectionError, ConnectTimeoutError, ReadTimeoutError)):
        return CheckResult(
            False,
            "EndpointUnreachable",
            f"cannot reach the S3 endpoint {where}: {exc}; check spec.source.endpoint "
            f"and that the operator can reach it.",
        )
    if isinstance(exc, NoCredentialsError):
        # Without a listing there is no revision to pin, and without one no Job can be
        # admitted: the cache is not usable, so say so now and name the fix.
        return no_identity()
    if isinstance(exc, ClientError):
        code = exc.response.get("Error", {}).get("Code", "")
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if code == "NoSuchBucket" or (status == 404 and not code.startswith("NoSuchKey")):
            return CheckResult(
                False,
                "NoSuchBucket",
                f"bucket {source.bucket!r} does not exist at {where}; fix spec.source.uri "
                f"(or spec.source.endpoint/region).",
            )
        if code in (
            "AccessDenied",
            "InvalidAccessKeyId",
            "SignatureDoesNotMatch",
            "AllAccessDisabled",
            "InvalidToken",
            "ExpiredToken",
            "Forbidden",
        ) or status in (401, 403):
            return CheckResult(
                False,
                "AccessDenied",
                f"access denied listing {source.uri} at {where} with {identity} "
                f"({code or status}); grant s3:ListBucket and s3:GetObject, or fix the keys"
                + (
                    ", or name a ServiceAccount whose role may (spec.source.serviceAccountName)."
                    if identity == OWN_IDENTITY
                    else "."
                ),
            )
        return CheckResult(False, "SourceError", f"listing {source.uri} failed: {code or status}: {exc}")
    return CheckResult(False, "SourceError", f"listing {source.uri} failed: {type(exc).__name__}: {exc}")


_clients: collections.OrderedDict[tuple[Any, ...], object] = collections.OrderedDict()
_clients_lock = threading.Lock()
_MAX_CLIENTS = 32


def _digest(creds: dict[str, str] | None) -> str:
    """The credentials, as a key that does not keep the secret in memory."""
    parts = [(creds or {}).get(k) for k in (KEY_ID, SECRET_KEY, TOKEN)]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()


def _client(source: Source, creds: dict[str, str] | None, timeout: float) -> Any:
    """A boto3 S3 client per (endpoint, region, style, keys); creating one costs
    ~50 ms of CPU and a few MiB, so 1,000 caches over one store share one."""
    import boto3
    from botocore.config import Config

    key = (source.endpoint, source.region, source.addressingStyle, _digest(creds), timeout)
    with _clients_lock:
        client = _clients.get(key)
        if client is not None:
            _clients.move_to_end(key)
            return client
        cfg = Config(
            connect_timeout=min(timeout, 5),
            read_timeout=timeout,
            retries={"max_attempts": 2, "mode": "standard"},
            s3={"addressing_style": contract.resolve_addressing_style(source.endpoint, source.addressingStyle)},
        )
        kwargs = {}
        if creds:
            kwargs = {
                "aws_access_key_id": creds[KEY_ID],
                "aws_secret_access_key": creds[SECRET_KEY],
                "aws_session_token": creds.get(TOKEN),
            }
        session = boto3.session.Session(**kwargs)
        client = session.client(
            "s3", endpoint_url=source.endpoint, region_name=contract.resolve_region(source.region), config=cfg
        )
        _clients[key] = client
        while len(_clients) > _MAX_CLIENTS:
            _clients.popitem(last=False)
        return client


def _list_sync(
    source: Source, creds: dict[str, str] | None, timeout: float, identity: str | None = None
) -> CheckResult:
    identity = identity or ("the Secret's keys" if creds else OWN_IDENTITY)
    # contract.pin streams the listing page by page into the contract's hasher,
    # never holding it: memory stays flat at millions of keys, and the digest is
    # the very one the stager recomputes to prove it copies this revision. In a
    # versioned bucket it also pins the versions (see dscache_contract.versions).
    selection = contract.Selection.from_source(source.uri, source.include, source.exclude)
    bucket, _ = contract.parse_source(source.uri)
    try:
        pinned = contract.pin(_client(source, creds, timeout), bucket, selection)
    except Exception as exc:
        return _classify(exc, source, identity)
    if pinned.objects == 0:
        return CheckResult(
            False,
            "NoObjects",
            f"{source.uri} holds no objects (after include/exclude); fix spec.source.uri or the globs.",
            0,
            0,
        )
    versions = f", versions as of {pinned.as_of}" if pinned.as_of else ""
    return CheckResult(
        True,
        "Listed",
        f"{pinned.objects} objects, {pinned.bytes} bytes in {source.uri} (revision {pinned.revision}{versions})",
        pinned.objects,
        pinned.bytes,
        pinned.ref,
    )


async def check(
    executor: concurrent.futures.Executor,
    source: Source,
    creds: dict[str, str] | None,
    timeout: float = 20.0,
    identity: str | None = None,
) -> CheckResult:
    """List the source in one of ``executor``'s threads (boto3 blocks)."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(executor, _list_sync, source, creds, timeout, identity)


# --- the controller's glue: credentials from the spec's Secret, and when to check -------------


class SecretReads:
    """The Secrets read in the last few seconds. A fleet of caches names a few Secrets:
    10,000 first source checks in a burst read each Secret once, not 10,000 times."""

    def __init__(self, ttl: float = 10.0, most: int = 256) -> None:
        self.ttl, self.most = ttl, most
        self._got: dict[tuple[str, str], tuple[float, dict[str, Any] | None]] = {}

    async def get(self, kube: Kube, namespace: str, name: str) -> dict[str, Any] | None:
        now = time.monotonic()
        hit = self._got.get((namespace, name))
        if hit is not None and now - hit[0] < self.ttl:
            return hit[1]
        secret = await kube.get_secret(namespace, name)
        if len(self._got) >= self.most:
            self._got = {k: v for k, v in self._got.items() if now - v[0] < self.ttl}
        if len(self._got) < self.most:
            self._got[(namespace, name)] = (now, secret)
        return secret


class SourceChecks:
    """The controller's source checks: credentials from the spec's Secret, then a listing in
    one of a few threads, shared by equal checks in flight (kube/coalesce.py)."""

    def __init__(
        self,
        metrics: Metrics,
        operator_namespace: str,
        threads: int = 4,
        sts_endpoint: str | None = None,
        audience: str = DEFAULT_AUDIENCE,
    ) -> None:
        self.metrics, self.operator_namespace = metrics, operator_namespace
        #: Secrets read in the last few seconds.
        self.secrets = SecretReads()
        #: Listings are I/O-bound; each thread costs memory (see __main__).
        self.executor = concurrent.futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="sourcecheck")
        self.listings: Coalescer[CheckResult] = Coalescer()
        #: ServiceAccounts' credentials (pod identity), renewed before they expire.
        self.identities = Identities(self.executor, audience=audience, sts_endpoint=sts_endpoint)

    async def check(self, kube: Kube, namespace: str, spec: DatasetCacheSpec, not_before: float) -> CheckResult:
        """Read the spec's Secret (if any) with the operator's client, then list the source, with
        a listing begun at ``not_before`` (time.monotonic()) or later.
        Another failure reading the Secret is raised: the scheduler retries the cache after a backoff."""
        creds = None
        secret_name = spec.source.secret_name
        if secret_name:
            try:
                secret = await self.secrets.get(kube, namespace, secret_name)
            except ApiError as e:
                if e.status == 403:
                    return secret_forbidden(namespace, secret_name, self.operator_namespace)
                raise
            got = credentials_from_secret(secret, namespace, secret_name)
            if isinstance(got, CheckResult):
                return got
            creds = got
        identity = None
        account = spec.source.serviceAccountName
        if account:
            try:
                held = await self.identities.credentials(
                    kube, namespace, account, contract.resolve_region(spec.source.region)
                )
            except IdentityError as e:
                return CheckResult(False, e.reason, e.message)
            creds = {KEY_ID: held.access_key_id, SECRET_KEY: held.secret_access_key, TOKEN: held.session_token}
            identity = f"ServiceAccount {namespace}/{account}'s role"
        # Equal listings share one trip to S3 (coalesce.py: never one begun before not_before),
        # but only with the same credentials, Secret and namespace: a cache must never see a
        # listing made with keys it was not given.
        # The key holds the ServiceAccount too, not its credentials' digest (which change at each
        # renewal): equal listings in flight share one trip only within one identity.
        key = (
            namespace,
            secret_name,
            account,
            None if account else _digest(creds),
            spec.source.model_dump_json(),
        )

        async def listing() -> CheckResult:
            self.metrics.source_listed()
            return await check(self.executor, spec.source, creds, identity=identity)

        return await self.listings.run(key, listing, not_before)


def source_due(
    generation: int | None,
    refresh: str | None,
    status: dict[str, Any],
    last_check: float,
    retry_interval: float,
    refresh_interval: str,
    now: datetime.datetime,
) -> str | None:
    """Why the source must be listed now (None: it need not be).

    On create and spec change; again every retry_interval while it fails
    (``last_check``: monotonic time of the last check, 0 for none); when the
    annotation dscache.io/refresh has a value not acted on yet; and when the
    pinned revision is older than spec.refresh.interval. Judged from the object
    alone (status.revision.listedAt), so a restarted operator agrees.
    """
    if status.get("observedGeneration") != generation:
        return "spec"
    if refresh is not None and refresh != status.get("observedRefresh"):
        return "annotation"
    if status.get("phase") == Phase.FAILED:
        return "retry" if time.monotonic() - last_check >= retry_interval else None
    listed = parse_time((status.get("revision") or {}).get("listedAt"))
    if (
        refresh_interval != "Never"
        and listed is not None
        and (now - listed).total_seconds() >= parse_duration(refresh_interval)
    ):
        return "interval"
    return None
