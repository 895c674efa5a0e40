"""The node agent's CSI driver ``cache.dscache.io``: a pod's dscache volume, published as a bind
mount of the node's cache dir, with the lease held exactly as long as the mount.

    publish.py   the lease and the mount, idempotent, and what a restart reads back
    mounts.py    mount(2)/umount2(2) and the mount table
    services.py  the CSI Identity and Node services, and the kubelet's registration service
    server.py    the two unix sockets
    regen.py     the gRPC stubs in _gen/, generated from the vendored protos in proto/

May import: ``dscache_contract`` and the generated ``_gen``; never the rest of the agent
(the agent wires this in, passing its lock).
"""
