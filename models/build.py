"""build_model: the forward-pass class of a model's architecture (ModelConfig.architecture)."""
from __future__ import annotations

from models.gemma3 import Gemma3Model
from models.llama import LlamaModel
from models.weights import ModelWeights

MODEL_CLASSES = {"llama": LlamaModel, "gemma3": Gemma3Model}


def build_model(weights: ModelWeights, backend) -> LlamaModel:
    """The model of `weights`' architecture on `backend` (Gemma3Model shares LlamaModel's interface)."""
    return MODEL_CLASSES[weights.config.architecture](weights, backend)
