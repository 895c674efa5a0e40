"""Ask a node's agent (``dscache-node``) to carry out one wipe: one HTTP request, its answer typed.

The node's agent does the wipe with the stager's own code, under the stagers'
flock: it deletes the leases of the pods the controller proved finished, then
removes the revision only if no lease remains (a lease the controller does not
know = a pod it has not seen yet = keep), taking its warm label off the Node
first. Answered when it is done: no helper pod to schedule, poll and delete,
and a restarted controller simply asks again. What the answer means is
nodeplan.judge_wipe's to say.

The request carries the controller's token for that node only (agenttokens.py), and
goes over TLS when the chart gave the agents a certificate (``agent_ca_file``: the
CA; the certificate is checked for ``AGENT_TLS_NAME``, whatever IP the node has).
"""

from __future__ import annotations

import functools
import json
import os
import ssl

import aiohttp

import dscache_contract as contract
from dscache_contract.peers import AGENT_TLS_NAME

from ..cluster.nodes import NodeInfo
from ..kube.client import Kube
from ..settings import Settings
from .agenttokens import AgentTokenError, AgentTokens
from .nodeplan import AgentFailed, Answer, NoAgent

TIMEOUT_S = 60.0  # removing a large tree takes a while


def agent_url(node: NodeInfo, settings: Settings) -> str | None:
    """The agent's address: its node's InternalIP (host network), and the port its label names."""
    if not node.agent or not node.address:
        return None
    port = node.agent_port or settings.agent_port
    host = f"[{node.address}]" if ":" in node.address else node.address
    return f"{'https' if settings.agent_ca_file else 'http'}://{host}:{port}"


@functools.lru_cache(maxsize=4)
def _tls(ca_file: str, mtime: float) -> ssl.SSLContext:
    """A client context trusting the agents' CA (one per version of the file: a renewed CA is read)."""
    return ssl.create_default_context(cafile=ca_file)


def tls_context(settings: Settings) -> ssl.SSLContext | None:
    if not settings.agent_ca_file:
        return None
    return _tls(settings.agent_ca_file, os.stat(settings.agent_ca_file).st_mtime)


async def wipe(
    node: NodeInfo | None, settings: Settings, req: contract.WipeRequest, kube: Kube, tokens: AgentTokens
) -> Answer:
    url = agent_url(node, settings) if node is not None else None
    if url is None or node is None:
        return NoAgent()
    try:
        token = await tokens.token(kube, settings.namespace, settings.service_account, node.name)
        tls = tls_context(settings)
    except (AgentTokenError, OSError) as e:
        return AgentFailed(f"cannot call the node agent at {url}: {e}")
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {token}"}
    # The agent's certificate names AGENT_TLS_NAME, not its node's IP: aiohttp checks the name
    # given as server_hostname (SNI), so the IP stays in the URL.
    ssl_arg: ssl.SSLContext | bool = tls if tls is not None else True
    name = AGENT_TLS_NAME if tls is not None else None
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT_S)) as session,
            session.post(
                url + contract.WIPE_PATH, data=req.to_json(), headers=headers, ssl=ssl_arg, server_hostname=name
            ) as resp,
        ):
            text = await resp.text()
    except (aiohttp.ClientError, TimeoutError, OSError) as e:
        return AgentFailed(f"the node agent at {url} did not answer ({e or type(e).__name__})")
    if resp.status in (401, 403):
        tokens.forget(node.name)  # e.g. the token was refused: a fresh one next time
    if resp.status == 409:
        return AgentFailed(text, busy=True)
    if resp.status != 200:
        return AgentFailed(f"the node agent at {url} answered HTTP {resp.status}: {text[:500]}")
    try:
        return contract.WipeSummary.from_dict(json.loads(text))
    except (ValueError, TypeError) as e:
        return AgentFailed(f"the node agent at {url} answered no wipe summary ({e})")
