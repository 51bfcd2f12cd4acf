"""Every `make bench*` script and benchmark entry point still starts: its imports resolve and its
arguments parse (`--help`), so that a module moved or renamed elsewhere does not leave a benchmark
broken until someone next runs it."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = sorted(p.name for p in (ROOT / "benchmarks").glob("bench_*.py"))


def test_the_benchmark_scripts_are_found():
    assert {"bench_engine.py", "bench_serving.py", "bench_limits.py", "bench_gateway_hop.py"} <= set(SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_benchmark_script_answers_help(script):
    out = subprocess.run([sys.executable, f"benchmarks/{script}", "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "usage:" in out.stdout


def test_a_runs_settings_name_no_path_outside_the_repository():
    """The JSON is committed: paths inside the checkout are relative to it, others keep their name only."""
    from argparse import Namespace
    from benchmarks.serving_report import ROOT, settings_of
    args = Namespace(model=str(ROOT / "models" / "weights" / "m.gguf"), output="/somewhere/else/out.json",
                     rate=2.0, token="secret")
    assert settings_of(args, leave_out=("token",)) == {"model": "models/weights/m.gguf", "output": "out.json",
                                                       "rate": 2.0}
