"""Rotary position embedding tables (rotate-half RoPE), the same for every backend."""
from __future__ import annotations

import numpy as np


def rope_tables(max_position: int, head_dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [max_position, head_dim/2] float32, computed in float64."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    ang = np.arange(max_position, dtype=np.float64)[:, None] * inv_freq[None, :]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
