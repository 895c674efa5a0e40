"""A small list+watch cache ("informer") for consumer pods and Jobs.

Why not kopf indexes here: kopf spawns one worker per object and, until every
index is filled, all of them wait on one condition that wakes them all at each
step; with thousands of pods that start-up is quadratic and never finished in
our benchmark (1,000 caches + 5,000 pods). Why not watch every pod: the
webhook labels what it injects (``dscache.io/consumer=true``), so the API
server filters, and the controller never sees, parses or stores other pods.

Each informer lists (paginated), marks itself ready, then watches from the
list's resourceVersion with bookmarks, and relists on 410 Gone. Only a small
extract of each object (``extract(body)``) is kept.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Hashable
from typing import Any

import aiohttp

from .client import ApiError, Kube

logger = logging.getLogger(__name__)

Extract = Callable[[dict[str, Any]], "tuple[Hashable, Any] | None"]
#: Told of every change of one object: (key, its value before, after); None for absent.
Notify = Callable[[Hashable, Any, Any], None]


class Gone(Exception):
    """The watch's resourceVersion is too old: relist."""


class Informer:
    def __init__(
        self,
        kube: Kube,
        path: str,
        label_selector: str,
        extract: Extract,
        page_size: int = 500,
        watch_timeout: int = 300,
        optional: bool = False,
        notify: Notify | None = None,
    ) -> None:
        self.kube = kube
        self.notify = notify
        #: optional: a kind whose CRD may not be installed (or that RBAC does not
        #: grant): 404/403 on the list make an empty, ready view that retries later.
        self.optional = optional
        self.absent_retry = 60.0
        self.path = path
        self.label_selector = label_selector
        self.extract = extract
        self.page_size = page_size
        self.watch_timeout = watch_timeout
        self.ready = asyncio.Event()
        #: monotonic time since when the API server refuses our credentials (None: it does not).
        self.auth_failing_since: float | None = None
        self._by_uid: dict[str, Hashable] = {}
        self._by_key: dict[Hashable, dict[str, Any]] = {}

    # --- reading ----------------------------------------------------------------------

    def get(self, key: Hashable) -> list[Any]:
        return list((self._by_key.get(key) or {}).values())

    def held_keys(self) -> list[Hashable]:
        return list(self._by_key)

    def __len__(self) -> int:
        return len(self._by_uid)

    # --- writing ----------------------------------------------------------------------

    def _upsert(self, body: dict[str, Any]) -> None:
        uid = (body.get("metadata") or {}).get("uid")
        if not uid:
            return
        old_key, old = self._pop(uid)
        got = self.extract(body)
        if got is not None:
            key, value = got
            self._by_uid[uid] = key
            self._by_key.setdefault(key, {})[uid] = value
        if self.notify is not None:
            if old_key is not None and (got is None or got[0] != old_key):
                self.notify(old_key, old, None)
            if got is not None:
                self.notify(got[0], old if old_key == got[0] else None, got[1])

    def _remove(self, uid: str) -> None:
        key, old = self._pop(uid)
        if key is not None and self.notify is not None:
            self.notify(key, old, None)

    def _pop(self, uid: str) -> tuple[Hashable | None, Any]:
        key = self._by_uid.pop(uid, None)
        old = None
        if key is not None:
            bucket = self._by_key.get(key)
            if bucket is not None:
                old = bucket.pop(uid, None)
                if not bucket:
                    del self._by_key[key]
        return key, old

    # --- list + watch -----------------------------------------------------------------

    async def _list(self) -> str:
        """List every page into a new view, then swap it in whole: while a relist runs (a 410
        Gone, an API server restart), readers keep the last complete view, never a partial
        one that lacks a running pod (a controller that acted on that would release its lease).
        The changes the relist found are told afterwards, as a watch would have told them."""
        old_by_uid, old_by_key = self._by_uid, self._by_key
        by_uid: dict[str, Hashable] = {}
        by_key: dict[Hashable, dict[str, Any]] = {}
        cont: str | None = None
        while True:
            params = {"labelSelector": self.label_selector, "limit": str(self.page_size)}
            if cont:
                params["continue"] = cont
            data = await self.kube.request("GET", self.path, params=params)
            for item in data.get("items") or []:
                uid = (item.get("metadata") or {}).get("uid")
                got = self.extract(item) if isinstance(uid, str) and uid else None
                if got is not None and isinstance(uid, str):
                    by_uid[uid] = got[0]
                    by_key.setdefault(got[0], {})[uid] = got[1]
            meta = data.get("metadata") or {}
            cont = meta.get("continue")
            if not cont:
                break
        self._by_uid, self._by_key = by_uid, by_key
        if self.notify is not None:
            for uid, key in by_uid.items():
                old_key = old_by_uid.get(uid)
                old = old_by_key.get(old_key, {}).get(uid) if old_key is not None else None
                if old_key is not None and old_key != key:
                    self.notify(old_key, old, None)
                self.notify(key, old if old_key == key else None, by_key[key][uid])
            for uid, key in old_by_uid.items():  # deleted while we were not watching
                if uid not in by_uid:
                    self.notify(key, old_by_key.get(key, {}).get(uid), None)
        return str(meta.get("resourceVersion", ""))

    async def _watch(self, rv: str) -> str:
        params = {
            "watch": "1",
            "resourceVersion": rv,
            "allowWatchBookmarks": "true",
            "labelSelector": self.label_selector,
            "timeoutSeconds": str(self.watch_timeout),
        }
        session = await self.kube.watch_session()
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=self.watch_timeout + 30)
        async with session.get(
            self.kube.server + self.path, params=params, timeout=timeout, headers=self.kube.auth_headers()
        ) as resp:
            if resp.status == 410:
                raise Gone()
            if resp.status >= 400:
                raise ApiError(resp.status, await resp.text())
            buf = b""
            async for chunk in resp.content.iter_any():
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    if line.strip():
                        rv = self._handle(json.loads(line), rv)
        return rv

    def _handle(self, event: dict[str, Any], rv: str) -> str:
        kind, obj = event.get("type"), event.get("object") or {}
        if kind == "ERROR":
            if obj.get("code") == 410:
                raise Gone()
            raise ApiError(int(obj.get("code") or 500), json.dumps(obj))
        if kind in ("ADDED", "MODIFIED"):
            self._upsert(obj)
        elif kind == "DELETED":
            self._remove((obj.get("metadata") or {}).get("uid", ""))
        return (obj.get("metadata") or {}).get("resourceVersion") or rv

    async def run(self) -> None:
        delay = 0.5
        rv = ""
        while True:
            try:
                if not rv:
                    rv = await self._list()
                    if not self.ready.is_set():
                        logger.info(f"listed {len(self)} objects at {self.path} ({self.label_selector})")
                    self.ready.set()
                    self.auth_failing_since = None
                    delay = 0.5
                rv = await self._watch(rv)
            except asyncio.CancelledError:
                raise
            except Gone:
                rv = ""
            except ApiError as e:
                if self.optional and e.status in (403, 404):  # CRD absent (or removed), or not granted
                    rv = ""
                    if not self.ready.is_set() or len(self):
                        logger.info(
                            f"{self.path}: {e.status}, an optional kind: an empty view "
                            f"(looking again in {self.absent_retry:.0f}s)"
                        )
                    self._by_uid, self._by_key = {}, {}
                    self.ready.set()
                    await asyncio.sleep(self.absent_retry)
                    continue
                if e.status not in (401, 403):
                    logger.warning(f"watching {self.path} failed ({e!r}); retrying in {delay:.1f}s")
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 30)
                    continue
                # Unauthorised: the view can no longer follow the cluster, so it
                # stops claiming to be ready (the controller then makes no node
                # decision on it), and lists afresh once a (rotated) token works.
                rv = ""
                self.ready.clear()
                if self.auth_failing_since is None:
                    self.auth_failing_since = time.monotonic()
                if self.kube.reload_token():
                    continue
                logger.warning(
                    f"watching {self.path}: {e.status} {'unauthorised' if e.status == 401 else 'forbidden'}; "
                    f"the view is not ready until it can list again (retrying in {delay:.1f}s)"
                )
                await asyncio.sleep(delay)
                delay = min(delay * 2, 30)
            except Exception as e:
                logger.warning(f"watching {self.path} failed ({e!r}); retrying in {delay:.1f}s")
                await asyncio.sleep(delay)
                delay = min(delay * 2, 30)


class MultiInformer:
    """One informer per watched namespace (or one cluster-wide), keyed by (namespace, ...)."""

    def __init__(
        self,
        kube: Kube,
        group_path: str,
        plural: str,
        namespaces: tuple[str, ...],
        label_selector: str,
        extract: Extract,
        optional: bool = False,
        notify: Notify | None = None,
    ) -> None:
        #: namespace (None: cluster-wide) -> its informer
        self.informers: dict[str | None, Informer]
        if namespaces:
            self.informers = {
                ns: Informer(
                    kube,
                    f"{group_path}/namespaces/{ns}/{plural}",
                    label_selector,
                    extract,
                    optional=optional,
                    notify=notify,
                )
                for ns in namespaces
            }
        else:
            self.informers = {
                None: Informer(
                    kube, f"{group_path}/{plural}", label_selector, extract, optional=optional, notify=notify
                )
            }
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self._tasks = [asyncio.create_task(i.run()) for i in self.informers.values()]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            try:
                await t
            except (asyncio.CancelledError, Exception):
                pass

    @property
    def ready(self) -> bool:
        return all(i.ready.is_set() for i in self.informers.values())

    def auth_failing_for(self) -> float:
        """Seconds since the API server started refusing our credentials (0: it does not)."""
        since = [i.auth_failing_since for i in self.informers.values() if i.auth_failing_since is not None]
        return time.monotonic() - min(since) if since else 0.0

    def get(self, key: tuple[Any, ...]) -> list[Any]:
        informer = self.informers.get(key[0]) or self.informers.get(None)
        return informer.get(key) if informer is not None else []

    def keys_in(self, namespace: str) -> list[Any]:
        """The keys (namespace, ...) this view holds objects under in ``namespace``."""
        informer = self.informers.get(namespace) or self.informers.get(None)
        return (
            [k for k in informer.held_keys() if isinstance(k, tuple) and k[0] == namespace]
            if informer is not None
            else []
        )

    def __len__(self) -> int:
        return sum(len(i) for i in self.informers.values())

    def held_keys(self) -> list[Hashable]:
        """Every key held (a new leader makes each cache due: the standby saw them come)."""
        return [k for i in self.informers.values() for k in i.held_keys()]
