"""The Ray implementations of the cluster seams (cluster.placement = 'ray'): placement, ranks, mail,
weights, broadcast. Imported only when a run asks for Ray."""
