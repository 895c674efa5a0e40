"""agenttokens.py: the controller's per-node tokens for the agents (a fake API: records TokenRequests)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from dscache_contract.peers import agent_audience
from dscache_operator.control.agenttokens import RENEW_BEFORE_S, TOKEN_SECONDS, AgentTokenError, AgentTokens
from dscache_operator.kube.client import ApiError

NOW = 1_800_000_000.0


class FakeKube:
    def __init__(self) -> None:
        self.calls: list[tuple[str, list[str], int]] = []
        self.refuse = False

    async def request(self, method: str, path: str, body: Any = None, **_: Any) -> dict[str, Any]:
        if self.refuse:
            raise ApiError(403, "forbidden")
        spec = body["spec"]
        self.calls.append((path, spec["audiences"], spec["expirationSeconds"]))
        return {"status": {"token": f"token-{len(self.calls)}"}}


class Clock:
    t = NOW

    def __call__(self) -> float:
        return self.t


def test_one_token_per_node_for_its_own_audience_kept_until_renewal():
    kube, clock = FakeKube(), Clock()
    tokens = AgentTokens(clock)

    def token(node: str) -> str:
        return asyncio.run(tokens.token(kube, "dscache-system", "dscache-controller", node))  # type: ignore[arg-type]

    assert token("n1") == token("n1") == "token-1"
    assert token("n2") == "token-2"
    path = "/api/v1/namespaces/dscache-system/serviceaccounts/dscache-controller/token"
    assert kube.calls == [
        (path, [agent_audience("n1")], TOKEN_SECONDS),
        (path, [agent_audience("n2")], TOKEN_SECONDS),
    ]
    clock.t = NOW + TOKEN_SECONDS - RENEW_BEFORE_S  # renewed before it expires
    assert token("n1") == "token-3"
    tokens.forget("n2")  # e.g. the agent refused it
    assert token("n2") == "token-4"


def test_no_token_is_an_error_not_a_wipe_without_one():
    kube = FakeKube()
    kube.refuse = True
    with pytest.raises(AgentTokenError, match="no token"):
        asyncio.run(AgentTokens().token(kube, "dscache-system", "dscache-controller", "n1"))  # type: ignore[arg-type]
