"""The one-call GPU check (``tests/gpu/run_all.sh``) stays whole on a machine without a GPU.

CI has no GPU, so the GPU scripts never run here; what can rot without anyone noticing is caught
instead: every script compiles, ``run_all.sh`` runs every script in ``tests/gpu`` (a new one that is
not listed fails), and on a machine without a GPU it skips each check, says so in one line per check,
writes its summary JSON and exits 0.
"""

from __future__ import annotations

import json
import os
import py_compile
import re
import subprocess
import sys
from pathlib import Path

import pytest

GPU = Path(__file__).resolve().parents[1] / "gpu"
SCRIPTS = sorted(p for p in GPU.glob("*.py"))


@pytest.mark.parametrize("script", SCRIPTS, ids=[p.name for p in SCRIPTS])
def test_every_gpu_script_compiles(script: Path, tmp_path: Path) -> None:
    py_compile.compile(str(script), cfile=str(tmp_path / "x.pyc"), doraise=True)


def test_run_all_lists_every_gpu_script() -> None:
    listed = set(re.findall(r"tests/gpu/(\w+\.py)", (GPU / "run_all.sh").read_text()))
    assert listed == {p.name for p in SCRIPTS}


def test_run_all_skips_every_check_without_a_gpu(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        ["bash", str(GPU / "run_all.sh"), str(tmp_path)], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [line for line in done.stdout.splitlines() if line.split(" ")[0] in ("PASS", "FAIL", "SKIP")]
    assert len(lines) == len(SCRIPTS) and all(line.startswith("SKIP") for line in lines), done.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["gpus"] == 0 and {c["status"] for c in summary["checks"]} == {"SKIP"}
