"""peertoken.py: the Secret's spec, and at most one write per cache per period (a fake API: a dict)."""

from __future__ import annotations

import asyncio
import base64
from typing import Any

from dscache_contract.peers import PEER_TOKEN_KEY, TOKEN_PERIOD_S, check_peer_token, peer_secret_name
from dscache_operator.control.peertoken import PEER_TOKEN_LABEL, Tokens, peer_secret
from dscache_operator.kube.client import ApiError

KEY = "k" * 48


class FakeKube:
    def __init__(self) -> None:
        self.objects: dict[str, dict[str, Any]] = {}
        self.calls: list[str] = []
        self.refuse = False

    async def request(
        self, method: str, path: str, body: Any = None, content_type: str = "", answer: bool = True
    ) -> dict[str, Any]:
        self.calls.append(f"{method} {path}")
        if self.refuse:
            raise ApiError(403, "forbidden")
        if method == "POST":
            name = f"{path}/{body['metadata']['name']}"
            if name in self.objects:
                raise ApiError(409, "AlreadyExists")
            self.objects[name] = body
            return body
        # A JSON patch, applied as the API server does: every test first, then the changes.
        assert method == "PATCH" and content_type == "application/json-patch+json", (method, content_type)
        if path not in self.objects:
            raise ApiError(404, "NotFound")
        obj = self.objects[path]
        for op in body:
            if op["op"] == "test" and _at(obj, op["path"]) != op["value"]:
                raise ApiError(422, "the server rejected our request: test operation failed")
        for op in body:
            if op["op"] in ("add", "replace"):
                *parents, last = _parts(op["path"])
                target = obj
                for p in parents:
                    target = target.setdefault(p, {})
                target[last] = op["value"]
        return obj


def _parts(pointer: str) -> list[str]:
    return [p.replace("~1", "/").replace("~0", "~") for p in pointer.lstrip("/").split("/")]


def _at(obj: Any, pointer: str) -> Any:
    for p in _parts(pointer):
        try:
            obj = obj[int(p)] if isinstance(obj, list) else obj[p]
        except (KeyError, IndexError, ValueError, TypeError):
            return None
    return obj


def token_in(kube: FakeKube, ns: str, cache: str) -> str:
    secret = kube.objects[f"/api/v1/namespaces/{ns}/secrets/{peer_secret_name(cache)}"]
    return base64.b64decode(secret["data"][PEER_TOKEN_KEY]).decode()


def test_the_secret_is_owned_by_its_cache_and_labelled():
    s = peer_secret("ml", "imagenet", "uid-1", "1.abc")
    assert s["metadata"]["name"] == "dscache-peer-imagenet" and s["metadata"]["namespace"] == "ml"
    assert s["metadata"]["labels"][PEER_TOKEN_LABEL] == "true"
    assert s["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    assert base64.b64decode(s["data"][PEER_TOKEN_KEY]) == b"1.abc"


def test_written_once_per_period_then_rotated():
    kube, tokens, t0 = FakeKube(), Tokens(), 1000 * TOKEN_PERIOD_S + 5.0
    asyncio.run(tokens.ensure(kube, KEY, "ml", "imagenet", "uid-1", t0))
    first = token_in(kube, "ml", "imagenet")
    assert check_peer_token(KEY, "ml", "imagenet", first, now=t0)
    calls = len(kube.calls)
    asyncio.run(tokens.ensure(kube, KEY, "ml", "imagenet", "uid-1", t0 + 60))
    assert len(kube.calls) == calls, "a second write within the period"
    # Next period: rewritten; the old token still opens (one period of overlap), not two periods on.
    t1 = t0 + TOKEN_PERIOD_S
    asyncio.run(tokens.ensure(kube, KEY, "ml", "imagenet", "uid-1", t1))
    second = token_in(kube, "ml", "imagenet")
    assert second != first and kube.calls[-1].startswith("PATCH")
    assert not any(c.startswith("GET") for c in kube.calls), "the controller may not read Secrets"
    assert check_peer_token(KEY, "ml", "imagenet", first, now=t1)
    assert not check_peer_token(KEY, "ml", "imagenet", first, now=t1 + TOKEN_PERIOD_S)


def test_no_key_writes_nothing_and_a_refusal_is_retried():
    kube, tokens = FakeKube(), Tokens()
    asyncio.run(tokens.ensure(kube, None, "ml", "c", "uid", 0.0))
    assert kube.calls == []
    kube.refuse = True
    asyncio.run(tokens.ensure(kube, KEY, "ml", "c", "uid", 0.0))
    kube.refuse = False
    asyncio.run(tokens.ensure(kube, KEY, "ml", "c", "uid", 1.0))
    assert check_peer_token(KEY, "ml", "c", token_in(kube, "ml", "c"), now=1.0)


def test_a_secret_of_that_name_that_is_not_ours_is_not_changed():
    kube, tokens = FakeKube(), Tokens()
    name = f"/api/v1/namespaces/ml/secrets/{peer_secret_name('c')}"
    kube.objects[name] = {"metadata": {"name": peer_secret_name("c")}, "data": {PEER_TOKEN_KEY: "theirs"}}
    asyncio.run(tokens.ensure(kube, KEY, "ml", "c", "uid", 0.0))
    assert kube.objects[name]["data"][PEER_TOKEN_KEY] == "theirs"


def test_recreated_cache_gets_its_token():
    """A cache deleted and created again under the same name, while garbage collection has not yet
    removed the old cache's Secret: the write finds the old Secret (409), and a patch of its token
    alone kept the old owner, so the collector deleted the Secret soon after, and the period was
    marked written: no token for up to 6 h. Now the Secret is moved to the new cache, and the
    write is checked again shortly (the collector may have been quicker)."""
    kube, tokens, t0 = FakeKube(), Tokens(), 1000 * TOKEN_PERIOD_S + 5.0
    asyncio.run(tokens.ensure(kube, KEY, "ml", "c", "uid-old", t0))
    name = f"/api/v1/namespaces/ml/secrets/{peer_secret_name('c')}"
    # Deleted and recreated (the controller may never see the deletion: two watch events apart).
    asyncio.run(tokens.ensure(kube, KEY, "ml", "c", "uid-new", t0 + 10))
    owners = kube.objects[name]["metadata"]["ownerReferences"]
    assert [o["uid"] for o in owners] == ["uid-new"], owners
    # The collector deleted the Secret anyway (its graph had not seen the patch): written again soon.
    del kube.objects[name]
    later = t0 + 10 + 120
    assert tokens.due("ml", "c", later, uid="uid-new"), "no token for the rest of the period"
    asyncio.run(tokens.ensure(kube, KEY, "ml", "c", "uid-new", later))
    assert check_peer_token(KEY, "ml", "c", token_in(kube, "ml", "c"), now=later)
    assert not tokens.due("ml", "c", later + 60, uid="uid-new")
