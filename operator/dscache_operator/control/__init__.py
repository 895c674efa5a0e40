"""The controller: the level-based reconciliation of each DatasetCache (reconcile.py), with
the pure planning it rests on (node copies and wipes, status, when the source is due) and
the I/O it drives (source listings, pre-staging pods, wipes by the node agents).

May import: ``api``, ``kube``, ``cluster``, ``metrics``, ``settings``, ``context``,
``dscache_contract``, and ``admission.injection``: pre-staging pods get exactly what the
webhook gives every consumer pod.
"""
