"""ModelWeights: a Llama-family model's tensors in Hugging Face orientation and RoPE layout."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from models.config import ModelConfig
from models.quant import QuantTensor


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
            total += lw.attn_norm.nbytes + lw.ffn_norm.nbytes + sum(m.nbytes for m in lw.matrices().values())
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
        layers = [
            LayerWeights(
                attn_norm=lw.attn_norm, ffn_norm=lw.ffn_norm,
                **{n: m.convert(fmt) for n, m in lw.matrices().items()},
            )
            for lw in self.layers
        ]
        return ModelWeights(
            config=self.config, embed=self.embed.convert(fmt), layers=layers, final_norm=self.final_norm,
            lm_head=None if self.lm_head is None else self.lm_head.convert(fmt), metadata=dict(self.metadata),
        )
