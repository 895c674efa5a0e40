"""The mutating admission webhook: its HTTPS server, its decisions, and the pure builders
of what it adds to a pod (the stager init container, the volume, warm-node placement).

May import: ``api``, ``kube``, ``cluster``, ``settings``, ``context``, ``dscache_contract``.
Never ``control``: the webhook keeps admitting pods while the controller is down.
"""
