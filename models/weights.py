"""ModelWeights: a decoder model's tensors (Llama family, Gemma 3) in Hugging Face orientation and RoPE layout.

Norm weights are the factors the normalized activations are multiplied by: Gemma's (1 + w) is stored with
the 1 added, as its GGUF files store it (the safetensors reader adds it to a Hugging Face file's w).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from models.config import ModelConfig
from models.quant import QuantTensor


class ModelFileError(ValueError):
    """A model file that cannot be loaded as it is (the message names the file)."""


@dataclass
class LayerWeights:
    attn_norm: np.ndarray  # [D] float32
    q: QuantTensor         # [H*Dh, D]
    k: QuantTensor         # [Hkv*Dh, D]
    v: QuantTensor         # [Hkv*Dh, D]
    o: QuantTensor         # [D, H*Dh]
    ffn_norm: np.ndarray   # [D] float32
    gate: QuantTensor      # [F, D]
    up: QuantTensor        # [F, D]
    down: QuantTensor      # [D, F]
    # Gemma 3 only (None for Llama): RMSNorm of each q and k head, and of the attention and MLP outputs
    q_norm: np.ndarray | None = None          # [Dh] float32
    k_norm: np.ndarray | None = None          # [Dh] float32
    post_attn_norm: np.ndarray | None = None  # [D] float32
    post_ffn_norm: np.ndarray | None = None   # [D] float32

    NORMS = ("attn_norm", "ffn_norm", "q_norm", "k_norm", "post_attn_norm", "post_ffn_norm")

    def norms(self) -> dict[str, np.ndarray]:
        """The norm vectors this layer has."""
        return {n: getattr(self, n) for n in self.NORMS if getattr(self, n) is not None}

    def matrices(self) -> dict[str, QuantTensor]:
        return {n: getattr(self, n) for n in ("q", "k", "v", "o", "gate", "up", "down")}


@dataclass
class ModelWeights:
    config: ModelConfig
    embed: QuantTensor                 # [V, D]
    layers: list[LayerWeights]
    final_norm: np.ndarray             # [D] float32
    lm_head: QuantTensor | None = None  # [V, D]; None when tied to embed
    metadata: dict = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        total = self.embed.nbytes + self.final_norm.nbytes
        if self.lm_head is not None:
            total += self.lm_head.nbytes
        for lw in self.layers:
            total += sum(v.nbytes for v in lw.norms().values()) + sum(m.nbytes for m in lw.matrices().values())
        return total

    def formats(self) -> set[str]:
        fm = {self.embed.format}
        for lw in self.layers:
            fm |= {m.format for m in lw.matrices().values()}
        return fm

    def converted(self, fmt: str | None) -> "ModelWeights":
        """The same model with every matrix re-encoded in `fmt` (norms stay float32)."""
        if fmt is None:
            return self
        layers = [replace(lw, **{n: m.convert(fmt) for n, m in lw.matrices().items()}) for lw in self.layers]
        return ModelWeights(
            config=self.config, embed=self.embed.convert(fmt), layers=layers, final_norm=self.final_norm,
            lm_head=None if self.lm_head is None else self.lm_head.convert(fmt), metadata=dict(self.metadata),
        )
