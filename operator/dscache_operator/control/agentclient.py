"""Ask a node's agent (``dscache-node``) to carry out one wipe: one HTTP request, its answer typed.

The node's agent does the wipe with the stager's own code, under the stagers'
flock: it deletes the leases of the pods the controller proved finished, then
removes the revision only if no lease remains (a lease the controller does not
know = a pod it has not seen yet = keep), taking its warm label off the Node
first. Answered when it is done: no helper pod to schedule, poll and delete,
and a restarted controller simply asks again. What the answer means is
nodeplan.judge_wipe's to say.
"""

from __future__ import annotations

import json

import aiohttp

import dscache_contract as contract

from ..cluster.nodes import NodeInfo
from ..settings import Settings
from .nodeplan import AgentFailed, Answer, NoAgent

TIMEOUT_S = 60.0  # removing a large tree takes a while


def agent_url(node: NodeInfo, settings: Settings) -> str | None:
    """The agent's address: its node's InternalIP (host network), and the port its label names."""
    if not node.agent or not node.address:
        return None
    port = node.agent_port or settings.agent_port
    host = f"[{node.address}]" if ":" in node.address else node.address
    return f"http://{host}:{port}"


def read_token(settings: Settings) -> str | None:
    if not settings.agent_token_file:
        return None
    try:
        with open(settings.agent_token_file) as f:
            return f.read().strip() or None
    except OSError:
        return None


async def wipe(node: NodeInfo | None, settings: Settings, req: contract.WipeRequest) -> Answer:
    url = agent_url(node, settings) if node is not None else None
    if url is None:
        return NoAgent()
    headers = {"Content-Type": "application/json"}
    token = read_token(settings)
    if token:
        headers["Authorization"] = f"Bearer {token}"
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT_S)) as session,
            session.post(url + contract.WIPE_PATH, data=req.to_json(), headers=headers) as resp,
        ):
            text = await resp.text()
    except (aiohttp.ClientError, TimeoutError, OSError) as e:
        return AgentFailed(f"the node agent at {url} did not answer ({e or type(e).__name__})")
    if resp.status == 409:
        return AgentFailed(text, busy=True)
    if resp.status != 200:
        return AgentFailed(f"the node agent at {url} answered HTTP {resp.status}: {text[:500]}")
    try:
        return contract.WipeSummary.from_dict(json.loads(text))
    except (ValueError, TypeError) as e:
        return AgentFailed(f"the node agent at {url} answered no wipe summary ({e})")
