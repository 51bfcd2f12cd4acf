"""The inference engine: paged KV cache, continuous batching, sampling, and the offline LLM API."""
from engine.sampling import SamplingParams  # noqa: F401


def __getattr__(name):
    # LLM pulls in numba kernels; import it on first use so `import engine` stays light.
    if name in ("LLM", "RequestOutput", "CompletionOutput"):
        from engine import llm
        return getattr(llm, name)
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
