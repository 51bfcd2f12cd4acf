"""ModelConfig: the shape of a decoder model (the Llama family, Gemma 3), from GGUF metadata or a Hugging Face
config.json."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position: int = 2048
    tie_embeddings: bool = True
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    architecture: str = "llama"          # llama, gemma3 (models/build.py picks the model class)
    sliding_window: int = 0              # local layers attend to the last this many positions; 0: none
    sliding_window_pattern: int = 0      # every this many-th layer is global (Gemma 3: 6); 0: all global
    rope_local_theta: float = 10000.0    # the RoPE base of local (sliding-window) layers

    def __post_init__(self):
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"unsupported architecture {self.architecture!r} (supported: {', '.join(ARCHITECTURES)})")
        if self.sliding_window < 0 or self.sliding_window_pattern < 0:
            raise ValueError("sliding_window and sliding_window_pattern must be >= 0")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for RoPE")

    def is_local(self, layer: int) -> bool:
        """Whether `layer` attends over the sliding window only (the others attend over everything)."""
        return self.sliding_window > 0 and (self.sliding_window_pattern == 0
                                            or (layer + 1) % self.sliding_window_pattern != 0)

    def layer_window(self, layer: int) -> int:
        """The attention window of `layer` in positions; 0: the whole context."""
        return self.sliding_window if self.is_local(layer) else 0

    def layer_rope_theta(self, layer: int) -> float:
        return self.rope_local_theta if self.is_local(layer) else self.rope_theta

    @property
    def embed_scale(self) -> float:
        """The factor on the embedding after the lookup (Gemma: sqrt(hidden); Llama: 1)."""
        return float(self.hidden_size) ** 0.5 if self.architecture == "gemma3" else 1.0

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf(cls, cfg: dict) -> "ModelConfig":
        heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        eos = cfg.get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[0]
        gemma = cfg.get("model_type") in GEMMA3_MODEL_TYPES
        if gemma and cfg.get("final_logit_softcapping") or gemma and cfg.get("attn_logit_softcapping"):
            raise ValueError("Gemma 3 with logit soft-capping is not supported")
        if gemma and cfg.get("query_pre_attn_scalar", cfg.get("head_dim")) != cfg.get("head_dim"):
            raise ValueError("Gemma 3 with query_pre_attn_scalar other than head_dim is not supported")
        extra = dict(
            architecture="gemma3", sliding_window=int(cfg.get("sliding_window") or 0),
            sliding_window_pattern=int(cfg.get("sliding_window_pattern", 6)),
            rope_local_theta=float(cfg.get("rope_local_base_freq", 10000.0)),
        ) if gemma else {}
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or hidden // heads,
            rope_theta=float(cfg.get("rope_theta", 10000.0)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            max_position=int(cfg.get("max_position_embeddings", 2048)),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", gemma)),   # transformers' defaults: Gemma 3 ties, Llama not
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=eos,
            **extra,
        )

    def to_hf(self) -> dict:
        gemma = self.architecture == "gemma3"
        extra = {
            "sliding_window": self.sliding_window, "sliding_window_pattern": self.sliding_window_pattern,
            "rope_local_base_freq": self.rope_local_theta, "query_pre_attn_scalar": self.head_dim,
            "final_logit_softcapping": None, "attn_logit_softcapping": None,
        } if gemma else {}
        return {
            "architectures": ["Gemma3ForCausalLM" if gemma else "LlamaForCausalLM"],
            "model_type": "gemma3_text" if gemma else "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position,
            "tie_word_embeddings": self.tie_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "hidden_act": "gelu_pytorch_tanh" if gemma else "silu",
            **extra,
        }


ARCHITECTURES = ("llama", "gemma3")
GEMMA3_MODEL_TYPES = ("gemma3_text", "gemma3")
