"""The part of a sharded tensor that lives on this rank.

FSDP2 turns every parameter it shards into a ``DTensor``: a wrapper whose ``shape`` and ``numel()``
are the whole tensor's, while its memory is one local shard (``to_local()``). The gradients FSDP2
reduce-scatters and the optimizer states created from the parameters (Adam's moments) are DTensors
too. Anything that copies or counts memory must look at the local shard: copying the DTensor would
gather the whole tensor (a collective, and memory for all of it), and counting its ``numel()``
would count every rank's shard on each rank. Pure torch.
"""

from __future__ import annotations

from typing import Any

import torch


def _dtensor_type() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed, or older than 2.4
        return None
    return DTensor


_DTENSOR = _dtensor_type()


def is_sharded(tensor: Any) -> bool:
    """True for a ``DTensor`` (a sharded parameter, gradient or optimizer state)."""
    return _DTENSOR is not None and isinstance(tensor, _DTENSOR)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``tensor`` (the tensor itself when it is not sharded), never a copy."""
    if is_sharded(tensor):
        return tensor._local_tensor  # type: ignore[attr-defined,no-any-return]
    return tensor


def like_sharded(shard: torch.Tensor, sharded: torch.Tensor) -> torch.Tensor:
    """A ``DTensor`` laid out like ``sharded`` (same mesh, placements, global shape) over ``shard``.

    Used to hand a gradient back to a sharded parameter after its shard was kept in host memory.
    """
    if not is_sharded(sharded):
        return shard
    assert _DTENSOR is not None
    return _DTENSOR.from_local(  # type: ignore[attr-defined,no-any-return]
        shard,
        sharded.device_mesh,  # type: ignore[attr-defined]
        sharded.placements,  # type: ignore[attr-defined]
        run_check=False,
        shape=sharded.shape,
        stride=sharded.stride(),
    )


__all__ = ["is_sharded", "like_sharded", "local"]
