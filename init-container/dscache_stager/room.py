"""Ask the node agent for room under the node's byte budget before a cold copy.

The stager sees only its own cache dir; the agent sees the whole cacheRoot and
can evict copies nobody uses. Asked under C's lock (the agent checks that the
lock is held, i.e. that a copy is really in progress), before the first byte.
An agent that does not answer is not a reason to fail a Job: the free-space
check still runs, and the agent enforces its budget again when it is back.
"""

from __future__ import annotations

from dscache_contract import RESERVE_PATH, ReserveAnswer, ReserveRequest, human_bytes

from . import agentcall
from .errors import NoSpaceError
from .progress import Progress

TIMEOUT_S = 30.0  # evicting a large copy takes a while


def ask(
    agent: str,
    cache: str,
    revision: str,
    nbytes: int,
    progress: Progress,
    token: str = "",
    prestage: bool = False,
) -> ReserveAnswer | None:
    """Reserve ``nbytes`` for ``revision`` of ``cache`` (NAMESPACE/NAME), showing the cache's peer
    ``token`` (the agent evicts for no one else); raise NoSpaceError if it cannot fit even after
    eviction (``prestage``: evicting no pre-staged copy); None if the agent could not be asked."""
    namespace, name = cache.split("/", 1)
    body = ReserveRequest(namespace, name, revision, nbytes, prestage=prestage or None).to_json()
    try:
        answer = ReserveAnswer.from_json(agentcall.post(agent, RESERVE_PATH, body, TIMEOUT_S, token))
    except (OSError, ValueError, TypeError) as e:
        progress.note(f"the node agent at {agent} did not answer ({e}); checking free space only")
        return None
    if not answer.ok:
        raise NoSpaceError(answer.message)
    if answer.evicted:
        progress.note(
            f"the node agent evicted {len(answer.evicted)} unused copy(ies) to make room: {', '.join(answer.evicted)}"
        )
    progress.note(
        f"room reserved: {human_bytes(nbytes)} of the node's budget ({human_bytes(answer.available)} was available)"
    )
    return answer
