"""``is_oom_error``: only out-of-memory errors make a trial fail; everything else must reach the user."""

from __future__ import annotations

import pytest
import torch

from retune import is_oom_error
from retune.oom import _OOM_MESSAGES

ALLOCATOR_MESSAGES = [
    "CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 7.79 GiB total capacity)",
    "CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported",
    "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a non-contiguous input.",
    "CUDNN_STATUS_ALLOC_FAILED",
    "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
    "[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: you tried to allocate "
    "4611686018427387904 bytes. Error code 12 (Cannot allocate memory)",
    "[enforce fail at alloc_cpu.cpp:72] data. DefaultCPUAllocator: not enough memory: you tried to allocate 8 bytes.",
    "MPS backend out of memory (MPS allocated: 1.00 GB, other allocations: 2.00 GB, max allowed: 3.00 GB).",
    "XPU out of memory. Tried to allocate 2.00 GiB.",
    "HIP out of memory. Tried to allocate 2.00 GiB (GPU 0; 15.98 GiB total capacity)",
]


def test_torch_out_of_memory_error() -> None:
    assert is_oom_error(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB"))
    assert is_oom_error(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB"))
    # matched by type, whatever the text
    assert is_oom_error(torch.OutOfMemoryError())
    assert is_oom_error(torch.OutOfMemoryError("something else entirely"))


@pytest.mark.parametrize("message", ALLOCATOR_MESSAGES)
def test_runtime_error_with_allocator_message(message: str) -> None:
    assert is_oom_error(RuntimeError(message))


@pytest.mark.parametrize("message", _OOM_MESSAGES)
def test_every_listed_message_is_matched_as_runtime_error(message: str) -> None:
    assert is_oom_error(RuntimeError(message))
    assert is_oom_error(RuntimeError(f"prefix: {message} :suffix"))


def test_listed_messages_cover_every_backend() -> None:
    for needle in (
        "CUDA error: out of memory",
        "CUDNN_STATUS_NOT_SUPPORTED",
        "DefaultCPUAllocator: can't allocate memory",
        "MPS backend out of memory",
        "XPU out of memory",
        "HIP out of memory",
    ):
        assert needle in _OOM_MESSAGES


def test_runtime_error_subclass_with_message() -> None:
    class BackendError(RuntimeError):
        pass

    assert is_oom_error(BackendError("HIP out of memory"))
    assert not is_oom_error(BackendError("kernel launch failed"))


@pytest.mark.parametrize(
    "exc",
    [
        ValueError("out of memory"),
        ValueError("CUDA out of memory. Tried to allocate 20.00 MiB"),  # right text, wrong type
        TypeError("CUDA out of memory"),
        RuntimeError("shape mismatch"),
        RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 5x6)"),
        RuntimeError("out of memory"),  # too vague: not a message any allocator listed raises
        RuntimeError("cuda out of memory"),  # matching is case-sensitive
        RuntimeError(""),
        RuntimeError(),
        KeyboardInterrupt(),
        SystemExit(1),
        Exception("CUDA out of memory"),
    ],
    ids=repr,
)
def test_not_oom(exc: BaseException) -> None:
    assert not is_oom_error(exc)


def test_python_memory_error_is_matched() -> None:
    # Host memory exhausted by the step's Python side (collate, numpy) also grows with the batch size.
    assert is_oom_error(MemoryError())
    assert is_oom_error(MemoryError("CUDA out of memory"))


def test_oom_as_cause_is_not_unwrapped() -> None:
    # Only the exception itself is inspected, not its __cause__/__context__.
    try:
        try:
            raise torch.OutOfMemoryError("CUDA out of memory")
        except torch.OutOfMemoryError as inner:
            raise ValueError("wrapped") from inner
    except ValueError as outer:
        assert not is_oom_error(outer)


def test_real_cpu_allocator_failure_is_oom() -> None:
    try:
        torch.empty(2**62, dtype=torch.uint8)
    except RuntimeError as exc:
        assert is_oom_error(exc), str(exc)
    except BaseException as exc:  # pragma: no cover - platform dependent
        pytest.skip(f"torch.empty(2**62) raised {type(exc).__name__}, not RuntimeError: {exc}")
    else:  # pragma: no cover - platform dependent
        pytest.skip("torch.empty(2**62) did not raise on this platform")
