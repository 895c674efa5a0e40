"""dscache-node: the node agent that owns one node's cacheRoot (inventory, labels, wipes, budget)."""
