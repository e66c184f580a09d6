"""``retune.search``: the largest and throughput algorithms and the policies."""
