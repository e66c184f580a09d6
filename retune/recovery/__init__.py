"""Recover a real step that ran out of memory by running the same batch in micro-batches.

* :mod:`~retune.recovery.train_step`: the training step's recovery, exact to the unsplit step;
* :mod:`~retune.recovery.eval_step`: the evaluation steps' recovery (validation, test, predict);
* :mod:`~retune.recovery.micro_batches`: what both share: micro-batch sizes, their loss weights, the
  split kept for the rest of the loop, the ``Recovered`` report;
* :mod:`~retune.recovery.gradients`: which gradients a failed backward finished, and those set aside;
* :mod:`~retune.recovery.exactness`: the check at fit start that a recovered step would be exact;
* :mod:`~retune.recovery.split`: split a batch along its batch dimension and join the outputs;
* :mod:`~retune.recovery.oom_sites`: where in a step the error was raised, and whether a split helps;
* :mod:`~retune.recovery.loss_items`: what a token-mean loss averages over, per micro-batch;
* :mod:`~retune.recovery.running_stats`: BatchNorm statistics around a step that failed;
* :mod:`~retune.recovery.step_rng`: torch's random generators, rewound for each attempt at a step;
* :mod:`~retune.recovery.step_recovery`: the public names of the four first in one import (the
  module they lived in until issue 30).
"""

__all__ = [
    "eval_step",
    "exactness",
    "gradients",
    "loss_items",
    "micro_batches",
    "oom_sites",
    "running_stats",
    "split",
    "step_recovery",
    "step_rng",
    "train_step",
]
