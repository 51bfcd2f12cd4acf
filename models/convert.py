"""Convert any loadable model to a Hugging Face style directory: config.json + model.safetensors + tokenizer.

    python -m models.convert SRC OUT_DIR [--format f32|f16|bf16|q8_0|q4_0|q4_1|q5_0|q5_1|q4_k|q5_k|q6_k]

SRC is a .gguf file or a model directory. Without --format the stored formats are kept (a GGUF's mix of
q8_0 and q4_1, or a Q4_K_M file's q4_k, q5_0, q6_k and q8_0, included). Float formats are written as plain
tensors; block formats as raw GGML blocks that models.safetensors_file reads back exactly. K-quants fall
back to q5_0 / q5_1 / q8_0 for matrices whose rows are not a multiple of 256, and block formats to f16
where they are not a multiple of 32, as llama.cpp does.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from models.loader import load_model, locate_model
from models.quant import FORMATS
from models.safetensors_file import write_safetensors_dir


def convert(src, out_dir, fmt: str | None = None) -> list[str]:
    """Load `src`, re-encode to `fmt` (None keeps the formats), write to `out_dir`; returns the files written."""
    out_dir = os.fspath(out_dir)
    kind, where = locate_model(src)
    src_dir = where if kind == "safetensors" else None
    if src_dir is not None and os.path.realpath(src_dir) == os.path.realpath(out_dir):
        raise ValueError(f"{out_dir}: the output directory is the source model's directory")
    weights, tokenizer = load_model(src, quantization=fmt)
    written = write_safetensors_dir(out_dir, weights)
    tokenizer.save_hf(out_dir)
    written += [os.path.join(out_dir, "tokenizer.json"), os.path.join(out_dir, "tokenizer_config.json")]
    return written


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m models.convert", description=__doc__.splitlines()[0])
    parser.add_argument("src", help="a .gguf file or a model directory (config.json + safetensors)")
    parser.add_argument("out_dir", help="directory to write config.json, model.safetensors and the tokenizer to")
    parser.add_argument("--format", choices=FORMATS, default=None, help="weight format of every matrix (default: keep)")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    try:
        written = convert(args.src, args.out_dir, args.format)
    except (OSError, ValueError) as e:  # FileNotFoundError, ModelFileError, UnsupportedFormat
        print(f"error: {e}", file=sys.stderr)
        return 1
    size = sum(os.path.getsize(f) for f in written)
    print(f"wrote {args.out_dir} ({args.format or 'formats kept'}, {size / 1e6:.1f} MB) "
          f"in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
