"""Probes: real training steps at a candidate size, with the run left exactly as it was.

* :mod:`~retune.probing.prober`: one trial (steps, peak memory, time) around a snapshot;
* :mod:`~retune.probing.snapshot`: capture what a probe can change and put it back bit for bit;
* :mod:`~retune.probing.host_copy`: host copies of many tensors in one allocation;
* :mod:`~retune.probing.timing`: wall-clock timing of probe steps with the device synchronised;
* :mod:`~retune.probing.probe_batches`: which samples a probe's batches hold (``probe_samples``);
* :mod:`~retune.probing.sample_sizes`: how big a sample is, and which are the largest;
* :mod:`~retune.probing.batch_size_attr`: the loader's batch size and duplicate attributes.
"""

__all__ = ["batch_size_attr", "host_copy", "probe_batches", "prober", "sample_sizes", "snapshot", "timing"]
