"""Gradient synchronisation that a rank running out of memory cannot hang: DDP's all-reduce, done after backward.

DDP all-reduces gradient buckets *inside* backward. When one rank runs out of memory in its
forward or backward, the other ranks sit in those collectives waiting for it, and the failed rank
cannot re-run its batch in micro-batches through the same reducer (it is half-way through a pass).
With the ``oom`` trigger under DDP retune therefore switches DDP's reducer off for training steps
(``require_backward_grad_sync = False``, what ``no_sync()`` does) and synchronises once per
optimizer step, after every rank has its complete local gradient — recovered or not:

* one all-reduce per bucket of about 25 MiB (DDP's default bucket size), averaged as DDP does;
* the first bucket also carries each rank's status (0, or 1 when its step failed), so an error on
  one rank is raised on every rank instead of leaving them waiting — no extra collective;
* a parameter whose gradient is ``None`` on every rank stays ``None`` (frozen or unused);
* buffers (BatchNorm statistics) are then broadcast from rank 0, what DDP does before each forward.

On the steps of an accumulation window that do not step the optimizer only the status is agreed
(one single-element all-reduce), so a failure inside a window cannot strand the other ranks either.

The status may carry a few integers per rank more (:class:`StepNews`, no extra collective): what a rank's
recovery learned in this step (the batch size that ran out of memory, the split that trained it), so every
rank — rank 0, whose callback state Lightning checkpoints, included — knows it from that step on.

What it costs: the all-reduce no longer overlaps with backward as DDP's buckets do. See
docs/guides/oom.md ("What it costs") for measured numbers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

from retune.errors import RetuneError

BUCKET_BYTES = 25 * 1024 * 1024


class StepNews(Protocol):
    """What each rank tells the others in a step's agreement: ``width`` non-negative integers (all zeros: nothing).

    ``local()`` is this rank's, read after its step ran; ``agreed(rows)`` gets every rank's, in rank order, on
    every rank, once the step's status is agreed and no rank failed."""

    width: int

    def local(self) -> Sequence[int]: ...

    def agreed(self, rows: list[list[int]]) -> None: ...


NEWS_RADIX = 1 << 20
"""Each integer of the news travels as two float32 values below ``NEWS_RADIX`` (exact: one rank writes a slot, the
others add zeros), so values up to 2**40 come through the float32 all-reduce unchanged."""


def encode_news(values: Sequence[int], rank: int, world_size: int, width: int) -> list[float]:
    """``values`` (``width`` non-negative ints) in ``rank``'s slot of every rank's slots, the others zeros.

    >>> encode_news([3, (1 << 20) + 5], rank=1, world_size=2, width=2)
    [0.0, 0.0, 0.0, 0.0, 0.0, 3.0, 1.0, 5.0]
    """
    if len(values) != width or any(int(v) < 0 for v in values):
        raise ValueError(f"step news must be {width} non-negative integers, got {list(values)!r}")
    slots = [0.0] * (2 * width * world_size)
    for i, value in enumerate(values):
        high, low = divmod(int(value), NEWS_RADIX)
        slots[2 * (rank * width + i)] = float(high)
        slots[2 * (rank * width + i) + 1] = float(low)
    return slots


def decode_news(summed: torch.Tensor, world_size: int, width: int) -> list[list[int]]:
    """Every rank's integers from the summed slots :func:`encode_news` filled, in rank order.

    >>> decode_news(torch.tensor([0.0, 7.0, 0.0, 0.0, 0.0, 3.0, 1.0, 5.0]), world_size=2, width=2)
    [[7, 0], [3, 1048581]]
    """
    flat = [round(float(v)) for v in summed.tolist()]
    values = [flat[2 * i] * NEWS_RADIX + flat[2 * i + 1] for i in range(width * world_size)]
    return [values[rank * width : (rank + 1) * width] for rank in range(world_size)]


def agree_status(failed: bool, device: torch.device, group: Any = None, extra: torch.Tensor | None = None) -> int:
    """How many ranks failed (every rank gets the same answer); one all-reduce of one element, plus ``extra``
    (float32 values summed over the ranks with it, in place) where given."""
    status = torch.tensor([1.0 if failed else 0.0], device=device)
    if extra is not None:
        status = torch.cat([status, extra.to(device=device, dtype=torch.float32)])
    dist.all_reduce(status, group=group)
    if extra is not None:
        extra.copy_(status[1:].to(extra.device))
    return int(status[0].item())


def all_reduce_gradients(
    params: Sequence[torch.nn.Parameter],
    failed: bool,
    world_size: int,
    group: Any = None,
    bucket_bytes: int = BUCKET_BYTES,
    extra: torch.Tensor | None = None,
) -> int:
    """Average the gradients of ``params`` over all ranks; return how many ranks failed.

    Every rank must pass the same parameters in the same order (a module's ``parameters()`` are).
    When any rank failed, no gradient is changed and the count is returned after the first bucket.
    ``extra``: float32 values summed over the ranks in place, carried by the first bucket (no extra collective).
    """
    params = [p for p in params if p.requires_grad]
    device = params[0].device if params else torch.device("cpu")
    carried = 0 if extra is None else extra.numel()
    flags = torch.zeros(1 + len(params) + carried, device=device, dtype=torch.float32)
    flags[0] = 1.0 if failed else 0.0
    for i, p in enumerate(params):
        if p.grad is not None:
            flags[1 + i] = 1.0
    if extra is not None:
        flags[1 + len(params) :] = extra.reshape(-1).to(device=device, dtype=torch.float32)
    buckets = _buckets(params, bucket_bytes)
    first = buckets[0] if buckets else []
    flat = torch.cat([flags, *(_flat_grad(p) for p in first)]) if first else flags
    dist.all_reduce(flat, group=group)
    if extra is not None:
        extra.copy_(flat[1 + len(params) : 1 + len(params) + carried].reshape(extra.shape).to(extra.device))
    failures = int(flat[0].item())
    if failures:
        return failures
    has_grad = flat[1 : 1 + len(params)] > 0
    index = {id(p): i for i, p in enumerate(params)}
    _write_back(first, flat[1 + len(params) + carried :], has_grad, index, world_size)
    for bucket in buckets[1:]:
        data = torch.cat([_flat_grad(p) for p in bucket])
        dist.all_reduce(data, group=group)
        _write_back(bucket, data, has_grad, index, world_size)
    return 0


def broadcast_buffers(buffers: Sequence[torch.Tensor], group: Any = None, src: int = 0) -> None:
    """Rank ``src``'s buffers on every rank: one broadcast per dtype."""
    by_dtype: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for b in buffers:
        by_dtype.setdefault((b.dtype, b.device), []).append(b)
    for tensors in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in tensors])
        dist.broadcast(flat, src=src, group=group)
        offset = 0
        with torch.no_grad():
            for t in tensors:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()


def _buckets(params: Sequence[torch.nn.Parameter], bucket_bytes: int) -> list[list[torch.nn.Parameter]]:
    """Consecutive groups of parameters of one dtype and device, each up to ``bucket_bytes`` (at least one)."""
    buckets: list[list[torch.nn.Parameter]] = []
    size = 0
    for p in params:
        nbytes = p.numel() * 4
        current = buckets[-1] if buckets else None
        if current is None or size + nbytes > bucket_bytes or current[0].device != p.device:
            buckets.append([p])
            size = nbytes
        else:
            current.append(p)
            size += nbytes
    return buckets


def _flat_grad(p: torch.nn.Parameter) -> torch.Tensor:
    """The gradient as float32 for the all-reduce (zeros where this rank has none)."""
    if p.grad is None:
        return torch.zeros(p.numel(), device=p.device, dtype=torch.float32)
    return p.grad.detach().reshape(-1).to(torch.float32)


def _write_back(
    bucket: Sequence[torch.nn.Parameter],
    data: torch.Tensor,
    has_grad: torch.Tensor,
    index: dict[int, int],
    world_size: int,
) -> None:
    offset = 0
    with torch.no_grad():
        for p in bucket:
            part = data[offset : offset + p.numel()]
            offset += p.numel()
            if not bool(has_grad[index[id(p)]]):
                continue
            averaged = (part / world_size).view_as(p).to(p.dtype)
            if p.grad is None:
                p.grad = averaged.clone()
            else:
                p.grad.copy_(averaged)


class SyncedSteps:
    """Runs each training step's closure with DDP's reducer off, then synchronises as described above.

    ``run`` is the local step (a :class:`~retune.recovery.train_step.TrainStepRecovery`'s ``run``);
    ``accumulating()`` says whether this batch ends without an optimizer step; ``news`` what each rank tells
    the others in the same collective (:class:`StepNews`).
    """

    def __init__(
        self,
        ddp: Any,
        run: Callable[[Any], Any],
        accumulating: Callable[[], bool],
        params: Callable[[], Sequence[torch.nn.Parameter]],
        buffers: Callable[[], Sequence[torch.Tensor]],
        news: StepNews | None = None,
    ) -> None:
        self.ddp = ddp
        self._run = run
        self.accumulating = accumulating
        self.params = params
        self.buffers = buffers
        self.news = news
        self.group = getattr(ddp, "process_group", None)
        self.world_size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.sync_buffers = bool(getattr(ddp, "forward_sync_buffers", getattr(ddp, "broadcast_buffers", True)))
        self._saved = (
            getattr(ddp, "require_backward_grad_sync", True),
            getattr(ddp, "require_forward_param_sync", True),
        )

    def run(self, step: Any) -> Any:
        # no collective inside forward or backward: DDP neither reduces gradients nor broadcasts buffers now
        self.ddp.require_backward_grad_sync = False
        self.ddp.require_forward_param_sync = False
        error: BaseException | None = None
        result = None
        try:
            result = self._run(step)
        except BaseException as exc:  # agreed below, then raised on every rank
            error = exc
        params = self.params()
        device = params[0].device if params else torch.device("cpu")
        news = self.news
        extra = None
        if news is not None:
            # this rank's news even after its own error: every rank's payload has the same length
            local = [0] * news.width if error is not None else list(news.local())
            extra = torch.tensor(encode_news(local, self.rank, self.world_size, news.width), dtype=torch.float32)
        if self.accumulating():
            failures = agree_status(error is not None, device, self.group, extra=extra)
        else:
            failures = all_reduce_gradients(params, error is not None, self.world_size, self.group, extra=extra)
            buffers = list(self.buffers())
            if not failures and self.sync_buffers and buffers:
                broadcast_buffers(buffers, self.group)
        if error is not None:
            raise error
        if failures:
            raise RetuneError(
                f"{failures} other rank(s) failed in this training step (their own error is raised there); "
                "stopping every rank together instead of leaving them waiting"
            )
        if news is not None and extra is not None:
            rows = decode_news(extra, self.world_size, news.width)
            if any(any(row) for row in rows):
                news.agreed(rows)
        return result

    def close(self) -> None:
        """Give DDP its reducer back."""
        self.ddp.require_backward_grad_sync, self.ddp.require_forward_param_sync = self._saved


__all__ = [
    "BUCKET_BYTES",
    "NEWS_RADIX",
    "StepNews",
    "SyncedSteps",
    "agree_status",
    "all_reduce_gradients",
    "broadcast_buffers",
    "decode_news",
    "encode_news",
]
