"""EngineRequest: a request as the engine schedules it, its prompt already tokens (x as token ids)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from engine.protocol import LatencyClass
from engine.sampling import SamplingParams


@dataclass
class EngineRequest:
    request_id: str
    model: str                          # m: the concrete model id
    prompt_token_ids: list[int]         # x: the input tokens
    sampling: SamplingParams            # θ
    latency_class: LatencyClass = LatencyClass.STANDARD  # τ
    org: str = ""
    arrival_time: float = field(default_factory=time.monotonic)
    queue_timeout_s: float | None = None  # waiting longer than this finishes the request with "timeout"
    prompt_text: str | None = None
    grammar: Any = None                   # the compiled matcher of sampling.structured_output (Engine.validate)
