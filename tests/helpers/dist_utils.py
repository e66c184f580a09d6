"""Distributed objects in tests, torn down in an order that cannot deadlock.

Tests take the ``gloo_group`` fixture (tests/conftest.py), which creates a :class:`GlooGroup`.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist


class GlooGroup:
    """A single-rank gloo process group for one test, and the distributed wrappers made in it.

    Why the teardown order matters: ``ProcessGroupGloo``'s destructor joins its worker threads. Freed
    from Python it runs without the GIL; freed by DDP's C++ ``Reducer`` holding the last reference
    (the wrapper outliving ``destroy_process_group()``) it runs *with* the GIL, and a worker that is
    still releasing a finished collective needs the GIL to drop a Python object: both wait forever.
    This hung ``test_gradient_views_are_copied_not_held`` once (issue 12). So :meth:`close` waits for
    all pending work (a barrier), frees every wrapper's reducer while the group is still registered
    (the registry's reference keeps the reducer from being the last owner), collects, and only then
    destroys the group. The reducer is detached from the wrapper rather than left to the wrapper's
    refcount: a failing test's traceback (``sys.last_traceback``) keeps its locals, the wrapper
    included, alive past the fixture.
    """

    def __init__(self) -> None:
        self._owned: list[Any] = []

    def ddp(self, module: torch.nn.Module, **kwargs: Any) -> torch.nn.parallel.DistributedDataParallel:
        """``DistributedDataParallel(module, **kwargs)``, released before the group at teardown."""
        wrapper = torch.nn.parallel.DistributedDataParallel(module, **kwargs)
        self._owned.append(wrapper)
        return wrapper

    def own(self, obj: Any) -> Any:
        """Hold ``obj`` (a ZeroRedundancyOptimizer, say) so that it is dropped before the group is destroyed."""
        self._owned.append(obj)
        return obj

    def close(self) -> None:
        try:
            dist.barrier()  # gloo's barrier waits for every collective still queued or running
        finally:  # a failed barrier is reported, after the group is gone all the same
            for obj in self._owned:
                if isinstance(obj, torch.nn.parallel.DistributedDataParallel):
                    _release_reducer(obj)
            self._owned.clear()
            gc.collect()
            dist.destroy_process_group()


def _release_reducer(wrapper: torch.nn.parallel.DistributedDataParallel) -> None:
    """Free the wrapper's C++ reducer now (its Python handle and the logger that shares it).

    The wrapper is unusable afterwards; it is only called once the test is over.
    """
    missing = [name for name in ("reducer", "logger") if name not in wrapper.__dict__]
    assert not missing, f"DistributedDataParallel no longer has {missing}: update _release_reducer for this torch"
    for name in ("logger", "reducer"):
        del wrapper.__dict__[name]


def run_rank_scripts(
    runs: dict[str, list[str]], script: Path, out_root: Path, timeout_s: float
) -> dict[str, tuple[int | None, str, Path]]:
    """Run ``script *args`` once per entry, all at once, with ``"{out}"`` in ``args`` replaced by the run's own
    output folder; returns ``{name: (returncode, output, folder)}``.

    Each run is a session of its own: Lightning's DDP launcher starts the other ranks as children, and
    on a timeout the whole session is killed, so no leftover rank holds the output pipe open (which
    would make ``communicate()`` wait forever). A run that times out reports ``TIMED OUT`` in its output.
    """
    root = script.resolve().parents[2]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(root)}
    procs = {}
    for name, args in runs.items():
        out = out_root / name
        out.mkdir(parents=True, exist_ok=True)
        procs[name] = (
            out,
            subprocess.Popen(
                [sys.executable, str(script), *(str(out) if a == "{out}" else a for a in args)],
                cwd=root,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            ),
        )
    started = time.monotonic()
    results = {}
    for name, (out, proc) in procs.items():
        try:
            output, _ = proc.communicate(timeout=max(1.0, timeout_s - (time.monotonic() - started)))
        except subprocess.TimeoutExpired:
            kill_session(proc)
            output, _ = proc.communicate(timeout=30)
            output = f"TIMED OUT after {timeout_s}s (a hang)\n{output}"
        kill_session(proc)  # nothing it started may outlive the test
        results[name] = (proc.returncode, output, out)
    return results


def kill_session(proc: subprocess.Popen[str]) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def leave_rank() -> NoReturn:
    """End a rank script (tests/ddp, tests/fsdp2) once it has written its results, without running the
    interpreter's exit.

    Why: Lightning leaves the gloo group registered after ``fit``; at interpreter exit its worker threads
    are destroyed by C++ static destructors, and in some runs that aborts ("terminate called without an
    active exception", exit code -6, pytorch/pytorch#190489) after every result was written. CI failed
    on it once (rank 0 of run_ddp_largest.py under load), and DTensor's collectives made it frequent in
    run_guard.py. So: a
    barrier that gives up instead of hanging if the other rank has died, the group destroyed while both
    ranks are alive, then ``os._exit(0)``; nothing else is left to clean up in these scripts. A rank that
    ``ddp_spawn`` started never returns to the script: it registers this with ``atexit`` instead.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    if dist.is_available() and dist.is_initialized():
        with contextlib.suppress(RuntimeError):  # the other rank failed: its own output says why
            dist.monitored_barrier(timeout=timedelta(seconds=60))
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def write_rank_result(out: Path, rank: int, finder: Any, **extra: Any) -> None:
    """A rank script's result, ``out/rank{rank}.json``: the finder's first search (size applied, trials, peaks,
    prediction path) and the script's own ``extra`` fields, for the test that runs the script to compare ranks."""
    event = finder.history[0]
    result = {
        "rank": rank,
        "batch_size": finder.batch_size,
        "trials": [[t.batch_size, t.fits] for t in event.trials],
        "peaks": event.peak_bytes,
        "prediction": event.prediction,
        **extra,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps(result))
