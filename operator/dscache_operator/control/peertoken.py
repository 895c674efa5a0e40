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


class Tokens:
    """The period each cache's Secret was last written for (one int per cache)."""

    def __init__(self) -> None:
        self._written: dict[tuple[str, str], int] = {}

    def due(self, namespace: str, cache: str, now: float) -> bool:
        """Whether this period's token of the cache is still to be written."""
        return self._written.get((namespace, cache)) != int(now // TOKEN_PERIOD_S)

    @staticmethod
    def period_end(now: float) -> float:
        """When the period of ``now`` ends (a token is due again)."""
        return (int(now // TOKEN_PERIOD_S) + 1) * TOKEN_PERIOD_S

    async def ensure(self, kube: Kube, key: str | None, namespace: str, cache: str, uid: str, now: float) -> None:
        """Write the cache's token for this period unless done already. No key (no agent token):
        nothing; peers then refuse every request, and stagers read the bucket."""
        if not key or not self.due(namespace, cache, now):
            return
        body = peer_secret(namespace, cache, uid, peer_token(key, namespace, cache, now))
        path = f"/api/v1/namespaces/{namespace}/secrets"
        name = body["metadata"]["name"]
        # No GET (the controller may not read Secrets it did not name): create, and when it exists,
        # a JSON patch that first tests our label, so the API server changes nothing in a Secret
        # of that name that is not ours. Rewriting the same token is a no-op for the API server.
        patch = [
            {"op": "test", "path": f"/metadata/labels/{_pointer(PEER_TOKEN_LABEL)}", "value": "true"},
            {"op": "add", "path": f"/data/{_pointer(PEER_TOKEN_KEY)}", "value": body["data"][PEER_TOKEN_KEY]},
        ]
        try:
            try:
                await kube.request("POST", path, body, answer=False)
            except ApiError as e:
                if e.status != 409:
                    raise
                await kube.request("PATCH", f"{path}/{name}", patch, "application/json-patch+json", answer=False)
        except ApiError as e:
            if e.status in (409, 422) or (e.status == 500 and "test" in str(e)):
                log.warning(f"{namespace}/{name} exists and is not a dscache peer token: left alone (no peers)")
            else:
                # Without the Secret the stagers read the bucket: slower, never wrong. Tried again next pass.
                log.warning(f"could not write the peer token of {namespace}/{cache}: {e}")
                return
        self._written[(namespace, cache)] = int(now // TOKEN_PERIOD_S)

    def forget(self, namespace: str, cache: str) -> None:
        self._written.pop((namespace, cache), None)
