"""What the operator reads of the cluster: typed, read-only extracts of DatasetCaches,
Nodes, consumer pods and their owners (pure), and the informer-backed views that hold them.

May import: ``api``, ``kube``, ``dscache_contract``.
"""
