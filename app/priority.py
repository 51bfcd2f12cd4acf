"""Latency classes: which one a request gets.

The class comes from the `X-Latency-Class` request header, is capped by the org's SLA
(an org without realtime asking for realtime gets standard) and defaults per org.
"""
from __future__ import annotations

from engine.protocol import LatencyClass

LATENCY_CLASS_HEADER = "X-Latency-Class"


def cap_latency_class(wanted: LatencyClass, sla_max: LatencyClass) -> LatencyClass:
    """`wanted`, but never more urgent than the SLA allows."""
    return wanted if wanted.rank >= sla_max.rank else sla_max


def latency_class_for(header_value: str | None, sla_max: LatencyClass,
                      default: LatencyClass) -> LatencyClass:
    """The latency class of a request: header value (or the org default) capped by the SLA.

    Raises ValueError when the header names no class.
    """
    if header_value is None or not header_value.strip():
        wanted = default
    else:
        wanted = LatencyClass.parse(header_value)
    return cap_latency_class(wanted, sla_max)
