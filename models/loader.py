"""load_model: a GGUF file or a Hugging Face directory (config.json + safetensors) -> (ModelWeights, Tokenizer).

load_tokenizer reads only a model's tokenizer, without its weights.
"""
from __future__ import annotations

import os
import threading
from collections.abc import Mapping

from models.gguf_file import Metadata, ModelFileError, open_gguf, read_gguf
from models.inspect import check_quantization
from models.quant import UnsupportedFormat
from models.safetensors_file import CONFIG_NAME, read_safetensors_dir
from models.tokenizer import Tokenizer
from models.weights import ModelWeights

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GGUF_MAGIC = b"GGUF"


def default_model_path() -> str:
    """$ZEN_MODEL_PATH, else models/weights/SmolLM2-135M-Instruct.Q4_1.gguf in the repository (`make model`)."""
    return os.environ.get("ZEN_MODEL_PATH") or os.path.join(REPO_ROOT, "models", "weights", DEFAULT_MODEL_FILE)


def read_gguf_fields(path: str, prefix: str = "tokenizer.") -> dict:
    """The GGUF metadata keys starting with `prefix`, prefix removed, as Python values (no tensors read)."""
    return dict(Metadata(open_gguf(path), prefix))


def locate_model(path) -> tuple[str, str]:
    """("gguf", file) or ("safetensors", directory) for a model path; FileNotFoundError or ModelFileError."""
    p = os.fspath(path)
    if not os.path.exists(p):
        raise FileNotFoundError(f"model not found: {p}")
    if os.path.isdir(p):
        if os.path.isfile(os.path.join(p, CONFIG_NAME)):
            return "safetensors", p
        ggufs = sorted(f for f in os.listdir(p) if f.endswith(".gguf"))
        if len(ggufs) == 1:
            return locate_model(os.path.join(p, ggufs[0]))
        raise ModelFileError(f"{p}: not a model directory (no config.json, and not exactly one .gguf file)")
    name = os.path.basename(p)
    if name.endswith(".safetensors") or name == CONFIG_NAME:
        return "safetensors", os.path.dirname(os.path.abspath(p))
    try:
        with open(p, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ModelFileError(f"{p}: cannot read ({e.strerror})") from None
    if magic != GGUF_MAGIC:
        if name.endswith(".gguf"):
            raise ModelFileError(f"{p}: not a GGUF file")
        raise ModelFileError(f"{p}: not a model file (expected a GGUF file or a directory with config.json)")
    return "gguf", p


def _tokenizer_from_gguf(path: str, fields: dict) -> Tokenizer:
    if not fields.get("ggml.tokens"):
        raise ModelFileError(f"{path}: the GGUF file has no tokenizer")
    try:
        return Tokenizer.from_gguf(fields)
    except ValueError as e:
        raise ModelFileError(f"{path}: {e}") from None


def _tokenizer_from_dir(path: str) -> Tokenizer:
    try:
        return Tokenizer.from_hf_dir(path)
    except FileNotFoundError as e:
        raise ModelFileError(str(e)) from None


# Building a tokenizer holds the GIL for ~0.1-0.3 s (JSON and the tokenizers library's parser), which
# would pause every other model's engine thread in a node; one instance per file is built once and shared.
_tokenizers: dict[tuple, Tokenizer] = {}
_tokenizers_lock = threading.Lock()


def _file_key(kind: str, p: str) -> tuple:
    target = p if kind == "gguf" else os.path.join(p, CONFIG_NAME)
    st = os.stat(target)
    return (os.path.abspath(p), st.st_mtime_ns, st.st_size)


def load_tokenizer(path, fields: Mapping | None = None) -> Tokenizer:
    """Only the tokenizer of a model (no weights read); built once per model file."""
    kind, p = locate_model(path)
    key = _file_key(kind, p)
    with _tokenizers_lock:
        tok = _tokenizers.get(key)
    if tok is None:
        if kind == "gguf":
            tok = _tokenizer_from_gguf(p, fields if fields is not None else read_gguf_fields(p))
        else:
            tok = _tokenizer_from_dir(p)
        with _tokenizers_lock:
            tok = _tokenizers.setdefault(key, tok)
    return tok


def load_model(path, quantization: str | None = None) -> tuple[ModelWeights, Tokenizer]:
    """Load a model and its tokenizer.

    path: a .gguf file, or a directory with config.json and safetensors weights (a directory holding exactly
          one .gguf file also works).
    quantization: None keeps the stored formats; one of models.formats' names (f32 ... q6_k) re-encodes every
          matrix (norms stay float32).
    Errors: FileNotFoundError for a missing path; models.gguf_file.ModelFileError naming the file for
    anything that is not a loadable model; models.quant.UnsupportedFormat for a tensor type or
    quantization we cannot use.
    """
    check_quantization(quantization)
    kind, p = locate_model(path)
    if kind == "gguf":
        try:
            weights, fields = read_gguf(p)
        except UnsupportedFormat as e:
            raise UnsupportedFormat(str(e) if p in str(e) else f"{p}: {e}") from None
        tokenizer = load_tokenizer(p, fields)
    else:
        weights = read_safetensors_dir(p)
        tokenizer = load_tokenizer(p)
    if tokenizer.vocab_size > weights.config.vocab_size:
        raise ModelFileError(
            f"{p}: the tokenizer has {tokenizer.vocab_size} tokens but the model only {weights.config.vocab_size}"
        )
    weights = weights.converted(quantization)
    weights.metadata.setdefault("source", p)
    weights.metadata["formats"] = sorted(weights.formats())
    return weights, tokenizer
