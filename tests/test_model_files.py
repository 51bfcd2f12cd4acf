"""Model files: GGUF and safetensors round trips, q/k un-permutation, load_model, the convert command,
and loading errors."""
from __future__ import annotations

import dataclasses
import json
import os
import stat
import subprocess
import sys
import types

import gguf
import numpy as np
import pytest
from safetensors.numpy import save_file

from models import convert
from models.gguf_file import FastGGUFReader, ModelFileError, open_gguf, read_gguf, unpermute_rope_rows
from models.loader import default_model_path, load_model, load_tokenizer, read_gguf_fields
from models import kquants
from models.formats import K_FORMATS
from models.inspect import inspect_model, resolve_quantization
from models.quant import BLOCK_FORMATS, FORMATS, GGML_TYPE, QuantTensor, UnsupportedFormat, bytes_per_weight
from models.safetensors_file import QUANT_METADATA_KEY, read_safetensors_dir, write_safetensors_dir
from models.weights import ModelWeights
from tests import reference, tiny_model
from tests.quant_blocks import random_tensor, row_length
from tests.tiny_model import (
    TINY_VOCAB, make_tiny_tokenizer, make_tiny_weights, permute_rope_rows, tiny_tokenizer_fields, write_tiny_gguf,
    write_tiny_safetensors,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENS = [1, 5, 40, 260, 100, 2, 77, 270]


def _tensors(w: ModelWeights) -> dict:
    """Every tensor of a model by name: QuantTensor or float32 vector."""
    out = {"embed": w.embed, "final_norm": w.final_norm}
    if w.lm_head is not None:
        out["lm_head"] = w.lm_head
    for i, lw in enumerate(w.layers):
        out[f"{i}.attn_norm"], out[f"{i}.ffn_norm"] = lw.attn_norm, lw.ffn_norm
        out.update({f"{i}.{n}": m for n, m in lw.matrices().items()})
    return out


def assert_same_weights(a: ModelWeights, b: ModelWeights, exact_bytes=True):
    ta, tb = _tensors(a), _tensors(b)
    assert ta.keys() == tb.keys()
    for name in ta:
        x, y = ta[name], tb[name]
        if isinstance(x, QuantTensor):
            assert isinstance(y, QuantTensor) and x.shape == y.shape, name
            if exact_bytes:
                assert x.format == y.format, name
                assert np.array_equal(x.data, y.data), name
            assert np.array_equal(x.dequantize(), y.dequantize()), name
        else:
            assert y.dtype == np.float32 and np.array_equal(x, y), name


def assert_same_config(a, b):
    da, db = vars(a).copy(), vars(b).copy()
    ea, eb = da.pop("rms_norm_eps"), db.pop("rms_norm_eps")
    assert da == db
    assert abs(ea - eb) <= 1e-6 * ea  # GGUF stores it as float32


# ---- formats --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS)
def test_bytes_per_weight_is_the_stored_size(fmt):
    w = np.random.default_rng(0).standard_normal((8, row_length(fmt, 64))).astype(np.float32)
    t = QuantTensor.from_float(w, fmt)
    assert t.nbytes == bytes_per_weight(fmt) * w.size
    with pytest.raises(UnsupportedFormat):
        bytes_per_weight("q2_k")


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_affine_view_is_gguf_dequantization(fmt):
    """codes * scale + offset per group (what the backends repack from) equals gguf's dequantize exactly,
    on random blocks (K-quants from random fields) and on blocks encoded from floats."""
    rng = np.random.default_rng(1)
    k = row_length(fmt, 64)
    for t in (random_tensor(rng, fmt, 4, k), QuantTensor.from_float(rng.standard_normal((4, k)), fmt)):
        codes, scale, offset, g = t.affine()
        assert codes.shape == t.shape and scale.shape == offset.shape == (4, k // g)
        w = np.repeat(scale, g, axis=1) * codes + np.repeat(offset, g, axis=1)
        assert np.array_equal(w, gguf.quants.dequantize(t.data, GGML_TYPE[fmt]).reshape(t.shape))


@pytest.mark.parametrize("fmt", K_FORMATS)
def test_k_quant_fields_round_trip_and_encoder_error(fmt):
    """pack(unpack(blocks)) gives the blocks back; the encoder lands within a few percent of the input."""
    rng = np.random.default_rng(2)
    t = random_tensor(rng, fmt, 3, 512)
    raw = t.data.reshape(-1, kquants.SUPER_BYTES[fmt])
    assert np.array_equal(kquants.pack(fmt, kquants.unpack(fmt, raw)), raw)
    w = rng.standard_normal((16, 512)).astype(np.float32)
    err = np.abs(QuantTensor.from_float(w, fmt).dequantize() - w).mean() / np.abs(w).mean()
    assert err < {"q4_k": 0.12, "q5_k": 0.06, "q6_k": 0.03}[fmt], err
    with pytest.raises(ValueError, match="divisible by 256"):
        QuantTensor.from_float(w[:, :320], fmt)


def test_k_quant_conversion_falls_back_where_rows_are_not_256_long():
    """As llama.cpp: q4_k -> q5_0, q5_k -> q5_1, q6_k -> q8_0 for matrices of 576-long rows (SmolLM2)."""
    w = QuantTensor.from_float(np.random.default_rng(3).standard_normal((4, 576)), "f32")
    assert [w.convert(f).format for f in K_FORMATS] == ["q5_0", "q5_1", "q8_0"]
    assert QuantTensor.from_float(np.ones((2, 512)), "f32").convert("q4_k").format == "q4_k"
    odd = QuantTensor.from_float(np.ones((2, 100)), "f32")     # no block of any format divides 100
    assert {odd.convert(f).format for f in (*K_FORMATS, "q8_0", "q4_1")} == {"f16"}


# ---- GGUF ---------------------------------------------------------------------------------------------

def test_rope_permutation_is_inverted_by_unpermute():
    t = QuantTensor.from_float(np.random.default_rng(0).standard_normal((64, 32)), "q8_0")
    for heads in (1, 2, 4):
        p = permute_rope_rows(t, heads)
        assert not np.array_equal(p.data, t.data)
        assert np.array_equal(unpermute_rope_rows(p, heads).data, t.data)
    # llama.cpp's converter: rows of each head reordered (half, i) -> (i, half)
    w = np.arange(8)[:, None].astype(np.float32) * np.ones((1, 32), np.float32)
    assert permute_rope_rows(QuantTensor.from_float(w, "f32"), 1).data[:, 0].tolist() == [0, 4, 1, 5, 2, 6, 3, 7]


@pytest.mark.parametrize("fmt", FORMATS)
def test_gguf_round_trip(tmp_path, fmt):
    w = make_tiny_weights(1, fmt, tie_embeddings=fmt != "q4_1")
    path = write_tiny_gguf(tmp_path / f"tiny-{fmt}.gguf", w)
    assert os.path.getsize(path) < 1_000_000
    back, fields = read_gguf(path)
    assert_same_config(back.config, w.config)
    assert_same_weights(w, back)
    assert (back.lm_head is None) == (fmt != "q4_1")
    assert fields["ggml.tokens"] == tiny_tokenizer_fields()["ggml.tokens"]


def test_gguf_unpermutes_q_and_k(tmp_path):
    w = make_tiny_weights(2, "f32")
    back, _ = read_gguf(write_tiny_gguf(tmp_path / "tiny.gguf", w))
    want = reference.forward(w, TOKENS)
    got = reference.forward(back, TOKENS)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    # control: the rows as stored in the file (llama.cpp's order) give a different model under HF RoPE
    stored = read_gguf(str(tmp_path / "tiny.gguf"))[0]
    for lw in stored.layers:
        lw.q = permute_rope_rows(lw.q, w.config.num_heads)
        lw.k = permute_rope_rows(lw.k, w.config.num_kv_heads)
    assert np.abs(reference.forward(stored, TOKENS) - want).max() > 1e-2


def test_fast_reader_equals_gguf_reader(tmp_path):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", make_tiny_weights(0, "q8_0"))
    _assert_same_reader(gguf.GGUFReader(path), FastGGUFReader(path))


def test_truncated_metadata_array_is_a_model_file_error(tmp_path):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", make_tiny_weights(0, "f32"))
    tokens = FastGGUFReader(path).fields["tokenizer.ggml.tokens"]
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(open(path, "rb").read()[:tokens.offset + 200])   # inside the token strings
    with pytest.raises(ModelFileError, match="cut.gguf"):
        open_gguf(str(cut))
    with pytest.raises(ModelFileError):
        read_gguf(str(cut))


def test_tokenizer_metadata_is_read_on_use(tmp_path):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", make_tiny_weights(0, "f32"))
    _, fields = read_gguf(path)
    want = read_gguf_fields(path)
    assert set(fields) == set(want) and len(fields) == len(want) and "ggml.tokens" in fields
    assert {k: fields[k] for k in fields} == want
    assert fields.get("no.such.key") is None


def _assert_same_reader(slow, fast):
    assert list(slow.fields) == list(fast.fields)
    for key, a in slow.fields.items():
        b = fast.fields[key]
        assert (a.offset, a.name, a.data, a.types) == (b.offset, b.name, b.data, b.types), key
        assert a.contents() == b.contents(), key
        assert len(a.parts) == len(b.parts), key
        assert all(x.dtype == y.dtype and np.array_equal(x, y) for x, y in zip(a.parts, b.parts)), key
        if a.types and a.types[0] == gguf.GGUFValueType.ARRAY and a.data:
            assert a.contents(0) == b.contents(0) and a.contents(-1) == b.contents(-1), key
    assert [(t.name, t.tensor_type, t.data_offset, t.n_bytes) for t in slow.tensors] == \
           [(t.name, t.tensor_type, t.data_offset, t.n_bytes) for t in fast.tensors]
    assert slow.data_offset == fast.data_offset


# ---- safetensors --------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS)
def test_safetensors_round_trip(tmp_path, fmt):
    w = make_tiny_weights(3, fmt, tie_embeddings=fmt != "bf16")
    write_safetensors_dir(tmp_path, w)
    back = read_safetensors_dir(tmp_path)
    assert back.config == w.config
    assert_same_weights(w, back)
    meta = json.loads(open(tmp_path / "config.json").read())
    assert meta["model_type"] == "llama" and meta["num_hidden_layers"] == 2


def test_safetensors_layout_is_huggingface(tmp_path):
    from safetensors import safe_open

    write_safetensors_dir(tmp_path / "f16", make_tiny_weights(0, "f16"))
    with safe_open(str(tmp_path / "f16" / "model.safetensors"), framework="numpy") as f:
        names = set(f.keys())
        assert {"model.embed_tokens.weight", "model.norm.weight", "model.layers.1.mlp.down_proj.weight",
                "model.layers.0.self_attn.q_proj.weight", "model.layers.0.input_layernorm.weight",
                "model.layers.0.post_attention_layernorm.weight"} <= names
        assert "lm_head.weight" not in names  # tied
        assert f.get_tensor("model.layers.0.self_attn.k_proj.weight").dtype == np.float16
        assert f.get_tensor("model.layers.0.self_attn.k_proj.weight").shape == (32, 64)
    write_safetensors_dir(tmp_path / "bf16", make_tiny_weights(0, "bf16"))
    with safe_open(str(tmp_path / "bf16" / "model.safetensors"), framework="numpy") as f:
        assert f.get_slice("model.layers.0.mlp.up_proj.weight").get_dtype() == "BF16"
    write_safetensors_dir(tmp_path / "q4", make_tiny_weights(0, "q4_0"))
    with safe_open(str(tmp_path / "q4" / "model.safetensors"), framework="numpy") as f:
        quant = json.loads(f.metadata()[QUANT_METADATA_KEY])
        assert quant["model.layers.0.mlp.up_proj.weight"] == {"format": "q4_0", "shape": [128, 64]}
        assert f.get_tensor("model.layers.0.mlp.up_proj.weight").dtype == np.uint8


def test_weights_file_has_the_mode_of_config_json(tmp_path):
    """Written by the safetensors library (0600 of its own) or by us (BF16): the umask's mode either way."""
    for fmt in ("q8_0", "bf16"):
        write_safetensors_dir(tmp_path / fmt, make_tiny_weights(0, fmt))
        modes = {stat.S_IMODE(os.stat(tmp_path / fmt / name).st_mode) for name in ("config.json", "model.safetensors")}
        assert len(modes) == 1, (fmt, [oct(m) for m in modes])


def test_sharded_huggingface_directory(tmp_path):
    """A directory as transformers saves it: shards + index, fp16 everywhere (norms too), untied head."""
    w = make_tiny_weights(4, "f16", tie_embeddings=False)
    write_safetensors_dir(tmp_path / "single", w)
    from safetensors.numpy import load_file

    tensors = load_file(str(tmp_path / "single" / "model.safetensors"))
    tensors = {k: (v.astype(np.float16) if v.dtype == np.float32 else v) for k, v in tensors.items()}
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    d = tmp_path / "sharded"
    d.mkdir()
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(d / shard), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: s for s, keys in shards.items() for k in keys}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    (d / "config.json").write_text((tmp_path / "single" / "config.json").read_text())
    back = read_safetensors_dir(d)
    for name, t in _tensors(w).items():
        got = _tensors(back)[name]
        if isinstance(t, QuantTensor):
            assert got.format == "f16" and np.array_equal(got.data, t.data), name
        else:
            assert np.array_equal(got, t.astype(np.float16).astype(np.float32)), name
    assert back.lm_head is not None


def test_bf16_checkpoint_with_bf16_norms(tmp_path):
    """transformers writes bf16 models with bf16 norms; they load as float32 vectors."""
    from models.safetensors_file import _tensors_of, _write_own

    w = make_tiny_weights(6, "bf16")
    write_safetensors_dir(tmp_path, w)
    tensors, _ = _tensors_of(w)
    for name, (dtype, shape, arr) in list(tensors.items()):
        if dtype == "F32":  # the norms
            tensors[name] = ("BF16", shape, QuantTensor.from_float(arr[None, :], "bf16").data[0])
    _write_own(str(tmp_path / "model.safetensors"), tensors, {"format": "pt"})
    back = read_safetensors_dir(tmp_path)
    assert back.formats() == {"bf16"}
    want = QuantTensor.from_float(w.final_norm[None, :], "bf16").dequantize()[0]
    assert back.final_norm.dtype == np.float32 and np.array_equal(back.final_norm, want)
    assert not np.array_equal(back.final_norm, w.final_norm)  # really went through bf16
    assert np.array_equal(back.layers[1].gate.data, w.layers[1].gate.data)


# ---- load_model and convert ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    w = make_tiny_weights(5, "f32")
    return {
        "weights": w,
        "gguf": write_tiny_gguf(d / "tiny.gguf", w),
        "dir": write_tiny_safetensors(d / "tiny-hf", w),
        "tmp": d,
    }


def test_load_model_both_layouts(tiny_files):
    w = tiny_files["weights"]
    tok_ref = make_tiny_tokenizer()
    for path in (tiny_files["gguf"], tiny_files["dir"]):
        weights, tok = load_model(path)
        assert_same_weights(w, weights)
        assert tok.encode(" the cat 😀") == tok_ref.encode(" the cat 😀")
        assert tok.stop_token_ids == (2, 0) and tok.vocab_size == TINY_VOCAB
        assert load_tokenizer(path).encode("<|im_end|>") == [2]
    np.testing.assert_allclose(reference.forward(load_model(tiny_files["gguf"])[0], TOKENS),
                               reference.forward(load_model(tiny_files["dir"])[0], TOKENS), rtol=1e-6, atol=1e-6)


def test_load_model_quantization(tiny_files):
    w = tiny_files["weights"]
    for fmt in ("q8_0", "f16"):
        weights, _ = load_model(tiny_files["gguf"], quantization=fmt)
        assert weights.formats() == {fmt}
        assert weights.layers[0].attn_norm.dtype == np.float32
        want = QuantTensor.from_float(w.layers[1].down.dequantize(), fmt)
        assert np.array_equal(weights.layers[1].down.data, want.data)
    with pytest.raises(UnsupportedFormat, match="q2_k"):
        load_model(tiny_files["gguf"], quantization="q2_k")


@pytest.mark.parametrize("fmt", ["f16", "q8_0"])
def test_convert_command(tiny_files, fmt):
    out = tiny_files["tmp"] / f"converted-{fmt}"
    if fmt == "f16":  # the real command line once
        r = subprocess.run([sys.executable, "-m", "models.convert", tiny_files["gguf"], str(out), "--format", fmt],
                           cwd=REPO, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert "wrote" in r.stdout
    else:
        assert convert.main([tiny_files["gguf"], str(out), "--format", fmt]) == 0
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(os.listdir(out))
    back, tok = load_model(out)
    expected, tok_ref = load_model(tiny_files["gguf"], quantization=fmt)
    assert_same_weights(expected, back)
    assert tok.encode("<|im_start|>user\n the cat<|im_end|>") == tok_ref.encode("<|im_start|>user\n the cat<|im_end|>")
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == \
        tok_ref.apply_chat_template([{"role": "user", "content": "x"}])
    # and on again, safetensors -> safetensors keeps it
    again = tiny_files["tmp"] / f"again-{fmt}"
    assert convert.main([str(out), str(again)]) == 0
    assert_same_weights(back, load_model(again)[0])


def test_convert_refuses_its_own_source(tiny_files, capsys):
    assert convert.main([tiny_files["dir"], tiny_files["dir"], "--format", "f16"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error:") and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("fmt", ["q4_1", "q4_k"])
def test_inspect_converted_block_formats_as_the_gguf(tmp_path, fmt):
    """A directory convert writes with block formats (raw bytes as U8, the format in the metadata) is
    counted in its formats, as the GGUF it came from: not as float32 bytes."""
    path = write_tiny_gguf(tmp_path / "tiny.gguf", make_tiny_weights(0, fmt))
    assert convert.main([path, str(tmp_path / "hf")]) == 0
    a, b = inspect_model(path), inspect_model(str(tmp_path / "hf"))
    assert (b.stored_format, b.matrices, b.vector_bytes, b.stored_bytes) == \
           (a.stored_format, a.matrices, a.vector_bytes, a.stored_bytes) and a.stored_format == fmt


# ---- errors -------------------------------------------------------------------------------------------

def test_missing_path(tmp_path, capsys):
    missing = str(tmp_path / "nope.gguf")
    with pytest.raises(FileNotFoundError) as e:
        load_model(missing)
    assert missing in str(e.value) and "\n" not in str(e.value)
    assert convert.main([missing, str(tmp_path / "out")]) == 1
    assert missing in capsys.readouterr().err


def test_not_a_model(tmp_path):
    text = tmp_path / "model.gguf"
    text.write_text("this is not a model\n")
    for path in (text, tmp_path):
        with pytest.raises(ModelFileError) as e:
            load_model(path)
        assert str(path) in str(e.value) and "\n" not in str(e.value)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ModelFileError, match="empty.gguf"):
        load_model(empty)
    # GGUF magic but garbage after it
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\xff" * 64)
    with pytest.raises(ModelFileError, match="bad.gguf"):
        load_model(bad)
    # a directory with config.json but no weights
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(make_tiny_weights(0).config.to_hf()))
    with pytest.raises(ModelFileError, match="model.safetensors"):
        load_model(d)
    (d / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(ModelFileError, match="bert"):
        load_model(d)


@pytest.mark.parametrize("scaling", ["linear", "yarn", "llama3"])
def test_rope_scaling_is_refused_not_ignored(tmp_path, scaling):
    def add(w):
        if scaling == "llama3":   # Llama 3.1's frequency factors, as a tensor
            w.add_tensor("rope_freqs.weight", np.ones(8, np.float32))
        else:
            w.add_string("llama.rope.scaling.type", scaling)
            w.add_float32("llama.rope.scaling.factor", 8.0)
    path = write_tiny_gguf(tmp_path / "scaled.gguf", make_tiny_weights(0), extra=add)
    with pytest.raises(ModelFileError, match="RoPE scaling"):
        load_model(path)


def test_gguf_tensor_without_kernels_loads_dequantized(tmp_path):
    w = make_tiny_weights(0, "q8_0")
    dense = np.random.default_rng(5).standard_normal(w.embed.shape).astype(np.float32)
    mxfp4 = gguf.quants.quantize(dense, gguf.GGMLQuantizationType.MXFP4)   # a type no kernel here takes
    path = write_tiny_gguf(tmp_path / "mxfp4.gguf", w,
                           raw_tensors={"token_embd.weight": (mxfp4, gguf.GGMLQuantizationType.MXFP4)})
    loaded, _ = load_model(path)
    assert loaded.embed.format == "f32" and loaded.formats() == {"f32", "q8_0"}
    want = gguf.quants.dequantize(mxfp4, gguf.GGMLQuantizationType.MXFP4)
    np.testing.assert_array_equal(loaded.embed.dequantize(), want)
    assert np.corrcoef(want.ravel(), dense.ravel())[0, 1] > 0.9   # a real encoding of `dense`
    info = inspect_model(path)
    assert info.loads_dequantized and info.stored_format == "q8_0"
    # asked for its stored format, such a file is re-encoded rather than kept half float32
    assert resolve_quantization("q8_0", info.stored_format, info.loads_dequantized) == ("q8_0", "q8_0")
    assert resolve_quantization(None, info.stored_format, info.loads_dequantized) == ("q8_0", None)


def test_unreadable_gguf_tensor_type(tmp_path):
    w = make_tiny_weights(0, "q8_0")
    block, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_1]
    q8_1 = np.zeros((w.embed.shape[0], w.embed.shape[1] // block * nbytes), np.uint8)
    path = write_tiny_gguf(tmp_path / "q81.gguf", w,
                           raw_tensors={"token_embd.weight": (q8_1, gguf.GGMLQuantizationType.Q8_1)})
    with pytest.raises(UnsupportedFormat) as e:
        load_model(path)
    assert "Q8_1" in str(e.value) and path in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("config, tensor, shape, expected", [
    ({"intermediate_size": 96}, "blk.0.ffn_gate.weight", [128, 64], [96, 64]),
    ({"num_kv_heads": 1}, "blk.0.attn_k.weight", [32, 64], [16, 64]),
    ({"head_dim": 8}, "blk.0.attn_q.weight", [64, 64], [32, 64]),
    ({"hidden_size": 32}, "token_embd.weight", [TINY_VOCAB, 64], [TINY_VOCAB, 32]),
], ids=["feed_forward_length", "head_count_kv", "key_length", "embedding_length"])
def test_gguf_metadata_disagreeing_with_its_tensors_is_refused(tmp_path, capsys, config, tensor, shape, expected):
    """Loaded, such a file would run the kernels over the config's shapes, past the tensors' ends."""
    w = make_tiny_weights(0)
    w.config = dataclasses.replace(w.config, **config)   # the metadata written; the tensors stay as they are
    path = write_tiny_gguf(tmp_path / "bad.gguf", w)
    with pytest.raises(ModelFileError) as e:
        load_model(path)
    assert str(e.value) == f"{path}: tensor {tensor} has shape {shape}, expected {expected}"
    assert convert.main([path, str(tmp_path / "out")]) == 1
    assert capsys.readouterr().err == f"error: {e.value}\n"


@pytest.mark.parametrize("key, value, says", [
    ("num_kv_heads", 0, "llama.attention.head_count_kv is 0"),
    ("num_heads", 0, "llama.attention.head_count is 0"),
    ("intermediate_size", [128, 128], "llama.feed_forward_length holds per-layer values"),
], ids=["head_count_kv", "head_count", "feed_forward_length"])
def test_bad_gguf_metadata_value_names_the_key(tmp_path, monkeypatch, capsys, key, value, says):
    def add_shape_metadata(writer, cfg):   # ModelConfig itself refuses these values
        original(writer, types.SimpleNamespace(**{**dataclasses.asdict(cfg), key: value}))
    original = tiny_model.add_shape_metadata
    monkeypatch.setattr(tiny_model, "add_shape_metadata", add_shape_metadata)
    path = write_tiny_gguf(tmp_path / "bad.gguf", make_tiny_weights(0))
    with pytest.raises(ModelFileError) as e:
        load_model(path)
    assert str(e.value).startswith(f"{path}: {says}")
    assert convert.main([path, str(tmp_path / "out")]) == 1
    assert capsys.readouterr().err == f"error: {e.value}\n"


def test_truncated_gguf_says_so(tmp_path):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", make_tiny_weights(0))
    last = max(FastGGUFReader(path).tensors, key=lambda t: t.data_offset)
    end = last.data_offset + last.n_bytes
    cut = tmp_path / "partial.gguf"
    cut.write_bytes(open(path, "rb").read()[:end - 100])   # a download stopped inside the last tensor
    with pytest.raises(ModelFileError) as e:
        load_model(cut)
    assert str(e.value) == f"{cut}: the file is truncated: tensor {last.name} needs {end} bytes, the file has {end - 100}"


def test_unsupported_safetensors_dtype(tmp_path):
    write_tiny_safetensors(tmp_path, make_tiny_weights(0, "f32"))
    from safetensors.numpy import load_file

    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["model.norm.weight"] = tensors["model.norm.weight"].astype(np.int32)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(UnsupportedFormat) as e:
        load_model(tmp_path)
    assert "I32" in str(e.value) and "model.safetensors" in str(e.value) and "model.norm.weight" in str(e.value)


# ---- the default model file ---------------------------------------------------------------------------

def test_real_model_loads():
    path = default_model_path()
    weights, tok = load_model(path)
    cfg = weights.config
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == \
           (30, 576, 9, 3, 64, 49152)
    assert cfg.tie_embeddings and weights.lm_head is None
    assert weights.embed.format == "q8_0" and weights.layers[0].q.format == "q4_1"
    assert tok.encode("The capital of France is") == [504, 3575, 282, 4649, 314]
    assert read_gguf_fields(path)["ggml.pre"] == "smollm"


@pytest.mark.slow
def test_real_model_fast_reader_and_convert(tmp_path):
    path = default_model_path()
    _assert_same_reader(gguf.GGUFReader(path), FastGGUFReader(path))
    assert convert.main([path, str(tmp_path / "smol")]) == 0  # formats kept: q8_0 embeddings, q4_1 layers
    a, ta = load_model(path)
    b, tb = load_model(tmp_path / "smol")
    assert_same_weights(a, b)
    assert tb.encode("The capital of France is") == [504, 3575, 282, 4649, 314]
    assert ta.stop_token_ids == tb.stop_token_ids
