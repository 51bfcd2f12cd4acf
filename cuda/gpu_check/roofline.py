"""What a GPU can do at best: memory bandwidth, FP32 peak, and the roofline of decode and prefill."""
from __future__ import annotations

# Memory bandwidth from the vendors' datasheets (bytes/s), matched on the device name; else from the clocks.
BANDWIDTH = [
    ("H200", 4.8e12), ("H100 NVL", 3.9e12), ("H100 PCIe", 2.0e12), ("H100", 3.35e12), ("GH200", 4.0e12),
    ("A100-SXM4-80GB", 2.039e12), ("A100 80GB PCIe", 1.935e12), ("A100", 1.555e12), ("L40S", 0.864e12),
    ("L40", 0.864e12), ("L4", 0.3e12), ("A10", 0.6e12), ("RTX 4090", 1.008e12), ("RTX 3090", 0.936e12),
    ("T4", 0.32e12),
]
FP32_LANES = {(7, 0): 64, (7, 5): 64, (8, 0): 64}  # FP32 lanes per SM; 128 otherwise (sm_86+, sm_90)


def bandwidth_for(name: str, mem_clock_khz: int = 0, bus_width_bits: int = 0) -> tuple[float | None, str]:
    """(bytes/s, where the number comes from) for a GPU."""
    for key, bw in BANDWIDTH:
        if key.lower() in name.lower():
            return bw, f"datasheet ({key})"
    if mem_clock_khz and bus_width_bits:
        return mem_clock_khz * 1e3 * 2 * bus_width_bits / 8, "memory clock x bus width"
    return None, "unknown"


def fp32_peak(cc, sm_count: int, clock_khz: int) -> float | None:
    """FP32 FMA throughput (FLOP/s) of the SIMT cores."""
    if not sm_count or not clock_khz:
        return None
    return sm_count * FP32_LANES.get(tuple(cc), 128) * 2 * clock_khz * 1e3


def matmul_params(cfg) -> int:
    """Multiply-adds per token of every weight matrix of one forward (the LM head included)."""
    per_layer = cfg.hidden_size * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * cfg.hidden_size \
        + 3 * cfg.hidden_size * cfg.intermediate_size
    return cfg.num_layers * per_layer + cfg.vocab_size * cfg.hidden_size


def decode_roofline(batch: int, weight_bytes: int, bandwidth: float | None, peak: float | None = None,
                    macs_per_token: int = 0) -> float | None:
    """Tokens/s at best: the lower of the memory bound (one read of the weights a step; the KV cache and
    activations left out) and the compute bound (FP32 peak / 2 multiply-adds per token), of those known."""
    bounds = []
    if bandwidth:
        bounds.append(batch * bandwidth / weight_bytes)
    if peak and macs_per_token:
        bounds.append(peak / (2 * macs_per_token))
    return min(bounds) if bounds else None
