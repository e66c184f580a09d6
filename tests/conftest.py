"""Suite-wide settings.

One torch thread per test process: the models are tiny, and on a 2-core machine shared with other
work, torch's default of one thread per core makes steps up to 20x slower through contention.

Distributed objects: a test that needs a process group takes the ``gloo_group`` fixture, which owns
the group and every DDP wrapper made through it and tears them down in the one order that cannot
deadlock (see tests/helpers/dist_utils.py); ``_no_process_group_left`` fails any test that leaves a group
behind. Every test also runs under a timeout (pyproject.toml, ``[tool.pytest.ini_options]``).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.helpers.dist_utils import GlooGroup


@pytest.fixture(autouse=True)
def _single_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def gloo_group(tmp_path: Path) -> Iterator[GlooGroup]:
    """A single-rank gloo default group for this test, torn down so that it cannot hang."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'gloo_store'}", rank=0, world_size=1)
    group = GlooGroup()
    try:
        yield group
    finally:
        group.close()


@pytest.fixture(autouse=True)
def _no_process_group_left(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test that initialises a process group by hand must not leave it for later tests (or for the
    interpreter's exit, which frees it in no particular order): use ``gloo_group`` instead."""
    yield
    if dist.is_available() and dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()
        pytest.fail(
            f"{request.node.nodeid} left a torch.distributed process group initialised; take the gloo_group "
            "fixture (tests/conftest.py), which tears it down in an order that cannot deadlock",
            pytrace=False,
        )
