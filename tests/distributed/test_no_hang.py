"""The suite cannot hang (issue 12): a stuck test fails with its stack, and process groups are torn
down in an order that cannot deadlock.

The timeout checks run pytest on a generated test file in a subprocess, with this project's
pyproject.toml and only the two timeouts shortened, so they exercise the real configuration.
"""

from __future__ import annotations

import gc
import os
import shutil
import subprocess
import sys
import textwrap
import time
import weakref
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.helpers.dist_utils import GlooGroup

ROOT = Path(__file__).resolve().parents[2]
INNER_TIMEOUT_S = 2  # pytest-timeout, in the inner run
INNER_FAULTHANDLER_S = 4  # faulthandler's watchdog, in the inner run
HANG_S = 600  # how long the inner tests would otherwise be stuck


def _run_pytest(directory: Path, source: str, *extra: str) -> tuple[subprocess.CompletedProcess[str], float]:
    (directory / "test_inner.py").write_text(textwrap.dedent(source))
    shutil.copy(ROOT / "pyproject.toml", directory / "pyproject.toml")
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        "-o",
        f"timeout={INNER_TIMEOUT_S}",
        "-o",
        f"faulthandler_timeout={INNER_FAULTHANDLER_S}",
        *extra,
        "test_inner.py",
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    started = time.monotonic()
    # the outer timeout is far below HANG_S: if the inner run is not ended by its own timeouts, this fails
    proc = subprocess.run(cmd, cwd=directory, env=env, capture_output=True, text=True, timeout=180, check=False)
    return proc, time.monotonic() - started


def test_the_suite_has_a_per_test_timeout_of_a_few_minutes(pytestconfig: pytest.Config) -> None:
    timeout = float(pytestconfig.getini("timeout"))
    assert 60 <= timeout <= 600
    assert pytestconfig.getini("timeout_method") == "thread"  # dumps every thread's stack, then exits
    # faulthandler's watchdog is the backstop for a hang that holds the GIL; it must come second
    assert timeout < float(pytestconfig.getini("faulthandler_timeout")) <= 2 * timeout
    assert pytestconfig.getini("faulthandler_exit_on_timeout") is True


def test_a_hanging_test_fails_with_its_stack(tmp_path: Path) -> None:
    proc, elapsed = _run_pytest(
        tmp_path,
        f"""
        import time

        def test_waits_forever():
            time.sleep({HANG_S})
        """,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output
    assert "Timeout" in output and "Stack of MainThread" in output, output
    assert "in test_waits_forever" in output and "time.sleep" in output, output  # where it was stuck
    assert elapsed < HANG_S / 4


def test_a_hang_holding_the_gil_fails_with_its_stack(tmp_path: Path) -> None:
    # A C call that never releases the GIL, like the DDP teardown deadlock: pytest-timeout's Python
    # timer thread cannot run, so faulthandler's C watchdog has to dump the stacks and end the run.
    proc, elapsed = _run_pytest(
        tmp_path,
        f"""
        import ctypes

        def test_holds_the_gil():
            ctypes.PyDLL(None).sleep({HANG_S})  # libc sleep(), called with the GIL held
        """,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output
    assert f"Timeout (0:00:0{INNER_FAULTHANDLER_S})!" in output, output
    assert "in test_holds_the_gil" in output, output
    assert elapsed < HANG_S / 4


def test_a_test_that_leaves_a_process_group_fails(tmp_path: Path) -> None:
    proc, _ = _run_pytest(
        tmp_path,
        """
        import torch.distributed as dist

        def test_leaks_a_group(tmp_path):
            dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)

        def test_after_it():
            assert not dist.is_initialized()  # the guard destroyed it
        """,
        "-p",
        "tests.conftest",
    )
    output = proc.stdout + proc.stderr
    assert "left a torch.distributed process group initialised" in output, output
    assert "2 passed, 1 error" in output, output  # the second test ran on a clean slate


def test_the_fixture_frees_the_reducer_of_a_wrapper_still_referenced(tmp_path: Path) -> None:
    # as when a failing test's traceback keeps the wrapper alive: its reducer must still go first
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    group = GlooGroup()
    ddp = group.ddp(torch.nn.Linear(4, 4))
    ddp(torch.randn(2, 4)).sum().backward()
    reducer = weakref.ref(ddp.reducer)
    group.close()
    gc.collect()
    assert reducer() is None, "the reducer outlived the group"
    assert not dist.is_initialized()
    assert ddp is not None
