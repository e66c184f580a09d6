"""Collect the warnings retune issues (``RetuneWarning``) inside a block, every one, repeats included."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager

from retune import RetuneWarning


@contextmanager
def retune_warnings() -> Iterator[list[str]]:
    """``with retune_warnings() as said: ...`` — afterwards ``said`` holds each RetuneWarning's text, in order.

    ``always``: Python would otherwise show a repeated message from one line once, hiding a duplicate.
    """
    said: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield said
    said.extend(str(w.message) for w in caught if issubclass(w.category, RetuneWarning))
