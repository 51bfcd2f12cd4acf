"""The inference engine: paged KV cache, continuous batching, sampling, and the offline LLM API."""


def __getattr__(name):
    # LLM and SamplingParams pull in numba kernels; import them on first use so that `import engine`
    # (and the gateway's `engine.protocol`) stays light.
    if name in ("LLM", "RequestOutput", "CompletionOutput"):
        from engine import llm
        return getattr(llm, name)
    if name == "SamplingParams":
        from engine.sampling import SamplingParams
        return SamplingParams
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
