"""A deliberately small async Kubernetes client (aiohttp, already kopf's dependency).

kopf does our watching, patching and Events; this covers the few direct calls
we need (GET a DatasetCache on a cold index, read one Secret, create/delete
wipe helper pods) without pulling a full client library into memory.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import aiohttp
import kopf


class ApiError(Exception):
    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body[:500]}")
        self.status = status
        self.body = body


class Kube:
    def __init__(self, info: kopf.ConnectionInfo, pool: int = 8) -> None:
        self.server = info.server.rstrip("/")
        self.default_namespace = info.default_namespace
        self._ssl = info.as_ssl_context()
        self._headers = {"Accept": "application/json", **info.as_http_headers()}
        self._pool = pool
        self._session: aiohttp.ClientSession | None = None
        self._watch_session: aiohttp.ClientSession | None = None

    async def watch_session(self) -> aiohttp.ClientSession:
        """Long-lived watch streams get their own (unbounded) pool."""
        if self._watch_session is None or self._watch_session.closed:
            self._watch_session = aiohttp.ClientSession(
                headers=self._headers, connector=aiohttp.TCPConnector(ssl=self._ssl, limit=0))
        return self._watch_session

    async def _s(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                headers=self._headers, connector=aiohttp.TCPConnector(ssl=self._ssl, limit=self._pool),
                timeout=aiohttp.ClientTimeout(total=15))
        return self._session

    async def close(self) -> None:
        for session in (self._session, self._watch_session):
            if session is not None:
                await session.close()

    async def request(self, method: str, path: str, body: Any = None,
                      content_type: str = "application/json",
                      params: dict[str, str] | None = None) -> dict[str, Any]:
        session = await self._s()
        data = None if body is None else json.dumps(body)
        headers = {"Content-Type": content_type} if data is not None else None
        async with session.request(method, self.server + path, data=data, headers=headers,
                                   params=params) as resp:
            text = await resp.text()
            if resp.status >= 400:
                raise ApiError(resp.status, text)
            return json.loads(text) if text else {}

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

    async def get_pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        return await self.get(f"/api/v1/namespaces/{namespace}/pods/{name}")

    async def create_pod(self, namespace: str, pod: dict[str, Any]) -> dict[str, Any] | None:
        """Create; None if it already exists (deterministic names make this idempotent)."""
        try:
            return await self.request("POST", f"/api/v1/namespaces/{namespace}/pods", pod)
        except ApiError as e:
            if e.status == 409:
                return None
            raise

    async def delete_pod(self, namespace: str, name: str) -> None:
        try:
            await self.request("DELETE", f"/api/v1/namespaces/{namespace}/pods/{name}",
                               {"propagationPolicy": "Background", "gracePeriodSeconds": 0})
        except ApiError as e:
            if e.status != 404:
                raise

    async def list_pods(self, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        data = await self.request("GET", f"/api/v1/namespaces/{namespace}/pods",
                                  params={"labelSelector": label_selector})
        return data.get("items", [])


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
    return info


def kopf_session(info: kopf.ConnectionInfo, watches: int) -> kopf.AiohttpSession:
    """kopf's own API session, with a bounded connection pool.

    kopf's default pool is unbounded: 1,000 DatasetCaches patched at once open
    hundreds of TLS connections, ~200 KiB each (measured: 488 connections held
    61 MiB of SSL buffers alone). ``watches`` long-lived streams come on top.
    """
    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=16 + watches, ssl=info.as_ssl_context()),
        headers=info.as_http_headers())
    return kopf.AiohttpSession(server=info.server, default_namespace=info.default_namespace,
                               priority=info.priority, aiohttp_session=session)
