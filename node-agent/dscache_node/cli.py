"""``dscache-node``: the node agent's process (one per node, from the chart's DaemonSet)."""

from __future__ import annotations

import logging
import signal
import sys
import threading
from typing import Any

from .agent import Agent
from .auth import Gate, Reviews
from .kube import Kube
from .metrics import AgentMetrics
from .pods import watch_forever
from .server import make_server, tls_context
from .settings import AgentSettings

log = logging.getLogger("dscache-node")


def main() -> int:
    try:
        settings = AgentSettings.from_env()
    except (ValueError, KeyError) as e:
        print(f"dscache-node: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.log_level, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stderr)

    kube = Kube.from_env()
    agent = Agent(settings, kube, AgentMetrics())
    stop = threading.Event()
    # The disk first: labels and inventory are recomputed from it before anything is served,
    # so a restarted agent neither loses nor invents state.
    agent.refresh()
    log.info(
        f"node {settings.node}: cacheRoot {settings.cache_root}, budget {settings.budget}, "
        f"headroom {settings.headroom}, at most {settings.max_labels} warm labels; serving on :{settings.port}"
    )
    csi_server = start_csi(settings, agent) if settings.csi else None
    threading.Thread(target=watch_forever, args=(kube, settings.node, agent.pods, stop), daemon=True).start()

    def loop() -> None:
        while not stop.wait(settings.scan_interval):
            try:
                agent.refresh()
            except Exception as e:  # keep going: the next pass reads the disk afresh
                log.warning(f"refresh failed: {e}")

    threading.Thread(target=loop, daemon=True).start()
    tls = tls_context(settings.tls_cert, settings.tls_key or settings.tls_cert) if settings.tls_cert else None
    if tls is None:
        log.warning("no serving certificate (DSCACHE_AGENT_TLS_CERT): peers' bytes and tokens go in clear HTTP")
    gate = Gate(kube, settings.node, settings.controller_user, reviews=Reviews(kube, local=settings.local_token_check))
    gate.reviews.on_review = agent.metrics.token_reviews.inc
    gate.reviews.on_local = agent.metrics.token_local_checks.inc
    server = make_server(agent, gate, settings.port, tls=tls)

    def on_term(*_: object) -> None:
        stop.set()
        if csi_server is not None:
            csi_server.stop(grace=5)
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    server.serve_forever()
    return 0


def start_csi(settings: AgentSettings, agent: Agent) -> Any:
    """The CSI driver: read the published volumes back, then serve the kubelet (csi/server.py)."""
    from .csi.mounts import LibcMounter
    from .csi.publish import Publisher
    from .csi.server import serve

    publisher = Publisher(settings.cache_root, settings.kubelet_dir, settings.stager_uid, LibcMounter(), agent.lock)
    kept, removed = publisher.recover()
    log.info(f"CSI: {kept} published volume(s) read back, {removed} lease(s) of no mount released")
    server, _ = serve(settings.kubelet_dir, settings.node, publisher, settings.version)
    log.info(f"CSI driver serving under {settings.kubelet_dir}")
    return server


def entry() -> None:
    sys.exit(main())
