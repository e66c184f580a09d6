"""Which exceptions mean "this batch size does not fit".

A trial fails on an out-of-memory error and only then: every other exception is a bug in the
user's step (or ours) and must reach the user. The messages below are the ones the allocators
actually raise; they are matched by substring because several backends raise plain RuntimeError.
"""

from __future__ import annotations

import torch

_OOM_MESSAGES = (
    "CUDA out of memory",  # torch.OutOfMemoryError text on CUDA
    "CUDA error: out of memory",  # OOM surfaced by a CUDA kernel launch
    "HIP out of memory",  # ROCm
    "CUBLAS_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_NOT_SUPPORTED",  # cuDNN's answer to an oversized batch (Lightning treats it as OOM)
    "CUDNN_STATUS_ALLOC_FAILED",
    "DefaultCPUAllocator: can't allocate memory",  # CPU allocator
    "DefaultCPUAllocator: not enough memory",  # CPU allocator on Windows
    "MPS backend out of memory",  # Apple MPS
    "XPU out of memory",  # Intel XPU
)


def is_oom_error(exc: BaseException) -> bool:
    """True when ``exc`` says the device ran out of memory."""
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True  # MemoryError: host RAM exhausted by the step's Python side (collate, numpy)
    if not isinstance(exc, RuntimeError):
        return False
    text = str(exc)
    return any(message in text for message in _OOM_MESSAGES)


__all__ = ["is_oom_error"]
