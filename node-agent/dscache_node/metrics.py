"""The agent's Prometheus metrics (GET /metrics on its port)."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge

from .budget import Room
from .disk import OnDisk


class AgentMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.budget = Gauge("dscache_node_budget_bytes", "The node's byte budget for copies", ["node"], registry=r)
        self.held = Gauge(
            "dscache_node_bytes_held", "Bytes held by copies on the node (complete + reserved)", ["node"], registry=r
        )
        self.leased = Gauge(
            "dscache_node_bytes_in_use", "Bytes of complete copies a pod holds a lease on", ["node"], registry=r
        )
        self.revisions = Gauge("dscache_node_revisions", "Revisions on the node", ["node", "state"], registry=r)
        self.evicted = Counter("dscache_node_evicted_bytes", "Bytes evicted to keep within the budget", registry=r)
        self.refused = Counter(
            "dscache_node_reservations_refused", "Copies refused because they would not fit", registry=r
        )

        self.peer_served = Counter(
            "dscache_node_peer_served_bytes", "Bytes of complete objects served to peer nodes' stagers", registry=r
        )
        self.peer_refused = Counter(
            "dscache_node_peer_refused_requests",
            "Object requests refused: no token, or not a consumer pod of that cache",
            registry=r,
        )
        self.requests = Counter(
            "dscache_node_requests",
            "Requests answered, by kind (objects, objects_probe, peers, listings, reserve, wipe, ...), status, "
            "and for an object not sent, why (its state: staging, absent, unclaimed)",
            ["route", "code", "state"],
            registry=r,
        )
        self.token_reviews = Counter(
            "dscache_node_token_reviews", "TokenReviews sent to the API server (a verified token is kept)", registry=r
        )
        self.token_local_checks = Counter(
            "dscache_node_token_local_checks",
            "Tokens checked by the agent itself against the API server's ServiceAccount keys, no TokenReview "
            "(a verified token is kept)",
            registry=r,
        )

    def observe(self, node: str, room: Room, revs: Iterable[OnDisk], evicted: int) -> None:
        revs = list(revs)
        self.budget.labels(node).set(room.budget)
        self.held.labels(node).set(room.held)
        self.leased.labels(node).set(sum(r.bytes for r in revs if r.complete and r.leases))
        self.revisions.labels(node, "complete").set(sum(1 for r in revs if r.complete))
        self.revisions.labels(node, "staging").set(sum(1 for r in revs if not r.complete))
