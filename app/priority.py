"""Latency classes: which one a request gets.

The class comes from the `X-Latency-Class` request header or from OpenAI's `service_tier` field, is
capped by the org's SLA (an org without realtime asking for realtime gets standard) and defaults per
org. An answer names the class it was served in as its `service_tier`.
"""
from __future__ import annotations

from engine.protocol import LatencyClass

LATENCY_CLASS_HEADER = "X-Latency-Class"
# OpenAI's service tiers and the classes they name; "auto" leaves the choice to the org's default
SERVICE_TIERS = {"priority": LatencyClass.REALTIME, "default": LatencyClass.STANDARD, "flex": LatencyClass.BATCH}
AUTO_TIER = "auto"


class ConflictingTier(ValueError):
    """The header and service_tier name different classes."""


def service_tier(cls: LatencyClass) -> str:
    """The service_tier an answer names for a request served in this class."""
    return next(tier for tier, c in SERVICE_TIERS.items() if c is cls)


def cap_latency_class(wanted: LatencyClass, sla_max: LatencyClass) -> LatencyClass:
    """`wanted`, but never more urgent than the SLA allows."""
    return wanted if wanted.rank >= sla_max.rank else sla_max


def latency_class_for(header_value: str | None, sla_max: LatencyClass, default: LatencyClass,
                      tier: str | None = None) -> LatencyClass:
    """The latency class of a request: the header's, or the service tier's (one of SERVICE_TIERS or
    AUTO_TIER), or the org default, capped by the SLA.

    Raises ValueError when the header names no class, ConflictingTier when it names another class than
    the service tier does.
    """
    by_tier = SERVICE_TIERS.get(tier) if tier is not None else None
    if header_value is None or not header_value.strip():
        wanted = by_tier if by_tier is not None else default   # REALTIME is 0: falsy
    else:
        wanted = LatencyClass.parse(header_value)
        if by_tier is not None and by_tier is not wanted:
            raise ConflictingTier(f"`service_tier` {tier!r} names the {by_tier.label} class, the "
                                  f"`{LATENCY_CLASS_HEADER}` header {wanted.label}: send one, or both alike")
    return cap_latency_class(wanted, sla_max)
