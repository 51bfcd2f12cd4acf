"""The serving benchmark's client side: the prompt set in a seeded order, one streamed request through the
gateway with the openai client, and the two load shapes (fixed concurrency, Poisson arrivals)."""
from __future__ import annotations

import asyncio
import json
import random
import time
from pathlib import Path

from benchmarks.http_client import httpx
from benchmarks.serving_stats import RequestRecord


def load_prompts(path: Path) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not rows:
        raise SystemExit(f"error: no prompts in {path}")
    return rows


class PromptOrder:
    """The prompt set in one seeded order, handed out in turn (cycling), so every run sends the same
    requests in the same order and each level sees the same mix."""

    def __init__(self, prompts: list[dict], seed: int):
        self.prompts = prompts
        self.order = list(range(len(prompts)))
        random.Random(seed).shuffle(self.order)
        self.pos = 0

    def take(self, n: int) -> list[dict]:
        out = [self.prompts[self.order[(self.pos + i) % len(self.order)]] for i in range(n)]
        self.pos += n
        return out


class OpenAIDriver:
    """Streams requests through the gateway with the openai client and times them."""

    def __init__(self, base_url: str, token: str, model: str, latency_class: str, max_connections: int,
                 request_timeout: float, max_tokens_override: int | None, extra_body: dict | None = None):
        import openai
        self.model = model
        self.extra_body = {"ignore_eos": True, **(extra_body or {})}   # extra_body: response_format, ...
        self.headers = {"X-Latency-Class": latency_class}
        self.max_tokens_override = max_tokens_override
        self.http = openai.DefaultAsyncHttpxClient(
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
            timeout=httpx.Timeout(request_timeout, connect=10.0))
        self.client = openai.AsyncOpenAI(base_url=base_url.rstrip("/") + "/v1", api_key=token, max_retries=0,
                                         timeout=request_timeout, http_client=self.http)

    async def close(self) -> None:
        await self.client.close()

    def max_tokens(self, p: dict) -> int:
        return self.max_tokens_override or int(p["max_tokens"])

    async def run(self, p: dict) -> RequestRecord:
        rec = RequestRecord(p["id"], p["kind"], p["length"], self.max_tokens(p))
        common = dict(model=self.model, max_tokens=rec.max_tokens, temperature=0.0, stream=True,
                      stream_options={"include_usage": True}, extra_body=self.extra_body,
                      extra_headers=self.headers)
        rec.start = time.perf_counter()
        last = None
        usage = None
        try:
            if p["kind"] == "chat":
                stream = await self.client.chat.completions.create(messages=p["messages"], **common)
            else:
                stream = await self.client.completions.create(prompt=p["prompt"], **common)
            async for chunk in stream:
                now = time.perf_counter()
                if chunk.usage is not None:
                    usage = chunk.usage
                if not chunk.choices:
                    continue
                c = chunk.choices[0]
                if c.finish_reason is not None:
                    continue
                if p["kind"] == "chat":
                    if c.delta.role is not None or c.delta.content is None:   # the opening role chunk
                        continue
                rec.token_chunks += 1
                if last is None:
                    rec.ttft = now - rec.start
                else:
                    rec.itl.append(now - last)
                last = now
            rec.e2e = time.perf_counter() - rec.start
            if usage is None:
                rec.error = "stream ended without usage"
            else:
                rec.output_tokens = int(usage.completion_tokens)
                rec.prompt_tokens = int(usage.prompt_tokens)
                rec.ok = rec.token_chunks > 0
                if not rec.ok:
                    rec.error = "no tokens"
        except Exception as exc:  # noqa: BLE001 - every failure is counted, with its kind
            rec.e2e = time.perf_counter() - rec.start
            rec.error = f"{exc.__class__.__name__}: {str(exc)[:200]}"
        return rec


async def run_concurrency(driver: OpenAIDriver, prompts: list[dict], concurrency: int,
                          deadline_s: float) -> tuple[list[RequestRecord], float, float]:
    """`concurrency` clients, each sending its next request when the last one ended; no new request
    after deadline_s (those not sent are not counted)."""
    queue: asyncio.Queue = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    records: list[RequestRecord] = []
    started = time.perf_counter()
    stop_at = started + deadline_s

    async def client() -> None:
        while time.perf_counter() < stop_at:
            try:
                p = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            records.append(await driver.run(p))

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return records, started, time.perf_counter()


async def run_poisson(driver: OpenAIDriver, prompts: list[dict], rate: float, seed: int,
                      deadline_s: float) -> tuple[list[RequestRecord], float, float]:
    """Requests at exponential inter-arrival times (mean 1/rate), no cap on requests in flight."""
    rng = random.Random(seed)
    tasks = []
    started = time.perf_counter()
    t = 0.0
    for p in prompts:
        if t > deadline_s:
            break
        delay = started + t - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(driver.run(p)))
        t += rng.expovariate(rate)
    records = list(await asyncio.gather(*tasks))
    return records, started, time.perf_counter()
