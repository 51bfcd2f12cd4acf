"""The inference request r = (m, x, θ, τ) that every layer speaks of."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from engine.sampling import SamplingParams


class LatencyClass(enum.IntEnum):
    """Lower value = served first."""
    REALTIME = 0
    STANDARD = 1
    BATCH = 2

    @classmethod
    def parse(cls, value) -> "LatencyClass":
        if isinstance(value, cls):
            return value
        try:
            return cls[str(value).upper()]
        except KeyError:
            raise ValueError(f"latency_class must be one of realtime, standard, batch; got {value!r}") from None

    @property
    def label(self) -> str:
        return self.name.lower()


@dataclass
class InferenceRequest:
    request_id: str
    model: str                          # m: the concrete model id
    prompt_token_ids: list[int]         # x: the input tokens
    sampling: SamplingParams            # θ
    latency_class: LatencyClass = LatencyClass.STANDARD  # τ
    org: str = ""
    arrival_time: float = field(default_factory=time.monotonic)
    queue_timeout_s: float | None = None  # waiting longer than this finishes the request with "timeout"
    prompt_text: str | None = None
