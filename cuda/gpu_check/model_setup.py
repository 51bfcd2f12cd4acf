"""The model gpu_check runs: the default model or random weights of its shapes, and the step inputs of a
batch whose sequences each own a fixed run of KV blocks."""
from __future__ import annotations

import dataclasses
import os

import numpy as np

from cuda.gpu_check.plan import BLOCK_SIZE, FULL, Plan
from cuda.gpu_check.report import Report


class BatchLayout:
    """StepInputs for `batch` sequences, each owning a fixed run of KV blocks (sequence s: blocks s*n..)."""

    def __init__(self, batch: int, max_len: int, block_size: int = BLOCK_SIZE):
        self.batch, self.block_size = batch, block_size
        self.blocks_per_seq = -(-max_len // block_size)
        self.num_blocks = batch * self.blocks_per_seq
        self.tables = np.arange(self.num_blocks, dtype=np.int32).reshape(batch, self.blocks_per_seq)

    def _slots(self, seqs: np.ndarray, pos: np.ndarray) -> np.ndarray:
        bs = self.block_size
        return self.tables[seqs, pos // bs].astype(np.int64) * bs + pos % bs

    def prefill(self, prompts: np.ndarray, first: int, count: int):
        """One step prefilling sequences first..first+count-1 with their whole prompts ([batch, P] ids)."""
        from models.llama import StepInput

        p = prompts.shape[1]
        seqs = np.repeat(np.arange(first, first + count), p)
        pos = np.tile(np.arange(p, dtype=np.int32), count)
        return StepInput(tokens=np.ascontiguousarray(prompts[first:first + count].reshape(-1), np.int32),
                         positions=pos, token_seq=(seqs - first).astype(np.int32),
                         slot_mapping=self._slots(seqs, pos), block_tables=self.tables[first:first + count],
                         logits_indices=(np.arange(1, count + 1) * p - 1).astype(np.int32))

    def decode(self, tokens: np.ndarray, position: int):
        """One decode step: token b of every sequence b at `position`."""
        from models.llama import StepInput

        seqs = np.arange(self.batch)
        pos = np.full(self.batch, position, np.int32)
        return StepInput(tokens=np.ascontiguousarray(tokens, np.int32), positions=pos,
                         token_seq=seqs.astype(np.int32), slot_mapping=self._slots(seqs, pos),
                         block_tables=self.tables, logits_indices=seqs.astype(np.int32))


def prefill_groups(batch: int, prompt_len: int, max_tokens: int) -> list[tuple[int, int]]:
    """(first, count) of the prefill steps that bring `batch` prompts in, at most max_tokens a step."""
    per = max(1, max_tokens // prompt_len)
    return [(s, min(per, batch - s)) for s in range(0, batch, per)]


def synthetic_weights(cfg, layer_fmt: str = "q4_1", embed_fmt: str = "q8_0", seed: int = 0):
    """Random weights of the given shape in the default model's formats (the stand-in when the file is missing)."""
    from models.quant import QuantTensor
    from models.weights import LayerWeights, ModelWeights

    rng = np.random.default_rng(seed)

    def mat(rows, cols, fmt, scale=None):
        w = rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(scale or cols ** -0.5)
        return QuantTensor.from_float(w, fmt)

    def norm():
        return (1.0 + 0.1 * rng.standard_normal(cfg.hidden_size)).astype(np.float32)

    d, f = cfg.hidden_size, cfg.intermediate_size
    layers = [LayerWeights(attn_norm=norm(), q=mat(cfg.q_size, d, layer_fmt), k=mat(cfg.kv_size, d, layer_fmt),
                           v=mat(cfg.kv_size, d, layer_fmt), o=mat(d, cfg.q_size, layer_fmt), ffn_norm=norm(),
                           gate=mat(f, d, layer_fmt), up=mat(f, d, layer_fmt), down=mat(d, f, layer_fmt))
              for _ in range(cfg.num_layers)]
    return ModelWeights(config=cfg, embed=mat(cfg.vocab_size, d, embed_fmt, 0.5), layers=layers,
                        final_norm=norm(), metadata={"name": "synthetic"})


def smollm2_135m_config():
    from models.config import ModelConfig

    return ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                       num_kv_heads=3, head_dim=64, rope_theta=100000.0, rms_norm_eps=1e-5, max_position=8192,
                       tie_embeddings=True, bos_token_id=1, eos_token_id=2)


def load_weights(path: str | None, report: Report, plan: Plan = FULL):
    from models.loader import default_model_path, load_model

    if plan.tiny_model:
        from models.config import ModelConfig

        cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                          num_kv_heads=1, head_dim=16, max_position=64)
        report.header.append(("model", "tiny synthetic (simulator run)"))
        return synthetic_weights(cfg), None, False
    path = path or default_model_path()
    if os.path.exists(path):
        weights, tok = load_model(path)
        report.header.append(("model", f"{os.path.basename(path)} ({', '.join(sorted(weights.formats()))})"))
        return weights, tok, True
    report.header.append(("model", "synthetic: SmolLM2-135M shapes, random weights, q4_1 layers + q8_0 embeddings"))
    shown = os.path.relpath(path) if not os.path.relpath(path).startswith("..") else os.path.basename(path)
    report.notes.append(f"{shown} was not on this machine: a model of the same shapes and formats with random "
                        "weights stood in. "
                        "Throughput is that of the default model; the cpu/cuda comparison is on random weights.")
    return synthetic_weights(smollm2_135m_config()), None, False


def logits_of(weights, be, ids: np.ndarray) -> np.ndarray:
    """Logits [T, V] of one sequence through the cuda backend."""
    from models.llama import LlamaModel

    model = LlamaModel(weights, be)
    layout = BatchLayout(1, len(ids))
    kc, vc = model.allocate_kv_cache(layout.num_blocks, layout.block_size)
    step = dataclasses.replace(layout.prefill(ids[None, :], 0, 1), logits_indices=np.arange(len(ids), dtype=np.int32))
    return be.download(model.forward(step, kc, vc))


def upload_step(b, step):
    """The step inputs, each array copied to the device."""
    from models.llama import StepInput

    return StepInput(*(b.upload(a) for a in (step.tokens, step.positions, step.token_seq, step.slot_mapping,
                                             step.block_tables, step.logits_indices)))


def prefilled(model, layout: BatchLayout, prompts: np.ndarray, sample) -> tuple:
    """A KV cache holding every sequence's prompt (per-op path): (k_cache, v_cache, each one's first token)."""
    kc, vc = model.allocate_kv_cache(layout.num_blocks, layout.block_size)
    tokens = np.zeros(layout.batch, np.int32)
    for first, count in prefill_groups(layout.batch, prompts.shape[1], 2048):
        logits = model.forward(upload_step(model.backend, layout.prefill(prompts, first, count)), kc, vc)
        tokens[first:first + count] = sample(logits, count)
    return kc, vc, tokens


def greedy_sampler(be):
    """sample(logits, rows) -> greedy ids on the device; sample.batch(rows): its SamplingBatch."""
    from engine.backends.contract import RowSpec, SamplingBatch, SamplingParams

    batches = {}

    def batch(rows):
        if rows not in batches:
            batches[rows] = SamplingBatch.build([RowSpec(params=SamplingParams(temperature=0.0), seed=0, step=0)]
                                                * rows)
        return batches[rows]

    def sample(logits, rows):
        return be.sample(logits, batch(rows)).token_ids.astype(np.int32)

    sample.batch = batch
    return sample
