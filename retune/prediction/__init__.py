"""Predict a training step's peak memory at any batch size without running its compute (preview).

A search probes real training steps, and every probe costs a real step at a candidate size. But the
memory of a step is decided by shapes, not values: PyTorch's fake tensors
(``torch._subclasses.fake_tensor.FakeTensorMode``) run every operator's shape function and allocate
nothing, so the run's own training step, traced on fakes at any size, shows the storages it would
allocate and free. This package turns that into numbers a search can use; it is not wired into the
search yet (that is the rest of issue 29: predict, then verify each size with a real probe).

* :mod:`~retune.prediction.trace`: one step traced at a size, its peak read by the probes' own CPU
  tracker, so a prediction is the quantity a CPU probe measures; the run left exactly as it was;
  where the step cannot be traced (a data-dependent operator, a custom kernel), a typed
  :class:`~retune.prediction.trace.CannotPredict` with the reason instead of an exception;
* :mod:`~retune.prediction.fake_state`: fakes of the parameters, buffers and optimizer state, made
  from the real ones without copying their data, and swapped in for the trace;
* :mod:`~retune.prediction.fake_batch`: a fake batch of any size from one real batch of its kind;
* :mod:`~retune.prediction.fit`: the peak line in the batch size (per bucket: in batch x sample size)
  from traces, and the calibration of predicted to measured from real probes.

Example:
    >>> import torch
    >>> from torch import nn
    >>> model = nn.Linear(256, 256)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> def step(batch, optimizers):
    ...     optimizers[0].zero_grad(set_to_none=True)
    ...     model(batch).square().mean().backward()
    ...     optimizers[0].step()
    >>> traces = [trace_step(model, [opt], torch.zeros(8, 256), size, step) for size in (1024, 4096)]
    >>> line = fit_line([(t.size, t.peak_bytes) for t in traces])
    >>> line.per_sample / (256 * 4)   # float32 rows of 256 per sample: the output, its square, backward's temporaries
    5.0
    >>> model.weight.grad is None   # the real module was not touched
    True
"""

from retune.prediction.fit import Calibration, PeakLine, calibrate, fit_buckets, fit_line
from retune.prediction.trace import CannotPredict, StepTrace, trace_step, trace_training_step

__all__ = [
    "Calibration",
    "CannotPredict",
    "PeakLine",
    "StepTrace",
    "calibrate",
    "fit_buckets",
    "fit_line",
    "trace_step",
    "trace_training_step",
]
