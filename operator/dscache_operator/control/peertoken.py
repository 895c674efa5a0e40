"""Each DatasetCache's peer token: the Secret its stagers show to other nodes' agents.

The token is an HMAC of the namespace, the cache and a period, keyed with the agent
token the chart shares between the controller and the node agents
(dscache_contract.peers); an agent checks it without any API call. The controller
writes it into ``dscache-peer-<cache>`` in the cache's namespace, owned by the
DatasetCache (garbage-collected with it), and writes it afresh each period
(rotation): a token opens its cache's objects for one to two periods. The webhook
mounts that Secret into the stager (optional: no Secret, no peers; the bucket
serves everything).

``peer_secret`` is a pure spec builder; ``ensure`` writes at most once per cache
per period (``Tokens`` remembers which period each cache has): a create, or a
patch guarded by our label (the controller may not read Secrets: no GET).
"""

from __future__ import annotations

import base64
import logging
from typing import Any

from dscache_contract.peers import PEER_TOKEN_KEY, TOKEN_PERIOD_S, peer_secret_name, peer_token

from ..kube.client import ApiError, Kube

log = logging.getLogger("dscache.peers")

#: Marks the Secrets the controller writes (and would overwrite).
PEER_TOKEN_LABEL = "dscache.io/peer-token"


def peer_secret(namespace: str, cache: str, cache_uid: str, token: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {
            "name": peer_secret_name(cache),
            "namespace": namespace,
            "labels": {PEER_TOKEN_LABEL: "true", "app.kubernetes.io/managed-by": "dscache"},
            "ownerReferences": [
                {
                    "apiVersion": "dscache.io/v1alpha1",
                    "kind": "DatasetCache",
                    "name": cache,
                    "uid": cache_uid,
                    "controller": True,
                    "blockOwnerDeletion": False,
                }
            ],
        },
        "data": {PEER_TOKEN_KEY: base64.b64encode(token.encode()).decode()},
    }


def _pointer(key: str) -> str:
    """A JSON pointer's reference token (RFC 6901)."""
    return key.replace("~", "~0").replace("/", "~1")


#: After a Secret was taken over from a deleted cache of the same name, the write is done again
#: this soon: the garbage collector may still delete it (its graph had the old owner).
RECHECK_S = 60.0


def _owner(namespace: str, cache: str, uid: str) -> list[dict[str, Any]]:
    return peer_secret(namespace, cache, uid, "")["metadata"]["ownerReferences"]  # type: ignore[no-any-return]


class Tokens:
    """The period each cache's Secret was last written for, for which cache (its UID: a cache
    deleted and created again under its name is another cache), and when to write again anyway."""

    def __init__(self) -> None:
        self._written: dict[tuple[str, str], tuple[int, str, float]] = {}

    def due(self, namespace: str, cache: str, now: float, uid: str | None = None) -> bool:
        """Whether this period's token of the cache (of UID ``uid``, when given) is still to be written."""
        got = self._written.get((namespace, cache))
        if got is None:
            return True
        period, written_for, recheck = got
        return period != int(now // TOKEN_PERIOD_S) or (uid is not None and uid != written_for) or now >= recheck

    @staticmethod
    def period_end(now: float) -> float:
        """When the period of ``now`` ends (a token is due again)."""
        return (int(now // TOKEN_PERIOD_S) + 1) * TOKEN_PERIOD_S

    def next_due(self, namespace: str, cache: str, now: float) -> float:
        """When the cache's token is due again: the period's end, or a recheck before it."""
        got = self._written.get((namespace, cache))
        return min(self.period_end(now), got[2] if got else now)

    async def ensure(self, kube: Kube, key: str | None, namespace: str, cache: str, uid: str, now: float) -> None:
        """Write the cache's token for this period unless done already. No key (no agent token):
        nothing; peers then refuse every request, and stagers read the bucket."""
        if not key or not self.due(namespace, cache, now, uid):
            return
        body = peer_secret(namespace, cache, uid, peer_token(key, namespace, cache, now))
        path = f"/api/v1/namespaces/{namespace}/secrets"
        name = body["metadata"]["name"]
        # No GET (the controller may not read Secrets it did not name): create, and when it exists,
        # a JSON patch that first tests our label, so the API server changes nothing in a Secret
        # of that name that is not ours. Rewriting the same token is a no-op for the API server.
        label = {"op": "test", "path": f"/metadata/labels/{_pointer(PEER_TOKEN_LABEL)}", "value": "true"}
        data = {"op": "add", "path": f"/data/{_pointer(PEER_TOKEN_KEY)}", "value": body["data"][PEER_TOKEN_KEY]}
        # Ours and owned by this very cache: the token alone. Ours but owned by a deleted cache of
        # this name (the collector has not removed it yet): moved to this cache, token and owner,
        # and written again in RECHECK_S (the collector may delete it all the same).
        owned = {"op": "test", "path": "/metadata/ownerReferences/0/uid", "value": uid}
        owner = {"op": "replace", "path": "/metadata/ownerReferences", "value": _owner(namespace, cache, uid)}
        recheck = float("inf")
        try:
            try:
                await kube.request("POST", path, body, answer=False)
            except ApiError as e:
                if e.status != 409:
                    raise
                patch = f"{path}/{name}"
                try:
                    await kube.request("PATCH", patch, [label, owned, data], _JSON_PATCH, answer=False)
                except ApiError as e:
                    if not _test_failed(e):
                        raise
                    await kube.request("PATCH", patch, [label, owner, data], _JSON_PATCH, answer=False)
                    log.info(f"{namespace}/{name} belonged to a deleted cache of that name: now to this one")
                    recheck = now + RECHECK_S
        except ApiError as e:
            if _test_failed(e):
                log.warning(f"{namespace}/{name} exists and is not a dscache peer token: left alone (no peers)")
            else:
                # Without the Secret the stagers read the bucket: slower, never wrong. Tried again next pass
                # (a 404: the collector removed the old cache's Secret between our two requests).
                log.warning(f"could not write the peer token of {namespace}/{cache}: {e}")
                return
        self._written[(namespace, cache)] = (int(now // TOKEN_PERIOD_S), uid, recheck)

    def forget(self, namespace: str, cache: str) -> None:
        self._written.pop((namespace, cache), None)


_JSON_PATCH = "application/json-patch+json"


def _test_failed(e: ApiError) -> bool:
    """A JSON patch's test operation failed (422; some API server versions say 500)."""
    return e.status in (409, 422) or (e.status == 500 and "test" in str(e))
