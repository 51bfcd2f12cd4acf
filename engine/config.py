"""EngineConfig: one validated dataclass for an engine (model, backend, KV budget, batching)."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.scheduler import SchedulerConfig
from models.inspect import check_quantization


@dataclass
class EngineConfig:
    model: str                                  # path of a .gguf file or a safetensors directory
    model_id: str | None = None                 # the name requests use; the file's stem by default
    quantization: str | None = None             # None keeps the stored formats
    backend: str = "auto"                       # cpu, cuda or auto
    block_size: int = 16                        # tokens per KV block
    kv_cache_bytes: int = 1 << 30               # KV memory taken once, at start
    max_model_len: int | None = None            # defaults to the model's context length
    enable_prefix_caching: bool = True
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self):
        check_quantization(self.quantization)
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.kv_cache_bytes <= 0:
            raise ValueError("kv_cache_bytes must be positive")
