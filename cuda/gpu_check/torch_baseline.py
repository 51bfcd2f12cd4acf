"""The baseline of gpu_check's throughput table: transformers on PyTorch, same GPU, same weights."""
from __future__ import annotations

import time

import numpy as np


class TorchModel:
    """transformers' LlamaForCausalLM on the same weights (dequantized), bf16, eager decode loop."""

    def __init__(self, weights):
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        self.torch = torch
        cfg = weights.config
        hf = cfg.to_hf()
        hf.pop("architectures", None)
        hf.pop("model_type", None)
        config = LlamaConfig(**hf)
        rope = getattr(config, "rope_parameters", None)  # transformers 5 keeps rope_theta in here
        if isinstance(rope, dict):
            rope["rope_theta"] = cfg.rope_theta
        else:
            config.rope_theta = cfg.rope_theta
        with torch.device("cuda"):
            model = LlamaForCausalLM(config).to(torch.bfloat16)
        t = lambda a: torch.from_numpy(np.ascontiguousarray(a, np.float32)).to("cuda", torch.bfloat16)  # noqa
        sd = {"model.embed_tokens.weight": t(weights.embed.dequantize()), "model.norm.weight": t(weights.final_norm)}
        for i, lw in enumerate(weights.layers):
            p = f"model.layers.{i}."
            sd[p + "input_layernorm.weight"] = t(lw.attn_norm)
            sd[p + "post_attention_layernorm.weight"] = t(lw.ffn_norm)
            for ours, theirs in (("q", "self_attn.q_proj"), ("k", "self_attn.k_proj"), ("v", "self_attn.v_proj"),
                                 ("o", "self_attn.o_proj"), ("gate", "mlp.gate_proj"), ("up", "mlp.up_proj"),
                                 ("down", "mlp.down_proj")):
                sd[p + theirs + ".weight"] = t(getattr(lw, ours).dequantize())
        sd["lm_head.weight"] = t((weights.lm_head or weights.embed).dequantize())
        missing, unexpected = model.load_state_dict(sd, strict=False)
        if [m for m in missing if "rotary" not in m] or unexpected:
            raise RuntimeError(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
        self.model = model.eval()
        self.version = __import__("transformers").__version__ + " / torch " + torch.__version__

    def decode(self, prompts: np.ndarray, steps: int, warmup: int) -> float:
        torch = self.torch
        with torch.inference_mode():
            ids = torch.from_numpy(prompts.astype(np.int64)).cuda()
            out = self.model(input_ids=ids, use_cache=True)
            past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
            for _ in range(warmup):
                out = self.model(input_ids=nxt, past_key_values=past, use_cache=True)
                past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
            nxt.cpu()
            t0 = time.perf_counter()
            for _ in range(steps):
                out = self.model(input_ids=nxt, past_key_values=past, use_cache=True)
                past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
                nxt.cpu()  # the token ids come back to the host every step, as in a server
            return prompts.shape[0] * steps / (time.perf_counter() - t0)

    def logits(self, ids: np.ndarray) -> np.ndarray:
        """Logits [T, V] (float32) of one sequence."""
        torch = self.torch
        with torch.inference_mode():
            x = torch.from_numpy(ids.astype(np.int64)[None, :]).cuda()
            return self.model(input_ids=x).logits[0].float().cpu().numpy()

    def prefill(self, prompts: np.ndarray, reps: int) -> float:
        torch = self.torch
        with torch.inference_mode():
            ids = torch.from_numpy(prompts.astype(np.int64)).cuda()
            self.model(input_ids=ids).logits[:, -1].argmax(-1).cpu()
            kw = {"logits_to_keep": 1}
            try:
                self.model(input_ids=ids, **kw).logits[:, -1].argmax(-1).cpu()
            except TypeError:  # transformers before 4.45
                kw = {}
            t0 = time.perf_counter()
            for _ in range(reps):
                self.model(input_ids=ids, **kw).logits[:, -1].argmax(-1).cpu()
            return reps * prompts.size / (time.perf_counter() - t0)
