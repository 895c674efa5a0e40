"""The controller's tokens for the node agents: one per node, of its own ServiceAccount.

There is no shared key any more (docs/security.md). Each agent takes wipes only from
a token the API server vouches for (TokenReview) as the controller's ServiceAccount,
for the audience ``agent_audience(<that node>)``; the controller asks for such a token
(TokenRequest on its own ServiceAccount, ``TOKEN_SECONDS``) when it first calls a node
and keeps it until ``RENEW_BEFORE_S`` before it expires. An agent that keeps the token
it was shown can use it on no other node.

(Until issue 29 this module wrote each cache's HMAC peer token into a Secret; those
Secrets, owned by their caches, are left to the garbage collector and read by nobody.)
"""

from __future__ import annotations

import time
from collections.abc import Callable

from dscache_contract.peers import agent_audience

from ..cluster.identity import token_request
from ..kube.client import Kube

#: The tokens' lifetime (the API server's minimum is 600 s).
TOKEN_SECONDS = 600
#: A token is asked for again this long before it expires (a wipe may take a minute).
RENEW_BEFORE_S = 180.0
#: Tokens kept at most (one per node called lately); the oldest goes first.
MOST = 4096


class AgentTokenError(Exception):
    """The API server gave no token (RBAC, or it is down): no wipe can be sent now."""


class AgentTokens:
    """The controller's per-node tokens for its agents, asked for on first use and kept."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self._tokens: dict[str, tuple[str, float]] = {}
        #: TokenRequests made (tests: a kept token costs none).
        self.requests = 0

    async def token(self, kube: Kube, namespace: str, service_account: str, node: str) -> str:
        """A token of ``namespace/service_account`` for the agent of ``node``; AgentTokenError if none."""
        now = self.clock()
        got = self._tokens.get(node)
        if got is not None and got[1] - RENEW_BEFORE_S > now:
            return got[0]
        path = f"/api/v1/namespaces/{namespace}/serviceaccounts/{service_account}/token"
        try:
            answer = await kube.request("POST", path, token_request(agent_audience(node), TOKEN_SECONDS))
        except Exception as e:  # ApiError, or the API server is not reachable
            raise AgentTokenError(f"no token of {namespace}/{service_account} for node {node}'s agent: {e}") from e
        self.requests += 1
        token = str(((answer or {}).get("status") or {}).get("token") or "")
        if not token:
            raise AgentTokenError(f"the API server returned no token of {namespace}/{service_account}")
        if len(self._tokens) >= MOST:
            self._tokens.pop(next(iter(self._tokens)))
        self._tokens[node] = (token, now + TOKEN_SECONDS)
        return token

    def forget(self, node: str) -> None:
        self._tokens.pop(node, None)
