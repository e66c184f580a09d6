"""A rank's peak under FSDP2 from a trace of the unsharded step. Pure arithmetic over the trace's numbers.

The trace (:func:`retune.prediction.trace.trace_step`) runs the plain module on the rank's batch with whole
parameters, gradients and optimizer state (FSDP2's hooks are out of the way), so what grows with the batch
(activations, their temporaries) is what the rank computes, and what does not is counted whole. A rank's
step peaks at one of two moments, which hold different state:

- **forward and backward** (:attr:`~retune.prediction.trace.StepTrace.compute_bytes`): the rank's shards of
  the parameters and state instead of the whole ones, plus the groups FSDP2 has gathered whole at that point
  (``gathered`` of :class:`retune.distributed.fsdp2.ShardAccount`), plus this rank's part of the state a first
  update creates (alive in every later step, as :attr:`~retune.prediction.trace.StepTrace.steady_bytes` counts
  it), plus what FSDP2 allocates to reduce a group's gradients (``reducing``: the largest group's). The trace
  counts each gradient whole when backward makes it and as the rank's shard once it is accumulated
  (``reduced_gradients`` of :func:`~retune.prediction.trace.trace_step`), as FSDP2 reduce-scatters each group
  during backward. Three accounts were measured on 2 ranks of 4 ``Linear(512, 512)`` at 2 to 1,024 samples
  (tests/fsdp2/run_rank_peak.py) and on the Lightning run of tests/distributed/test_fsdp2.py: the gradients
  whole to the end (the first design: the traced peak then falls at the end of backward, where a rank holds
  shards; float32 +9% to 0%, bfloat16 -3% to -9%: under), the reduce-scatter's buffers added when a group's
  last gradient is made (float32 -4% to +9%, bfloat16 -3% to +10%: under at 256 and 1,024 samples), and this
  one, never under: float32 0% to +5%, bfloat16 0% to +5%, the Lightning run up to +11%, one rank up to
  +17% (the largest group reduces late in backward there, when activations are freed);
- **the optimizer update** (:attr:`~retune.prediction.trace.StepTrace.update_start_bytes` and the update's
  phase): every group resharded, the gradients reduce-scattered to shards, and the update's temporaries and
  new state this rank's fraction of the whole.

The larger of the two is the rank's peak. What stays an estimate is what FSDP2 has gathered and how many
gradients it still holds whole at the compute peak; the verifying probes measure the truth, and their
calibration corrects a constant error.

>>> from retune.distributed.fsdp2 import ShardAccount
>>> from retune.prediction.trace import OptimizerPhase, StepTrace
>>> trace = StepTrace(8, peak_bytes=1900, resident_bytes=1000, steps=1, seconds=0.0, created_bytes=400,
...                   optimizer=OptimizerPhase(extra_bytes=600, created_bytes=400),
...                   compute_bytes=1900, update_start_bytes=1300)
>>> account = ShardAccount(resident=500, gradients=150, fraction=0.5, gathered=120, reducing=60)
>>> rank_peak(trace, account, whole_gradients=300)   # compute: 900 + 500 + 120 + 60 + 200; update: 0 + 500 + 150 + 300
1780.0
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from retune.distributed.fsdp2 import ShardAccount

if TYPE_CHECKING:  # the trace imports fake tensors, which an old torch lacks: this module stays importable
    from retune.prediction.trace import StepTrace

__all__ = ["rank_peak"]


def rank_peak(trace: StepTrace, account: ShardAccount, whole_gradients: int) -> float:
    """The rank's peak bytes of the traced step (the module doc's two moments), without the batch's own bytes.

    ``whole_gradients``: the bytes of the gradients the trace holds at the update's start (every trainable
    parameter's, as the trace counted them: whole, or the rank's shards where it counted ``reduced_gradients``);
    the rank holds its shards (``account.gradients``).
    """
    fraction = account.fraction
    # the state the update creates is alive in every later step's compute: traced with two steps the second
    # holds it whole (counted in compute_bytes), with one it does not yet; a rank holds its share
    held = trace.created_bytes if trace.steps > 1 else 0
    gathered = account.gathered + account.reducing  # what FSDP2 holds for its collectives at the compute peak
    compute = trace.compute_bytes - held - trace.resident_bytes + account.resident + gathered
    compute_rank = compute + trace.created_bytes * fraction
    if trace.optimizer is None:
        return float(compute_rank)
    kept = trace.update_start_bytes - trace.resident_bytes - whole_gradients  # what else the step kept alive
    update = max(0, kept) + account.resident + account.gradients + trace.optimizer.extra_bytes * fraction
    return float(max(compute_rank, update))
