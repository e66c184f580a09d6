"""The step recovery's public names in one import, as they were before the recovery was split by class.

The code lives in :mod:`~retune.recovery.train_step` (:class:`TrainStepRecovery`, exact to the
unsplit step), :mod:`~retune.recovery.eval_step` (:class:`EvalStepRecovery`),
:mod:`~retune.recovery.micro_batches` (:class:`Recovered`, :func:`loss_weights`, what both share) and
:mod:`~retune.recovery.gradients` (:class:`FinishedGradients`); import from there in new code.
"""

from retune.recovery.eval_step import EvalStepRecovery
from retune.recovery.gradients import FinishedGradients
from retune.recovery.micro_batches import LossReduction, Recovered, loss_weights
from retune.recovery.train_step import TrainStepRecovery

__all__ = [
    "EvalStepRecovery",
    "FinishedGradients",
    "LossReduction",
    "Recovered",
    "TrainStepRecovery",
    "loss_weights",
]
