"""``GET /v1/listings/<namespace>/<cache>/<revision>?wait=<s>``: a revision's listing for a peer.

A stager here that listed the bucket (or took a checked listing from a peer) leaves the listing
as ``C/revs/<rev>/meta/listing.jsonl`` once it hashed to the revision (dscache_contract.listings);
this route sends that file (sendfile) to another node's stager that shows the cache's token, the
gate of objects. While it is not there yet, the request is held up to ``wait`` seconds; then 404
with the revision's state and how many bytes of the listing are written so far (``listed``): the
asker keeps asking while that grows, and lists the bucket itself when it stops. Files are opened
one component at a time without following symlinks (peers._open_beneath): everything under C is
writable by the cache's pods. The asker checks every line against the revision; nothing here is
trusted by anyone.
"""

from __future__ import annotations

import asyncio
import os
import stat
import time
from typing import TYPE_CHECKING

from aiohttp import web

import dscache_contract as contract
from dscache_contract.listings import (
    LISTED_FIELD,
    LISTING_NAME,
    LISTING_PART_NAME,
    LISTINGS_PATH,
    ListingRequest,
)
from dscache_contract.peers import RevisionState

from .peers import Opened, _open_beneath, check_request

if TYPE_CHECKING:
    from .server import AgentServer

#: How often a held request looks again for the listing.
POLL_S = 0.1


def open_listing(c: str, rev: str) -> Opened:
    """The revision's whole listing, read-only; FileNotFoundError if it is not a regular file."""
    fd = _open_beneath(c, [contract.REVS_DIR, rev, contract.META_DIR, LISTING_NAME])
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise FileNotFoundError(LISTING_NAME)
    return Opened(fd, st.st_size)


def listed_so_far(c: str, rev: str) -> int | None:
    """Bytes of the listing a stager here has written so far; None: none is being written."""
    try:
        fd = _open_beneath(c, [contract.REVS_DIR, rev, contract.TMP_DIR, LISTING_PART_NAME])
    except FileNotFoundError:
        return None
    try:
        st = os.fstat(fd)
        return st.st_size if stat.S_ISREG(st.st_mode) else None
    finally:
        os.close(fd)


async def serve_listing(server: AgentServer, request: web.BaseRequest) -> web.StreamResponse:
    """The route's handler (AgentServer._handle); the object route's gate and bounds."""
    from .server import _error, _json  # the server imports this module

    try:
        req = ListingRequest.parse(request.path_qs)
        check_request(req.namespace, req.cache, LISTING_NAME)
    except (ValueError, contract.ArgsError) as e:
        return _error(400, f"bad request: {e}")
    client = await server.admit(request, LISTINGS_PATH, req.namespace, req.cache)
    if isinstance(client, web.Response):
        return client
    try:
        c = server.agent.c(req.namespace, req.cache)
        deadline = time.monotonic() + req.wait
        while True:
            try:
                opened = open_listing(c, req.revision)
                break
            except FileNotFoundError:
                pass
            if time.monotonic() >= deadline:
                listed = listed_so_far(c, req.revision)
                complete = os.path.exists(contract.complete_path(c, req.revision))
                state = (
                    RevisionState.STAGING
                    if listed is not None
                    else (RevisionState.COMPLETE if complete else RevisionState.ABSENT)
                )
                return _json(404, {"state": state.value, LISTED_FIELD: listed or 0, "error": "no whole listing here"})
            await asyncio.sleep(POLL_S)
        try:
            return await server._send(request, req.revision, opened)
        finally:
            os.close(opened.fd)
    finally:
        server.objects.give(client)
