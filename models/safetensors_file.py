"""Read and write Llama-family and Gemma 3 models as a Hugging Face directory: config.json + safetensors weights.

Reading takes model.safetensors or the shards named by model.safetensors.index.json, with the Hugging Face
tensor names, in F32 / F16 / BF16. Writing stores float formats as plain tensors (loadable by transformers)
and GGML block formats (q8_0 / q4_0 / q4_1) as uint8 tensors of raw blocks, [rows, bytes per row], with
each one's format and logical shape in the file metadata under "zen.quant", so reading restores the
QuantTensor byte for byte.

numpy has no bfloat16, so the safetensors library cannot hand BF16 tensors to numpy; those are read
through the file's own header (8-byte length + JSON), and files holding BF16 are written the same way.
"""
from __future__ import annotations

import json
import os
import stat
import struct

import gguf
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from models.config import ModelConfig
from models.quant import BLOCK_FORMATS, GGML_TYPE, QuantTensor, UnsupportedFormat
from models.weights import LayerWeights, ModelFileError, ModelWeights

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"
QUANT_METADATA_KEY = "zen.quant"
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "gemma3_text")

_FLOAT_DTYPES = {"F32": "f32", "F16": "f16", "BF16": "bf16"}
_LAYER_NAMES = {
    "q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
    "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_GEMMA3_LAYER_NAMES = dict(
    _LAYER_NAMES, ffn_norm="pre_feedforward_layernorm", post_attn_norm="post_attention_layernorm",
    post_ffn_norm="post_feedforward_layernorm", q_norm="self_attn.q_norm", k_norm="self_attn.k_norm",
)
# Hugging Face's Gemma multiplies by (1 + w) and stores w; ModelWeights holds the factor (1 + w)
_GEMMA_NORM_OFFSET = 1.0


def _norm_offset(config: ModelConfig) -> float:
    return _GEMMA_NORM_OFFSET if config.architecture == "gemma3" else 0.0


def hf_tensor_names(config: ModelConfig) -> dict[str, tuple]:
    """HF tensor name -> (where in ModelWeights, expected shape)."""
    d, v = config.hidden_size, config.vocab_size
    shapes = {
        "q": (config.q_size, d), "k": (config.kv_size, d), "v": (config.kv_size, d), "o": (d, config.q_size),
        "gate": (config.intermediate_size, d), "up": (config.intermediate_size, d),
        "down": (d, config.intermediate_size), "attn_norm": (d,), "ffn_norm": (d,),
        "post_attn_norm": (d,), "post_ffn_norm": (d,), "q_norm": (config.head_dim,), "k_norm": (config.head_dim,),
    }
    layer_names = _GEMMA3_LAYER_NAMES if config.architecture == "gemma3" else _LAYER_NAMES
    names = {"model.embed_tokens.weight": (("embed",), (v, d)), "model.norm.weight": (("final_norm",), (d,))}
    if not config.tie_embeddings:
        names["lm_head.weight"] = (("lm_head",), (v, d))
    for i in range(config.num_layers):
        for ours, theirs in layer_names.items():
            names[f"model.layers.{i}.{theirs}.weight"] = (("layer", i, ours), shapes[ours])
    return names


def tensor_at(weights: ModelWeights, where: tuple):
    """The tensor of `weights` at a place hf_tensor_names gives."""
    return getattr(weights.layers[where[1]], where[2]) if where[0] == "layer" else getattr(weights, where[0])


def check_shape(file: str, name: str, shape, want) -> None:
    """ModelFileError naming the file and the tensor when its shape is not the one the config implies."""
    if tuple(shape) != tuple(want):
        raise ModelFileError(f"{file}: tensor {name} has shape {list(shape)}, expected {list(want)}")


def check_shapes(weights: ModelWeights, file: str, name_in_file=None) -> None:
    """check_shape for every tensor of `weights`; name_in_file(where) names a tensor as the file does
    (default: its Hugging Face name)."""
    for name, (where, want) in hf_tensor_names(weights.config).items():
        check_shape(file, name_in_file(where) if name_in_file else name, tensor_at(weights, where).shape, want)


def quant_specs(file: str, header: dict) -> dict:
    """The block-format tensors' {"format", "shape"} by name, from the file's metadata (QUANT_METADATA_KEY)."""
    try:
        return json.loads((header.get("__metadata__") or {}).get(QUANT_METADATA_KEY, "{}"))
    except json.JSONDecodeError:
        raise ModelFileError(f"{file}: bad {QUANT_METADATA_KEY} metadata") from None


# ---- reading -----------------------------------------------------------------------------------------

def _read_header(file: str) -> dict:
    try:
        size = os.path.getsize(file)
        with open(file, "rb") as f:
            head = f.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
            if not 2 <= n <= min(size - 8, 1 << 28):
                raise ValueError("bad header length")
            header = json.loads(f.read(n))
            if not isinstance(header, dict):
                raise ValueError("header is not an object")
    except FileNotFoundError:
        raise ModelFileError(f"{file}: weights file is missing") from None
    except (ValueError, UnicodeDecodeError, struct.error):
        raise ModelFileError(f"{file}: not a safetensors file") from None
    header["__data_start__"] = 8 + n
    return header


def _read_config(directory: str) -> tuple[ModelConfig, dict]:
    path = os.path.join(directory, CONFIG_NAME)
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise ModelFileError(f"{path}: missing (not a Hugging Face model directory)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelFileError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ModelFileError(f"{path}: not a model config")
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelFileError(
            f"{path}: unsupported model_type {model_type!r} (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    scaling = raw.get("rope_scaling")
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else scaling
        if kind != "default":
            raise ModelFileError(f"{path}: rope_scaling {kind!r} is not supported")
    for flag in ("attention_bias", "mlp_bias"):
        if raw.get(flag):
            raise ModelFileError(f"{path}: {flag} is not supported")
    act = raw.get("hidden_activation") or raw.get("hidden_act", "silu")
    want = "gelu_pytorch_tanh" if model_type == "gemma3_text" else "silu"
    if act != want:
        raise ModelFileError(f"{path}: activation {act!r} is not supported for {model_type} ({want})")
    try:
        return ModelConfig.from_hf(raw), raw
    except KeyError as e:
        raise ModelFileError(f"{path}: missing {e.args[0]}") from None
    except (TypeError, ValueError) as e:
        raise ModelFileError(f"{path}: {e}") from None


def _weight_files(directory: str) -> dict[str, str]:
    """HF tensor name -> file holding it (None -> every tensor in the single file)."""
    index = os.path.join(directory, INDEX_NAME)
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                wmap = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError):
            raise ModelFileError(f"{index}: not a safetensors index (no weight_map)") from None
        return {name: os.path.join(directory, shard) for name, shard in wmap.items()}
    single = os.path.join(directory, WEIGHTS_NAME)
    if not os.path.isfile(single):
        raise ModelFileError(f"{single}: weights file is missing")
    return {}


def read_safetensors_dir(directory: str | os.PathLike) -> ModelWeights:
    """Load a Hugging Face Llama directory (config.json + safetensors) into ModelWeights."""
    directory = os.fspath(directory)
    config, _ = _read_config(directory)
    files = _weight_files(directory)
    expected = hf_tensor_names(config)
    default_file = os.path.join(directory, WEIGHTS_NAME)
    by_file: dict[str, list[str]] = {}
    for name in expected:
        file = files.get(name, default_file if not files else None)
        if file is None:
            raise ModelFileError(f"{os.path.join(directory, INDEX_NAME)}: tensor {name} is not in the index")
        by_file.setdefault(file, []).append(name)

    loaded: dict[str, object] = {}
    for file, names in by_file.items():
        header = _read_header(file)
        quant = quant_specs(file, header)
        plain = []
        for name in names:
            info = header.get(name)
            if info is None:
                raise ModelFileError(f"{file}: tensor {name} is missing")
            dtype = info.get("dtype")
            if name in quant and dtype == "U8":
                continue
            if dtype not in _FLOAT_DTYPES:
                raise UnsupportedFormat(
                    f"{file}: tensor {name} has unsupported dtype {dtype} (supported: F32, F16, BF16)"
                )
            if dtype != "BF16":
                plain.append(name)
        arrays = {}
        if plain:
            try:
                with safe_open(file, framework="numpy") as f:
                    arrays = {name: f.get_tensor(name) for name in plain}
            except Exception as e:
                first = str(e).splitlines()[0] if str(e) else type(e).__name__
                raise ModelFileError(f"{file}: cannot read tensors ({first})") from None
        for name in names:
            info = header[name]
            shape = tuple(info["shape"])
            want = expected[name][1]
            if name in quant and info["dtype"] == "U8":
                spec = quant[name]
                fmt, logical = spec.get("format"), tuple(spec.get("shape", ()))
                if fmt not in BLOCK_FORMATS:
                    raise UnsupportedFormat(f"{file}: tensor {name} has unsupported format {fmt!r}")
                check_shape(file, name, logical, want)
                block, nbytes = gguf.GGML_QUANT_SIZES[GGML_TYPE[fmt]]
                if shape != (want[0], want[1] // block * nbytes):
                    raise ModelFileError(f"{file}: tensor {name} holds {shape} bytes, not {fmt} {list(want)}")
                loaded[name] = QuantTensor.from_raw(fmt, want, _raw(file, header, name))
                continue
            check_shape(file, name, shape, want)
            fmt = _FLOAT_DTYPES[info["dtype"]]
            raw = arrays[name] if name in arrays else _raw(file, header, name)
            if len(want) == 1:
                vec = QuantTensor.from_raw(fmt, (1, want[0]), raw).dequantize()[0].astype(np.float32)
                loaded[name] = vec + np.float32(_norm_offset(config))
            else:
                loaded[name] = QuantTensor.from_raw(fmt, want, raw)

    parts: dict = {"layers": [dict() for _ in range(config.num_layers)], "lm_head": None}
    for name, (where, _) in expected.items():
        if where[0] == "layer":
            parts["layers"][where[1]][where[2]] = loaded[name]
        else:
            parts[where[0]] = loaded[name]
    return ModelWeights(
        config=config,
        embed=parts["embed"],
        layers=[LayerWeights(**p) for p in parts["layers"]],
        final_norm=parts["final_norm"],
        lm_head=parts["lm_head"],
        metadata={"name": os.path.basename(os.path.normpath(directory)), "source": directory, "format": "safetensors"},
    )


def _raw(file: str, header: dict, name: str) -> np.ndarray:
    """A tensor's bytes straight from the file (for what the safetensors library cannot give numpy)."""
    start, end = header[name]["data_offsets"]
    out = np.empty(end - start, dtype=np.uint8)
    with open(file, "rb") as f:
        f.seek(header["__data_start__"] + start)
        got = f.readinto(memoryview(out))
    if got != end - start:
        raise ModelFileError(f"{file}: tensor {name} is truncated")
    return out


# ---- writing -----------------------------------------------------------------------------------------

_DTYPE_NAME = {"f32": "F32", "f16": "F16", "bf16": "BF16"}


def _tensors_of(weights: ModelWeights) -> tuple[dict[str, tuple[str, tuple, np.ndarray]], dict]:
    """HF name -> (safetensors dtype, shape, contiguous array) and the block-format metadata."""
    out, quant = {}, {}
    for name, (where, _) in hf_tensor_names(weights.config).items():
        obj = tensor_at(weights, where)
        if isinstance(obj, QuantTensor):
            if obj.format in BLOCK_FORMATS:
                out[name] = ("U8", obj.data.shape, np.ascontiguousarray(obj.data, dtype=np.uint8))
                quant[name] = {"format": obj.format, "shape": list(obj.shape)}
            else:
                out[name] = (_DTYPE_NAME[obj.format], obj.shape, np.ascontiguousarray(obj.data))
        else:
            vec = np.asarray(obj, dtype=np.float32) - np.float32(_norm_offset(weights.config))
            out[name] = ("F32", np.shape(obj), np.ascontiguousarray(vec))
    return out, quant


def _write_own(file: str, tensors: dict, metadata: dict) -> None:
    """The safetensors layout written directly: used for BF16, which numpy cannot name."""
    header, offset = {}, 0
    for name, (dtype, shape, arr) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
    header = {"__metadata__": metadata, **header}
    blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
    blob += b" " * (-len(blob) % 8)
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for _, _, arr in tensors.values():
            f.write(memoryview(arr).cast("B"))


def write_safetensors(file: str | os.PathLike, weights: ModelWeights) -> None:
    """Write every tensor of `weights` to one safetensors file (atomically: a temp file, then a rename)."""
    file = os.fspath(file)
    tensors, quant = _tensors_of(weights)
    metadata = {"format": "pt"}
    if quant:
        metadata[QUANT_METADATA_KEY] = json.dumps(quant, separators=(",", ":"))
    tmp = file + ".tmp"
    try:
        if any(dtype == "BF16" for dtype, _, _ in tensors.values()):
            _write_own(tmp, tensors, metadata)
        else:
            with open(tmp, "wb"):   # the mode open() gives (0666 less the umask), as config.json has
                mode = stat.S_IMODE(os.stat(tmp).st_mode)
            save_file({name: arr for name, (_, _, arr) in tensors.items()}, tmp, metadata=metadata)
            os.chmod(tmp, mode)   # the library writes 0600
        os.replace(tmp, file)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_safetensors_dir(directory: str | os.PathLike, weights: ModelWeights) -> list[str]:
    """Write config.json + model.safetensors; returns the paths written."""
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    cfg = weights.config.to_hf()
    fmts = weights.formats()
    if len(fmts) == 1 and next(iter(fmts)) in _DTYPE_NAME:
        cfg["torch_dtype"] = {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}[next(iter(fmts))]
    else:
        cfg["zen_formats"] = sorted(fmts)
    cfg_path = os.path.join(directory, CONFIG_NAME)
    with open(cfg_path, "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2)
    weights_path = os.path.join(directory, WEIGHTS_NAME)
    write_safetensors(weights_path, weights)
    index = os.path.join(directory, INDEX_NAME)
    if os.path.exists(index):  # a stale index would shadow the single file
        os.remove(index)
    return [cfg_path, weights_path]
