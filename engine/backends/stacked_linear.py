"""The packing plan of a linear layer, shared by the backends: which stored matrices one layer holds and
which output columns each produces."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from models.quant import QuantTensor


@dataclass
class LinearPart:
    """One stored matrix of a (possibly fused) linear layer, in a backend's layout."""
    family: str      # q4, q8, f32, f16, bf16
    arrays: tuple    # the backend's arrays of it (e.g. quants and scales)
    rows: int
    col0: int        # first output column it produces


class StackedLinear:
    """y = x @ W.T for one or more stored matrices stacked along the output (e.g. q|k|v, gate|up).

    layout(t) -> (family, arrays): a stored matrix in the backend's layout."""

    nbytes: int   # bytes of the weights in the backend's memory (each backend counts its own layout)

    def __init__(self, tensors: list[QuantTensor], layout: Callable[[QuantTensor], tuple[str, tuple]]):
        self.in_features = tensors[0].shape[1]
        if any(t.shape[1] != self.in_features for t in tensors):
            raise ValueError("fused matrices must share their input size")
        if len(tensors) > 1 and len({t.format for t in tensors}) == 1:
            # one packed matrix: one kernel call per product and better balance across threads
            tensors = [QuantTensor(tensors[0].format, (sum(t.shape[0] for t in tensors), self.in_features),
                                   np.concatenate([t.data for t in tensors]))]
        self.parts: list[LinearPart] = []
        col = 0
        for t in tensors:
            family, arrays = layout(t)
            self.parts.append(LinearPart(family, tuple(arrays), t.shape[0], col))
            col += t.shape[0]
        self.out_features = col
        self.formats = tuple(t.format for t in tensors)
