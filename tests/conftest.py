"""Suite-wide settings.

One torch thread per test process: the models are tiny, and on a 2-core machine shared with other
work, torch's default of one thread per core makes steps up to 20x slower through contention.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _single_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
