"""`make gpu-check`: the cuda backend on a real GPU, checked and measured in a few minutes.

1. every kernel against numpy on random data, with this GPU's launch configuration (each weight format on
   the GEMV and GEMM paths, RoPE + paged attention with and without split-K, head dims 64 and 128, the
   sampler against the cpu sampler on a full vocabulary);
2. the cuda backend against the cpu backend on the default model: logits of a prompt close, greedy ids equal
   (both compute in float32: the cpu reference without int8 activations), and decode_step's greedy ids too,
   its tiled variant's against the per-op path at a batch past gemv_max_tokens;
3. decode tokens/s at batch 1, 16, 64, 256 through decode_step (one launch a step) and through the per-op path,
   with the launches, uploads and downloads of a step, and prefill tokens/s, beside the roofline (the lower of
   the memory-bandwidth and the FP32 compute bound) and beside transformers on PyTorch (eager, bf16, the same
   shapes and weights) when torch is importable;
4. where a decode_step step's time goes (host stages, the kernel and each phase on the device: profile.py), and
   each kernel's time at the model's shapes.
Writes cuda/RESULTS.md (date, GPU, configuration, every number) and exits 1 on any mismatch or error,
after running whatever else it can. When the model file is missing (the default one is 98 MB), a model of
the same shapes and formats with random weights stands in, and the report says so.

    python -m cuda.gpu_check [--model PATH] [--budget 390] [--no-torch] [--out cuda/RESULTS.md]

On a GPU machine without network access and without the project's virtual environment or the model file,
the one command is `make gpu-check PY=python3`, run with a python that has numba-cuda and numpy (torch and
transformers for the comparison). The gguf and numpy wheels are placed in the git-ignored wheels/ folder
beforehand, downloaded on a machine with network access:
    python -m pip download --no-deps --only-binary=:all: --python-version 3.12 -d wheels gguf==0.19.0
    python -m pip download --no-deps --only-binary=:all: --python-version 3.12 -d wheels numpy==2.4.6 ...
(for numpy, the `...` is `--implementation cp --platform manylinux_2_28_x86_64`, which a binary wheel for a
Linux x86-64 machine needs).
gguf (pure Python) is read from its wheel; numpy is installed into build/gpu-site ahead of the machine's own:
numpy 2.5 dropped np.row_stack, which numba-cuda 0.30 calls when it compiles a first kernel.
The whole run stays under 8 minutes on one H200 (--budget 390 s for the checks and benchmarks, then the report).

The modules: plan (sizes), roofline (what the GPU can do at best), model_setup (the model and its step
inputs), checks (correctness), timing (throughput and kernel timings), profile (decode_step's breakdown),
torch_baseline (transformers), report (cuda/RESULTS.md); this one runs them in that order.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import faulthandler
import os
import platform
import sys
import time
import traceback

import numpy as np

from cuda.gpu_check.checks import kernel_checks, model_check
from cuda.gpu_check.model_setup import load_weights, logits_of
from cuda.gpu_check.plan import FULL, TINY, tiny_launch_config
from cuda.gpu_check.profile import decode_step_profile
from cuda.gpu_check.report import Report
from cuda.gpu_check.roofline import bandwidth_for, fp32_peak
from cuda.gpu_check.timing import benchmarks, kernel_timings
from cuda.gpu_check.torch_baseline import TorchModel

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_OUT = os.path.join(REPO, "cuda", "RESULTS.md")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m cuda.gpu_check", description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="GGUF file or HF directory (default: the default model)")
    ap.add_argument("--out", default=DEFAULT_OUT, help="where to write the report (default cuda/RESULTS.md)")
    ap.add_argument("--budget", type=float, default=390.0, help="seconds before the remaining benchmarks are "
                                                                 "skipped (a hang is dumped and killed at +90 s)")
    ap.add_argument("--no-torch", action="store_true", help="skip the transformers comparison")
    ap.add_argument("--skip-bench", action="store_true", help="correctness only")
    ap.add_argument("--tiny", action="store_true", help="tiny sizes and a small launch configuration: the whole "
                                                         "script in the CUDA simulator (NUMBA_ENABLE_CUDASIM=1)")
    return ap.parse_args(argv)


def describe_device(dev, c, report: Report) -> tuple[float | None, float | None]:
    """The report's header (date, GPU, bandwidth, FP32 peak, launch configuration c, software versions);
    returns (memory bandwidth, FP32 peak)."""
    name = getattr(dev, "name", "CUDA simulator")
    name = name.decode() if isinstance(name, bytes) else str(name)

    def attr(a: str) -> int:
        try:
            return int(getattr(dev, a) or 0)
        except Exception:  # an attribute this driver does not have
            return 0

    sms = attr("MULTIPROCESSOR_COUNT")
    bandwidth, bw_src = bandwidth_for(name, attr("MEMORY_CLOCK_RATE"), attr("GLOBAL_MEMORY_BUS_WIDTH"))
    peak = fp32_peak(dev.compute_capability, sms, attr("CLOCK_RATE"))
    import numba

    try:
        from importlib.metadata import version
        ncv = version("numba-cuda")
    except Exception:
        ncv = "?"
    report.header += [
        ("date", datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")),
        ("GPU", f"{name}, compute capability {dev.compute_capability[0]}.{dev.compute_capability[1]}, {sms} SMs"),
        ("memory bandwidth", f"{bandwidth / 1e12:.2f} TB/s ({bw_src})" if bandwidth else "unknown"),
        ("FP32 peak", f"{peak / 1e12:.1f} TFLOP/s (SMs x lanes x 2 x {attr('CLOCK_RATE') / 1e3:.0f} MHz)"
         if peak else "unknown"),
        ("launch configuration", f"{c.arch}: " + ", ".join(f"{f.name}={getattr(c, f.name)}"
                                                           for f in dataclasses.fields(c) if f.name != "arch")),
        ("software", f"Python {platform.python_version()}, numba {numba.__version__}, numba-cuda "
                     f"{ncv}, numpy {np.__version__}"),
    ]
    return bandwidth, peak


def check_kernels_and_model(args, plan, be, report: Report, start: float):
    """Steps 1 and 2; returns the model's weights, None when they could not be loaded."""
    print(f"\n[1/4] kernels against numpy ({time.time() - start:.0f} s)", flush=True)
    try:
        kernel_checks(be, report, np.random.default_rng(int(time.time())), plan)
    except Exception:
        report.errors.append(f"kernel checks:\n{traceback.format_exc()}")
        print(report.errors[-1], flush=True)

    print(f"\n[2/4] cuda backend against cpu backend ({time.time() - start:.0f} s)", flush=True)
    weights = None
    try:
        weights, tokenizer, _ = load_weights(args.model, report, plan)
        print(f"  {report.header[-1][1]}", flush=True)
        model_check(weights, tokenizer, be, report, plan.greedy_tokens)
    except Exception:
        report.errors.append(f"model check:\n{traceback.format_exc()}")
        print(report.errors[-1], flush=True)
    return weights


def torch_baseline(weights, be, report: Report, no_torch: bool):
    """The transformers model for the throughput table's last columns, checked to compute the same model;
    None when skipped or not importable (kept when only the check fails, whose error the report shows)."""
    if no_torch:
        report.notes.append("transformers column skipped (--no-torch)")
        return None
    torch_model = None
    try:
        torch_model = TorchModel(weights)
        report.header.append(("transformers", torch_model.version + ", bf16 weights, eager"))
        ids = np.random.default_rng(5).integers(3, weights.config.vocab_size, 32).astype(np.int32)
        hf = torch_model.logits(ids)
        ours = logits_of(weights, be, ids)
        agree = float(np.mean(hf.argmax(-1) == ours.argmax(-1)))
        corr = float(np.corrcoef(hf.ravel(), ours.ravel())[0, 1])
        report.notes.append(f"transformers baseline is the same model: on 32 random tokens its bf16 "
                            f"logits correlate {corr:.4f} with ours (float32), argmax agrees at "
                            f"{100 * agree:.0f}% of positions")
    except ImportError as e:
        report.notes.append(f"transformers column empty: {e} (torch/transformers not importable here)")
    except Exception:
        report.errors.append(f"transformers model:\n{traceback.format_exc()}")
    return torch_model


def measure(weights, be, report: Report, plan, args, start: float, deadline: float, bandwidth, peak) -> None:
    """Steps 3 and 4: throughput beside the roofline and transformers, then per-kernel timings."""
    print(f"\n[3/4] throughput ({time.time() - start:.0f} s)", flush=True)
    torch_model = torch_baseline(weights, be, report, args.no_torch)
    try:
        benchmarks(weights, be, report, deadline, bandwidth, peak, torch_model, plan)
    except Exception:
        report.errors.append(f"benchmarks:\n{traceback.format_exc()}")
    print(f"\n[4/4] decode_step profile and kernel timings ({time.time() - start:.0f} s)", flush=True)
    for what, fn in (("decode_step profile", decode_step_profile), ("kernel timings", kernel_timings)):
        if time.time() > deadline:
            report.notes.append(f"{what} skipped: the time budget ran out")
            continue
        try:
            fn(weights, be, report, deadline, plan)
        except Exception:
            report.errors.append(f"{what}:\n{traceback.format_exc()}")


def verdict(report: Report) -> int:
    """Print what failed; the exit status (1 on any mismatch or error)."""
    if report.failed:
        print("gpu-check FAILED:", flush=True)
        for n, ok, d in report.checks:
            if not ok:
                print(f"  {n}: {d}", flush=True)
        for e in report.errors:
            print(e, flush=True)
        return 1
    print("gpu-check passed", flush=True)
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    plan = TINY if args.tiny else FULL
    start = time.time()
    deadline = start + args.budget
    faulthandler.dump_traceback_later(args.budget + 90, exit=True)

    from numba import cuda

    if not cuda.is_available():
        print("gpu-check: no CUDA GPU is available here (numba.cuda.is_available() is False); nothing to check.",
              file=sys.stderr)
        faulthandler.cancel_dump_traceback_later()  # else it would kill a caller that goes on (pytest)
        return 2

    from cuda.backend import CudaBackend

    report = Report()
    be = CudaBackend(tiny_launch_config() if args.tiny else None)
    bandwidth, peak = describe_device(cuda.get_current_device(), be.config, report)
    print("\n".join(f"{k}: {v}" for k, v in report.header), flush=True)

    try:
        weights = check_kernels_and_model(args, plan, be, report, start)
        if not args.skip_bench and weights is not None:
            measure(weights, be, report, plan, args, start, deadline, bandwidth, peak)
    finally:
        report.header.append(("wall time", f"{time.time() - start:.0f} s"))
        with open(args.out, "w") as f:
            f.write(report.markdown())
        print(f"\nwrote {args.out}", flush=True)
        faulthandler.cancel_dump_traceback_later()
    return verdict(report)
