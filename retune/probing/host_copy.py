"""Host copies of many tensors in one allocation.

A snapshot of an unfrozen model copies hundreds of megabytes (parameters, gradients, Adam's two
moments). Copying is cheap; getting fresh memory is not: each tensor cloned on its own lands in a
new ``mmap`` of 4 KiB pages, and the kernel faults and zeroes every page on first touch. On the
benchmark's 50M-parameter model that made capturing five times slower than restoring the same bytes
into memory that already existed.

So a snapshot asks for all its copies at once: one block, laid out up front, with each copy a
tensor over its own slice of it. The block is an anonymous ``mmap`` advised for transparent huge
pages (2 MiB pages, 512 times fewer faults) where the kernel allows it. Device tensors are copied
into the same kind of block. Pinned memory would make those copies faster, but torch's caching host
allocator keeps freed pinned blocks cached until it is told to release them, and a snapshot the size
of the trainable state is too much page-locked host memory to keep between searches hours apart.
"""

from __future__ import annotations

import contextlib
import mmap
from collections.abc import Sequence

import torch

_ALIGN = 64  # bytes: a cache line, and a multiple of every dtype's element size
_MIN_BLOCK = 1 << 20  # below this a block is not worth the mmap; clone each tensor


def _copyable_into_block(tensor: torch.Tensor) -> bool:
    """Plain strided, non-quantized tensors can be laid over a slice of a byte block."""
    return tensor.layout == torch.strided and not tensor.is_quantized and tensor.device.type != "meta"


def _clone_to_host(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.layout == torch.strided and not tensor.is_quantized:
        return tensor.detach().to("cpu", memory_format=torch.contiguous_format, copy=True)
    return tensor.detach().to("cpu", copy=True)


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """The strides of a contiguous (row-major) tensor of ``shape``, as ``Tensor.stride()`` gives them."""
    strides: list[int] = []
    step = 1
    for size in reversed(shape):
        strides.insert(0, step)
        step *= max(size, 1)
    return tuple(strides)


def _cpu_block(nbytes: int) -> memoryview:
    """Anonymous memory advised for huge pages; plain process memory where mmap or the advice is missing."""
    try:
        block = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except (OSError, AttributeError, ValueError):  # not POSIX, or no anonymous maps
        return memoryview(bytearray(nbytes))
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        with contextlib.suppress(OSError):  # THP disabled in this kernel: still one block, small pages
            block.madvise(advice)
    # through a memoryview: an exported buffer makes mmap.close() refuse while any copy lives, and each
    # copy's storage keeps its slice of the memoryview (and so the mapping) alive exactly as long as it
    return memoryview(block)


def _tensor_at(block: memoryview, offset: int, like: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor shaped like ``like`` over ``block[offset:]``, with a storage of its own.

    Its own storage, not a view of one block-wide storage: to everything that inspects storages (the
    CPU peak tracker counts a storage whole, aliasing checks compare storages) each copy is a tensor
    like any other, exactly its own size, and a copy the run trains on is not a view.
    """
    nbytes = like.numel() * like.element_size()
    if nbytes == 0:
        return torch.empty(like.shape, dtype=like.dtype)
    storage = torch.frombuffer(block[offset : offset + nbytes], dtype=torch.uint8).untyped_storage()
    return torch.empty(0, dtype=like.dtype).set_(storage, 0, like.shape, contiguous_strides(like.shape))


def host_copies(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Detached host copies of ``tensors``, in order, laid out in one host allocation where possible.

    Each copy is contiguous, has its source's shape and dtype, and a storage of its own. Sources on
    the CPU and on a device may be mixed. Tensors a byte block cannot hold (sparse, quantized) and
    sets under 1 MiB in all are cloned one by one.
    """
    offsets: list[int | None] = []
    total = 0
    for tensor in tensors:
        if _copyable_into_block(tensor):
            offsets.append(total)
            total += -(-tensor.numel() * tensor.element_size() // _ALIGN) * _ALIGN
        else:
            offsets.append(None)
    if total < _MIN_BLOCK:
        return [_clone_to_host(t) for t in tensors]
    block = _cpu_block(total)
    copies: list[torch.Tensor] = []
    for tensor, offset in zip(tensors, offsets, strict=True):
        if offset is None:
            copies.append(_clone_to_host(tensor))
            continue
        copy = _tensor_at(block, offset, tensor)
        copy.copy_(tensor.detach())  # synchronous from a device: the probe must not run before it lands
        copies.append(copy)
    return copies


__all__ = ["contiguous_strides", "host_copies"]
