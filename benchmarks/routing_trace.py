"""The routing benchmark's trace: a deterministic mix of models, shared prefixes and latency classes.

Six "applications" each send every request with their own system prompt of about 400 tokens (plain
English words, about one token each) to one catalog model in one latency class, two applications per
model; each request adds a question of its own. Three conversations (realtime, zen-small) grow a turn at
a time, so each turn's prompt holds the last one's as its prefix. Arrivals are Poisson at `rate_per_s`
(seeded): the same seed gives the same trace, byte for byte, for every policy.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

WORDS = ("the time people way year work day world life hand part child place case week company system "
         "program question government number night point home water room mother area money story fact "
         "month lot right study book eye job word business issue side kind head house service friend "
         "father power hour game line end member law car city community name president team minute idea "
         "kid body information back parent face others level office door health person art war history "
         "party result change morning reason research girl guy moment air teacher force education model "
         "network cache memory request answer server engine token prefix node route load queue batch "
         "stream latency budget price order market report plan design review test build data value").split()

SYSTEM_WORDS = 330          # about 400 tokens with the chat template's markers and punctuation


@dataclass(frozen=True)
class Application:
    name: str
    model: str              # catalog alias
    latency_class: str
    max_tokens: int


APPLICATIONS = (
    Application("support", "zen-small", "realtime", 8),
    Application("coding", "zen-small", "standard", 16),
    Application("translate", "zen-small-q8", "realtime", 8),
    Application("summarize", "zen-small-q8", "batch", 24),
    Application("tutor", "zen-small-f16", "standard", 16),
    Application("analyst", "zen-small-f16", "batch", 24),
)
CONVERSATIONS = 3           # realtime chats on zen-small whose history grows a turn at a time
CONVERSATION = Application("chat", "zen-small", "realtime", 8)


@dataclass(frozen=True)
class TraceRequest:
    index: int
    at_s: float             # when it is sent, from the start of the run
    app: str                # the application or conversation: requests of one share a prefix
    model: str
    latency_class: str
    max_tokens: int
    messages: tuple[tuple[str, str], ...]

    def body(self) -> dict:
        return {"model": self.model, "max_tokens": self.max_tokens, "temperature": 0.0, "stream": True,
                "stream_options": {"include_usage": True}, "ignore_eos": True,
                "messages": [{"role": r, "content": c} for r, c in self.messages]}


def sentence(rng: random.Random, words: int) -> str:
    text = " ".join(rng.choice(WORDS) for _ in range(words))
    return text[0].upper() + text[1:] + "."


def paragraph(rng: random.Random, words: int) -> str:
    out, left = [], words
    while left > 0:
        n = min(left, rng.randint(8, 16))
        out.append(sentence(rng, n))
        left -= n
    return " ".join(out)


def build_trace(requests: int, rate_per_s: float, seed: int = 25) -> list[TraceRequest]:
    """`requests` requests: three in four to an application, one in four a conversation's next turn."""
    rng = random.Random(seed)
    systems = {a.name: f"You are the {a.name} assistant. " + paragraph(rng, SYSTEM_WORDS) for a in APPLICATIONS}
    chats: list[list[tuple[str, str]]] = [
        [("system", f"You are a friendly assistant in chat {i}. " + paragraph(rng, 120))] for i in range(CONVERSATIONS)]
    trace, at = [], 0.0
    for i in range(requests):
        at += rng.expovariate(rate_per_s)
        if rng.random() < 0.25:
            k = rng.randrange(CONVERSATIONS)
            chat = chats[k]
            chat.append(("user", sentence(rng, rng.randint(6, 14))))
            app, messages = CONVERSATION, tuple(chat)
            chat.append(("assistant", paragraph(rng, 24)))       # the answer the next turn carries
            name = f"chat-{k}"
        else:
            app = rng.choice(APPLICATIONS)
            messages = (("system", systems[app.name]), ("user", sentence(rng, rng.randint(8, 20))))
            name = app.name
        trace.append(TraceRequest(i, round(at, 3), name, app.model, app.latency_class, app.max_tokens, messages))
    return trace


def models_of(trace: list[TraceRequest]) -> list[str]:
    return sorted({r.model for r in trace})
