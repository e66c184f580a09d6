"""Run a learning-rate range test on real training steps, and leave the run as it was.

The steps are the batch-size probe's (:func:`retune.compat.training_step`): batches from the user's
``train_dataloader()`` at the size in use now, through the transfer hooks, forward, backward and
optimizer step under the trainer's strategy and precision, with callbacks, loggers and ``self.log``
hidden (:func:`retune.compat.hooks_isolated`). Before the first step the state a step can change is
captured (:func:`retune.probing.prober.capture_run_state`: weights, optimizer state and learning rates, LR
schedulers, grad scaler, loop counters, RNG) and put back at the end, also when a step raises, so
the run continues bit-identical to one that never ran the test. The run's own dataloader iterator
is never touched: the test draws from a loader of its own, and the sampler's generator is put back.

Under DDP each rank trains on its own batches; after backward the gradients are averaged across
ranks (the update a DDP step makes), each rank's status riding in the same all-reduce, so a rank
whose step fails cannot leave the others waiting. After every step the ranks exchange their losses
and errors in one collective: the curve is the mean loss over ranks, identical on every rank, so
every rank stops at the same step and computes the same suggestion.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch

from retune import compat
from retune.distributed.grad_sync import all_reduce_gradients
from retune.errors import RetuneError
from retune.lr.range_test import RangeTest
from retune.oom import clear_device_cache, clear_frame_locals, is_oom_error
from retune.probing.batch_size_attr import loader_batch_size
from retune.probing.prober import capture_run_state
from retune.probing.snapshot import sampler_generators


def run_range_test(
    trainer: Any,
    pl_module: Any,
    groups: list[int],
    test: RangeTest,
    on_step: Callable[[int, float, float], None] | None = None,
) -> tuple[float, int | None]:
    """Run ``test`` with the learning rate of the optimizer's ``groups`` swept.

    Returns the seconds it took and the batch size of the loader it drew from (None when unknown).

    Each step ``i`` sets ``lr = test.lrs[i]`` on the chosen groups (the others keep theirs), runs one
    batch, and records the loss (mean over ranks); the test stops when :meth:`RangeTest.record` says
    so. Every change is undone before returning, including when a step raises.
    """
    started = time.perf_counter()
    optimizer = trainer.optimizers[0]
    distributed = compat.is_distributed(trainer)
    snapshot = capture_run_state(trainer, pl_module)
    generators: list[tuple[torch.Generator, torch.Tensor]] = []
    batches = None
    batch_size: int | None = None
    try:
        loader = compat.request_dataloader(trainer, "train")
        batch_size = loader_batch_size(loader)
        generators = [(g, g.get_state()) for g in sampler_generators(loader)]
        batches = compat.probe_batches(trainer, "train", loader, len(test.lrs))
        with compat.hooks_isolated(trainer, pl_module, "train"):
            for step, lr in enumerate(test.lrs):
                for index in groups:
                    optimizer.param_groups[index]["lr"] = lr
                loss = _one_step(trainer, pl_module, batches, distributed, step, lr)
                if on_step is not None:
                    on_step(step, lr, loss)
                if test.record(loss):
                    break
    finally:
        if batches is not None:
            batches.close()
        for opt in trainer.optimizers:
            opt.zero_grad(set_to_none=True)
        snapshot.restore()
        for generator, state in generators:
            generator.set_state(state)
    return time.perf_counter() - started, batch_size


def _one_step(trainer: Any, pl_module: Any, batches: Any, distributed: bool, step: int, lr: float) -> float:
    """One batch at ``lr``; its loss, averaged over ranks. An error on any rank is raised on all of them."""
    # manual optimization steps the optimizer inside training_step, where no closure can be wrapped:
    # under DDP its range test runs each rank on its own gradients (the losses are still averaged)
    sync = _GradientSync(trainer, pl_module) if distributed and pl_module.automatic_optimization else None
    error: BaseException | None = None
    loss: float = math.nan
    try:
        raw, batch_idx, _ = next(batches)
        batch = compat.batch_to_device(trainer, pl_module, raw, None)
        if pl_module.automatic_optimization:  # one update per rate: no gradient of the rate before (accumulation)
            for optimizer in trainer.optimizers:
                optimizer.zero_grad(set_to_none=True)
        value = compat.training_step(
            trainer, pl_module, batch, batch_idx, wrap_closure=None if sync is None else sync.wrap
        )
        if value is None:
            raise RetuneError(
                f"training_step returned no loss at step {step + 1} of the learning-rate range test; the test needs "
                "the loss of every step (return the loss tensor, or a dict with a 'loss' key)"
            )
        loss = float(value.detach().float().item())
    except BaseException as exc:  # every rank must reach the collectives below, whatever failed
        error = exc
        if is_oom_error(exc):
            clear_frame_locals(exc)  # raised to the user below, without the failed step's tensors
        if sync is not None and not sync.done:
            sync.join_failed()
    if error is not None and is_oom_error(error):
        clear_device_cache()  # the failed step's blocks, before the snapshot is restored and the error raised
    message = "" if error is None else f"{type(error).__name__}: {error}"
    outcomes = compat.all_gather_object(trainer, (loss, message))
    failed = [(rank, text) for rank, (_, text) in enumerate(outcomes) if text]
    if failed:
        if error is not None:
            raise error
        rank, text = failed[0]
        where = f"step {step + 1} of the learning-rate range test (lr={lr:.3g})"
        raise RetuneError(f"rank {rank} failed at {where}: {text}")
    losses = [float(value) for value, _ in outcomes]
    return sum(losses) / len(losses)


class _GradientSync:
    """Average gradients across ranks between backward and the optimizer step (before clipping), as DDP would.

    The range-test steps run the unwrapped module with DDP's reducer kept out (no collective inside
    backward), so without this each rank would step on its own gradient, a noisier update than the
    run's, and diverge at a lower rate than the run would.
    """

    def __init__(self, trainer: Any, pl_module: Any) -> None:
        self.params = [p for p in pl_module.parameters() if p.requires_grad]
        self.world_size = int(trainer.world_size)
        self.done = False

    def wrap(self, closure: Callable[[], torch.Tensor | None]) -> Callable[[], torch.Tensor | None]:
        def synced() -> torch.Tensor | None:
            error: BaseException | None = None
            result = None
            try:
                result = closure()
            except BaseException as exc:
                error = exc
            self.done = True
            # when another rank failed, the gradients stay local: the step is thrown away (the state is
            # restored) and the exchange after the step raises that rank's error here too
            all_reduce_gradients(self.params, error is not None, self.world_size)
            if error is not None:
                raise error
            return result

        return synced

    def join_failed(self) -> None:
        """This rank failed before its closure ran: take part in the gradient all-reduce, reporting the failure."""
        self.done = True
        all_reduce_gradients(self.params, True, self.world_size)


__all__ = ["run_range_test"]
