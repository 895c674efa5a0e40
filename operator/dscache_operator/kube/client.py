"""A deliberately small async Kubernetes client (aiohttp, already kopf's dependency).

The controller's watches (informer.py), status patches, finalizers, Events,
Secret reads and pre-stage pods all go through it, without pulling a full
client library into memory; kopf logs in and serves the probes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any

import aiohttp
import kopf


class ApiError(Exception):
    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body[:500]}")
        self.status = status
        self.body = body


#: Where the kubelet projects the service-account token (rotated about hourly).
SA_TOKEN = "/var/run/secrets/kubernetes.io/serviceaccount/token"
#: client-go re-reads a token file at most this often even without a 401.
TOKEN_MAX_AGE = 60.0


#: Accept for writes whose answer we do not read: the API server then encodes only the object's
#: metadata, not all of it (a DatasetCache with its status is ~5 KB; at 10,000 caches, three
#: writes each, its encoding and our parsing add up); plain JSON where that is not served.
METADATA_ONLY = "application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1,application/json"


class Kube:
    """Our API client. Credentials can rotate under it: a projected service-account
    token is replaced by the kubelet about every hour, and the old one stops working
    when its pod binding ends or it expires. So the Authorization header is built per
    request from a token re-read from its file (at most every TOKEN_MAX_AGE seconds,
    and at once on a 401, then the request is retried once)."""

    def __init__(self, info: kopf.ConnectionInfo, pool: int = 32, token_file: str | None = None) -> None:
        self._pool = pool
        self._session: aiohttp.ClientSession | None = None
        self._watch_session: aiohttp.ClientSession | None = None
        self.use(info, token_file)

    def use(self, info: kopf.ConnectionInfo, token_file: str | None = None) -> None:
        """Take new credentials (kopf's re-login after a 401 hands them here too)."""
        self.server = info.server.rstrip("/")
        self.default_namespace = info.default_namespace
        self._info = info
        self._ssl = info.as_ssl_context()
        self._token_file = token_file or token_file_of(info)
        self._token = info.token
        self._token_read = time.monotonic()

    def reload_token(self) -> bool:
        """Re-read the token file; True if it now holds a different token."""
        self._token_read = time.monotonic()
        if not self._token_file:
            return False
        try:
            with open(self._token_file, encoding="utf-8") as f:
                token = f.read().strip()
        except OSError:
            return False
        if not token or token == self._token:
            return False
        self._token = token
        return True

    def auth_headers(self) -> dict[str, str]:
        if self._token_file and time.monotonic() - self._token_read > TOKEN_MAX_AGE:
            self.reload_token()
        headers = {"Accept": "application/json"}
        if self._token:
            headers["Authorization"] = f"{self._info.scheme or 'Bearer'} {self._token}"
        else:
            headers.update(self._info.as_http_headers())
        return headers

    async def watch_session(self) -> aiohttp.ClientSession:
        """Long-lived watch streams get their own (unbounded) pool. No auth header
        here: callers pass auth_headers() per request, so a new token is used."""
        if self._watch_session is None or self._watch_session.closed:
            self._watch_session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=self._ssl, limit=0))
        return self._watch_session

    async def _s(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(ssl=self._ssl, limit=self._pool), timeout=aiohttp.ClientTimeout(total=15)
            )
        return self._session

    async def close(self) -> None:
        for session in (self._session, self._watch_session):
            if session is not None:
                await session.close()

    async def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        content_type: str = "application/json",
        params: dict[str, str] | None = None,
        answer: bool = True,
    ) -> dict[str, Any]:
        """``answer=False``: a write whose resulting object the caller does not read ({} back)."""
        session = await self._s()
        data = None if body is None else json.dumps(body)
        for attempt in (0, 1):
            headers = self.auth_headers()
            if data is not None:
                headers["Content-Type"] = content_type
            if not answer:
                headers["Accept"] = METADATA_ONLY
            async with session.request(method, self.server + path, data=data, headers=headers, params=params) as resp:
                text = await resp.text()
                if resp.status == 401 and attempt == 0 and self.reload_token():
                    continue  # the token rotated under us: retry once with the new one
                if resp.status >= 400:
                    raise ApiError(resp.status, text)
                return json.loads(text) if text and answer else {}
        raise AssertionError("unreachable")

    # --- the few calls we need -------------------------------------------------

    async def get(self, path: str) -> dict[str, Any] | None:
        try:
            return await self.request("GET", path)
        except ApiError as e:
            if e.status == 404:
                return None
            raise

    async def get_cache(self, namespace: str, name: str) -> dict[str, Any] | None:
        return await self.get(f"/apis/dscache.io/v1alpha1/namespaces/{namespace}/datasetcaches/{name}")

    async def get_secret(self, namespace: str, name: str) -> dict[str, Any] | None:
        return await self.get(f"/api/v1/namespaces/{namespace}/secrets/{name}")

    async def create_pod(self, namespace: str, pod: dict[str, Any]) -> dict[str, Any] | None:
        """Create; None if it already exists (deterministic names make this idempotent)."""
        try:
            return await self.request("POST", f"/api/v1/namespaces/{namespace}/pods", pod)
        except ApiError as e:
            if e.status == 409:
                return None
            raise

    async def patch_status(self, path: str, status: dict[str, Any]) -> str | None:
        """Merge-patch an object's status subresource (None values delete); a gone object is no error.
        Returns the object's resourceVersion after the write (None: it is gone)."""
        try:
            body = await self.request("PATCH", path + "/status", {"status": status}, "application/merge-patch+json")
        except ApiError as e:
            if e.status != 404:
                raise
            return None
        return str((body.get("metadata") or {}).get("resourceVersion") or "") or None

    async def add_finalizer(self, path: str, present: tuple[str, ...], finalizer: str) -> None:
        """Append ``finalizer`` (JSON patch: the others' finalizers are left as they are)."""
        if present:
            ops: list[dict[str, Any]] = [{"op": "add", "path": "/metadata/finalizers/-", "value": finalizer}]
        else:
            ops = [{"op": "add", "path": "/metadata/finalizers", "value": [finalizer]}]
        await self.request("PATCH", path, ops, "application/json-patch+json", answer=False)

    async def remove_finalizer(self, path: str, present: tuple[str, ...], finalizer: str) -> None:
        """Remove exactly ``finalizer``: the test fails (422) if the list changed meanwhile; the next run retries."""
        i = present.index(finalizer)
        ops = [
            {"op": "test", "path": f"/metadata/finalizers/{i}", "value": finalizer},
            {"op": "remove", "path": f"/metadata/finalizers/{i}"},
        ]
        try:
            await self.request("PATCH", path, ops, "application/json-patch+json", answer=False)
        except ApiError as e:
            if e.status != 404:
                raise

    async def delete_pod(self, namespace: str, name: str) -> None:
        try:
            await self.request(
                "DELETE",
                f"/api/v1/namespaces/{namespace}/pods/{name}",
                {"propagationPolicy": "Background", "gracePeriodSeconds": 0},
                answer=False,
            )
        except ApiError as e:
            if e.status != 404:
                raise


def connection_info(**kwargs: Any) -> kopf.ConnectionInfo:
    """In-cluster service account first, then KUBECONFIG, as kopf does.

    In cluster, the API server is addressed as client-go does, by
    KUBERNETES_SERVICE_HOST/PORT: kopf's own choice, kubernetes.default.svc,
    needs cluster DNS, which not every cluster runs.
    """
    kwargs.setdefault("settings", kopf.OperatorSettings())
    info = kopf.login_with_service_account(**kwargs)
    host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT")
    if info is not None and host and port:
        host = f"[{host}]" if ":" in host else host
        info = dataclasses.replace(info, server=f"https://{host}:{port}")
    info = info or kopf.login_with_kubeconfig(**kwargs)
    if info is None:
        raise kopf.LoginError("no service account token and no kubeconfig found")
    path = token_file_of(info)
    if path and info.token is None:  # kopf ignores a kubeconfig's tokenFile; client-go reads it
        with open(path, encoding="utf-8") as f:
            info = dataclasses.replace(info, scheme="Bearer", token=f.read().strip())
    return info


def token_file_of(info: kopf.ConnectionInfo | None = None) -> str | None:
    """The file a token comes from and is re-read from: the in-cluster service
    account's, or a kubeconfig user's ``tokenFile`` (as client-go honours it)."""
    if os.path.exists(SA_TOKEN) and os.environ.get("KUBERNETES_SERVICE_HOST"):
        return SA_TOKEN
    for path in (os.environ.get("KUBECONFIG") or "").split(os.pathsep):
        if not path or not os.path.exists(path):
            continue
        try:
            import yaml

            with open(path, encoding="utf-8") as f:
                config = yaml.safe_load(f) or {}
        except (OSError, ValueError):
            continue
        context_name = config.get("current-context")
        context = next(
            (c.get("context") or {} for c in config.get("contexts") or [] if c.get("name") == context_name), {}
        )
        user = next(
            (u.get("user") or {} for u in config.get("users") or [] if u.get("name") == context.get("user")), {}
        )
        if user.get("tokenFile"):
            return str(user["tokenFile"])
    return None


def kopf_session(info: kopf.ConnectionInfo, watches: int) -> kopf.AiohttpSession:
    """kopf's own API session, with a bounded connection pool.

    kopf's default pool is unbounded: 1,000 DatasetCaches patched at once open
    hundreds of TLS connections, ~200 KiB each (measured: 488 connections held
    61 MiB of SSL buffers alone). ``watches`` long-lived streams come on top.
    """
    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=16 + watches, ssl=info.as_ssl_context()), headers=info.as_http_headers()
    )
    return kopf.AiohttpSession(
        server=info.server, default_namespace=info.default_namespace, priority=info.priority, aiohttp_session=session
    )
