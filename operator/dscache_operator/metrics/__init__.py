"""Prometheus metrics of both roles (prometheus_client, on a registry per process), and the
controller's per-cache series.

May import: ``api``, ``cluster``, ``version``, ``dscache_contract``.
"""
