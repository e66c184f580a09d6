"""A batch-size attribute defined in more than one place: say so once, and say what each place does.

Lightning's attribute lookup finds a batch size on the model, ``model.hparams``, the datamodule and
``datamodule.hparams``. When two of them hold it (``self.batch_size = 8`` next to
``save_hyperparameters()`` of a ``batch_size`` argument is the usual way), Lightning's own finder
warns that the model's and its hparams' are mutually exclusive. Reading takes one of them
(``lightning_getattr`` returns the *last* place its lookup finds: ``model.hparams`` over the model,
although that warning says the model's is used); writing sets all of them (``lightning_setattr``).
retune does the same, so the dataloader hook gets every new size whichever place it reads; what
can still mislead is the size a search starts from and reports as "before", which comes from the
place retune reads, not necessarily from the one the hook reads. Which one the hook reads can only
be told from the loader it built, when the places disagree and exactly one of them matches the
loader's batch size.

Pure functions: the callback collects the places (``compat.batch_attr_places``) and the loader's
batch size, and prints what :func:`duplicate_attr_message` returns.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def loader_batch_size(loader: Any) -> int | None:
    """The batch size a dataloader was built with (its own, else its batch sampler's), or the one size
    all the loaders of a list, tuple or dict share; None when there is none or they differ."""
    if isinstance(loader, Mapping):
        sizes = {loader_batch_size(item) for item in loader.values()}
    elif isinstance(loader, Sequence) and not isinstance(loader, (str, bytes)):
        sizes = {loader_batch_size(item) for item in loader}
    else:
        size = getattr(loader, "batch_size", None)
        if size is None:
            size = getattr(getattr(loader, "batch_sampler", None), "batch_size", None)
        return size if isinstance(size, int) and not isinstance(size, bool) else None
    return sizes.pop() if len(sizes) == 1 else None


def duplicate_attr_message(
    name: str, places: Sequence[tuple[str, Any]], loader_size: int | None, hook: str
) -> str | None:
    """The warning for ``name`` held in several ``places`` (``(label, value)`` in Lightning's lookup
    order), or None when it is held in one place only.

    ``loader_size`` is the batch size of the loader ``hook`` built before retune wrote anything; it
    names the place the hook reads when exactly one place holds that value.
    """
    if len(places) < 2:
        return None
    listed = ", ".join(f"{label} = {value!r}" for label, value in places[:-1])
    listed += f" and {places[-1][0]} = {places[-1][1]!r}"
    read, current = places[-1]
    matching = [label for label, value in places if value == loader_size]
    if len({repr(value) for _, value in places}) == 1:
        reader = f"Which one {hook}() reads cannot be told while they hold the same value."
    elif loader_size is not None and len(matching) == 1:
        reader = f"{hook}() built its loader from {matching[0]} (batch size {loader_size})"
        if matching[0] != read:
            reader += f", so the size the first search starts from and reports as before ({current!r}) is not its size"
        reader += "."
    elif loader_size is None:
        reader = f"Which one {hook}() reads cannot be told from the loader it built (no single batch size)."
    else:
        where = "in none of them" if not matching else f"in {' and '.join(matching)}"
        reader = f"Which one {hook}() reads cannot be told: its loader's batch size, {loader_size}, is {where}."
    return (
        f"`{name}` is set in {len(places)} places: {listed}. retune writes every new size to all of them, so "
        f"{hook}() gets it whichever it reads, and reads the current size from {read}, the last place "
        f"Lightning's lightning_getattr looks. {reader} Keep only one of them to silence this warning."
    )


__all__ = ["duplicate_attr_message", "loader_batch_size"]
