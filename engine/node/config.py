"""NodeConfig: everything one engine node is started with, validated once (`python -m engine serve`)."""
from __future__ import annotations

import logging
import math
import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path

from engine.config import EngineConfig
from engine.protocol import DEV_NODE_SECRET, is_loopback_host
from engine.scheduler import DEFAULT_MAX_NUM_BATCHED_TOKENS, SchedulerConfig

log = logging.getLogger("engine.node")

DEFAULT_DRAIN_GRACE_S = 30.0
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)b?\s*$", re.IGNORECASE)


def parse_bytes(text: str | int) -> int:
    """'1073741824', '512MiB', '2G', '1.5GB' -> bytes (K/M/G/T are powers of 1024 with or without 'i')."""
    if isinstance(text, int):
        return text
    m = _SIZE.match(str(text))
    if not m:
        raise ValueError(f"not a byte size: {text!r} (examples: 1073741824, 512MiB, 2G)")
    power = " kmgt".index(m.group(2).lower() or " ")
    return int(float(m.group(1)) * 1024 ** power)


# HTTP threads beyond the requests the node holds (a full batch and a full queue): probes, /state, /metrics
THREADS_BEYOND_QUEUE = 32


@dataclass(frozen=True)
class ModelSpec:
    """A model this node may serve: a .gguf file or safetensors directory, and the id requests use."""
    path: str
    id: str

    @classmethod
    def parse(cls, text: str) -> "ModelSpec":
        """'PATH' or 'PATH=ID'; the id defaults to the file's stem before the first dot
        (SmolLM2-135M-Instruct.Q4_1.gguf -> SmolLM2-135M-Instruct)."""
        path, sep, model_id = text.rpartition("=")
        if not sep:
            path, model_id = text, ""
        if not path:
            raise ValueError(f"--models {text!r}: expected PATH or PATH=ID")
        model_id = model_id.strip() or Path(path.rstrip("/")).name.split(".")[0]
        if not model_id:
            raise ValueError(f"--models {text!r}: cannot derive a model id from the path; give PATH=ID")
        return cls(path=path, id=model_id)


@dataclass
class NodeConfig:
    models: list[ModelSpec]
    host: str = "127.0.0.1"
    port: int = 8001
    node_id: str = ""                          # defaults to host:port
    secret: str = DEV_NODE_SECRET              # compared with X-Node-Secret; the default only on loopback
    memory_budget_bytes: int | None = None     # weights + KV of resident models; None: from the device
    kv_cache_bytes: int = 256 << 20            # KV cache of each resident model
    max_waiting: int = 256                     # sequences accepted but not yet producing tokens
    org_waiting_share: float = 1.0             # most of max_waiting one org's sequences may take (429 beyond)
    backend: str = "auto"
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_model_len: int | None = None
    preload: list[str] | None = None           # ids loaded at start; None: the listed models, in order, while they fit
    load_wait_s: float = 120.0                 # how long a request waits for a cold load before a 503
    threads: int | None = None                 # concurrent HTTP requests (streams) of the single worker; None:
                                               # max_num_seqs + max_waiting + THREADS_BEYOND_QUEUE
    drain_grace_s: float = DEFAULT_DRAIN_GRACE_S   # on SIGTERM: how long generations in flight may finish
    log_level: str = "info"
    otlp_endpoint: str | None = None           # OTLP/HTTP trace collector; None: the OTEL_* variables, or off

    def __post_init__(self):
        if not self.models:
            raise ValueError("give at least one model (--models PATH[=ID])")
        ids = [m.id for m in self.models]
        dup = {i for i in ids if ids.count(i) > 1}
        if dup:
            raise ValueError(f"model ids must be unique; repeated: {', '.join(sorted(dup))}")
        if self.preload is not None:
            unknown = [p for p in self.preload if p not in ids]
            if unknown:
                raise ValueError(f"--preload names models not in --models: {', '.join(unknown)}")
        if self.threads is None:   # each request holds a thread, waiting too: fewer, and the queue's bound
            # is never met (requests wait unseen in the listen backlog, not answered 503 queue_full)
            self.threads = self.max_num_seqs + self.max_waiting + THREADS_BEYOND_QUEUE
        for name in ("kv_cache_bytes", "max_waiting", "max_num_seqs", "max_num_batched_tokens", "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if not 0 < self.org_waiting_share <= 1:
            raise ValueError(f"org_waiting_share must be in (0, 1], got {self.org_waiting_share}")
        for name in ("load_wait_s", "drain_grace_s"):   # both become timeouts: inf or nan would fail there
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {getattr(self, name)}")
        if self.memory_budget_bytes is not None and self.memory_budget_bytes < 1:
            raise ValueError("memory_budget_bytes must be positive")
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        # "[::1]" as in a URL: the bare address, which serve() brackets for gunicorn's bind
        if self.host.startswith("[") and self.host.endswith("]"):
            self.host = self.host[1:-1]
        if not self.secret:
            raise ValueError("the node secret must not be empty")
        if self.secret == DEV_NODE_SECRET and not is_loopback_host(self.host):
            raise ValueError(f"--host {self.host!r} is not a loopback address, and the node would accept the "
                             f"public development node secret: set NODE_SECRET to a secret of your own (the "
                             f"gateway's NODE_SECRET must match), or serve on 127.0.0.1")
        if not self.node_id:
            host = socket.gethostname() if self.host in ("0.0.0.0", "::", "") else self.host
            self.node_id = f"{host}:{self.port}"
        # the engine's own checks (block_size a power of two), now rather than at the first model load
        self.engine_config(self.models[0], None)

    def engine_config(self, spec: ModelSpec, convert_to: str | None) -> EngineConfig:
        """The engine of one resident model: `spec`'s weights, converted to `convert_to` (None keeps them)."""
        return EngineConfig(
            model=spec.path, model_id=spec.id, quantization=convert_to, backend=self.backend,
            block_size=self.block_size, kv_cache_bytes=self.kv_cache_bytes, max_model_len=self.max_model_len,
            scheduler=SchedulerConfig(max_num_seqs=self.max_num_seqs, max_waiting=self.max_waiting,
                                      max_num_batched_tokens=self.max_num_batched_tokens))

    @staticmethod
    def secret_from_env(name: str = "NODE_SECRET", *, host: str) -> str:
        """The secret in the environment variable `name`; unset, the development one, on a loopback `host` only."""
        value = os.environ.get(name, "")
        if value:
            return value
        if not is_loopback_host(host):
            raise ValueError(f"{name} is not set, and --host {host!r} is not a loopback address: set {name} to "
                             f"a secret of your own (the gateway's NODE_SECRET must match), or serve on 127.0.0.1")
        log.warning("%s is not set: using the development node secret; set it in production", name)
        return DEV_NODE_SECRET
