"""``retune.probing``: the prober, snapshots, probe batches and sample sizes."""
