"""Recover a real step that ran out of memory by running the same batch in micro-batches.

* :mod:`~retune.recovery.step_recovery`: train- and eval-step recovery, exact to the unsplit step;
* :mod:`~retune.recovery.split`: split a batch along its batch dimension and join the outputs;
* :mod:`~retune.recovery.oom_sites`: where in a step the error was raised, and whether a split helps;
* :mod:`~retune.recovery.loss_items`: what a token-mean loss averages over, per micro-batch;
* :mod:`~retune.recovery.running_stats`: BatchNorm statistics around a step that failed.
"""

__all__ = ["loss_items", "oom_sites", "running_stats", "split", "step_recovery"]
