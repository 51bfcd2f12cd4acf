"""Model resolution: alias → concrete model version and quantization, per tier.

An alias (`zen-small`) names one concrete model (`SmolLM2-135M-Instruct`) at one
quantization (`q4_1`). A tier lists the aliases its orgs may use; an alias that does not
exist and one the caller's tier may not use look the same to the caller: 404
`model_not_found`, so the catalog of other tiers is not revealed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

from app.config import ModelConfig, TierConfig
from app.errors import model_not_found
from engine.protocol import bad_value

CATALOG_CREATED = 1_735_689_600  # 2025-01-01: the `created` field of /v1/models entries


@dataclass(frozen=True)
class ResolvedModel:
    """What a request's `model` resolves to."""

    alias: str
    model: str               # concrete model id the nodes know
    quantization: str
    max_context: int
    default_max_tokens: int
    cold_load_s: float
    chat: bool = True        # whether the alias serves chat (false: completions only)
    chat_template: str | None = None   # the catalog's template source, rendered in place of the model's own

    def check_chat(self) -> None:
        """400 chat_not_supported unless this alias serves chat: refused here, never sent to a node."""
        if not self.chat:
            raise bad_value(f"The model {self.alias!r} has no chat template: it serves /v1/completions only",
                            "messages", "chat_not_supported")

    @property
    def key(self) -> tuple[str, str]:
        """How nodes identify a resident model: (id, quantization)."""
        return (self.model, self.quantization)


class Catalog:
    """The configured aliases and which tier may use which."""

    def __init__(self, models: Mapping[str, ModelConfig]) -> None:
        self._models = {alias: ResolvedModel(alias, m.model, m.quantization, m.max_context,
                                             m.default_max_tokens, m.cold_load_s, m.chat, m.chat_template_source)
                        for alias, m in models.items()}

    def can_use(self, tier: TierConfig, alias: str) -> bool:
        return alias in self._models and alias in tier.models

    def resolve(self, alias: str, tier: TierConfig) -> ResolvedModel:
        """The model `alias` names for `tier`; APIError 404 model_not_found otherwise."""
        if not self.can_use(tier, alias):
            raise model_not_found(alias)
        return self._models[alias]

    def visible_to(self, tier: TierConfig, servable: Callable[[str], bool] | None = None) -> list[ResolvedModel]:
        """The models a tier may use, in catalog order; with `servable`, only those whose concrete model
        it accepts (some node can serve it)."""
        return [m for alias, m in self._models.items()
                if alias in tier.models and (servable is None or servable(m.model))]

    def all(self) -> list[ResolvedModel]:
        return list(self._models.values())

    @staticmethod
    def model_object(m: ResolvedModel) -> dict:
        """An OpenAI `model` object."""
        return {
            "id": m.alias,
            "object": "model",
            "created": CATALOG_CREATED,
            "owned_by": "zen",
            "root": m.model,
            "quantization": m.quantization,
            "max_model_len": m.max_context,
            "chat": m.chat,
        }
