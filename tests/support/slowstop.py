"""The operator's entry point with kopf's shutdown made slow on purpose (tests only).

    python -m tests.support.slowstop SECONDS controller

runs ``python -m dscache_operator controller`` unchanged, except that every kopf registry
starts with one extra ``on.cleanup`` handler that sleeps SECONDS. kopf runs cleanup handlers
one after the other in the order they were registered, so this one runs before dscache's
own and holds the process in its shutdown, alive and connected, for that long: the stand-in
for what makes a real shutdown slow (kopf waiting for its root and core tasks, in-flight
work, a loaded node). A Lease handover that waits for kopf's cleanup shows up as seconds
of renewals after SIGTERM; one done on the signal does not.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from typing import Any

import kopf


def _registry_with_slow_cleanup(seconds: float) -> Any:
    plain = kopf.OperatorRegistry

    def make() -> kopf.OperatorRegistry:
        registry = plain()

        @kopf.on.cleanup(registry=registry, id="test-slow-cleanup")
        async def slow_cleanup(**_: Any) -> None:
            logging.getLogger("dscache.test").warning(f"slow cleanup: {seconds} s")
            await asyncio.sleep(seconds)

        return registry

    return make


def main() -> int:
    seconds = float(sys.argv[1])
    kopf.OperatorRegistry = _registry_with_slow_cleanup(seconds)  # type: ignore[misc]  # the point of this module
    from dscache_operator.__main__ import main as operator_main

    return operator_main(sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
