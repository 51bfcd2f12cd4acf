"""The raw HTTP client of the benchmarks: httpx, which the openai client brings (or its successor httpx2)."""
try:
    import httpx
except ImportError:                 # pragma: no cover - depends on the openai release
    import httpx2 as httpx          # type: ignore[no-redef]

__all__ = ["httpx"]
