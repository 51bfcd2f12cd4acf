"""Writes benchmarks/prompts.jsonl: the serving benchmark's prompt set, generated deterministically.

    python benchmarks/make_prompts.py [--seed 20250101] [--count 240] [--out benchmarks/prompts.jsonl]

The same seed always gives the same file, byte for byte (no network, no data set download, only the
standard library), and the file is shipped with the repository so every run of the benchmark sends
the same requests. Each line is one request:

    {"id": "p0007", "kind": "chat" | "completion", "length": "short" | "long",
     "messages": [...] (chat) | "prompt": "..." (completion), "max_tokens": 64, "approx_prompt_words": 41}

Short prompts are one instruction or question (about 15-80 words); long ones carry a generated
document of several paragraphs (about 350-700 words, roughly 500-1000 tokens) and a question about it,
which is what makes prefill matter. The mix is 3 short : 1 long, half chat, half completion. Output
lengths are 32, 64 or 128 tokens (64 is the length of the headline serving figures);
the benchmark sends `ignore_eos` so that every request generates exactly its max_tokens.
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "prompts.jsonl"
DEFAULT_SEED = 20250101
DEFAULT_COUNT = 240

TOPICS = [
    "the water cycle", "photosynthesis", "the French Revolution", "black holes", "compound interest",
    "the immune system", "plate tectonics", "the printing press", "machine learning", "coral reefs",
    "the Roman Empire", "volcanoes", "vaccines", "the stock market", "renewable energy", "bees",
    "the Silk Road", "quantum computing", "the human heart", "glaciers", "the internet", "jazz music",
    "the moon landing", "rainforests", "electric cars", "the Great Wall of China", "sleep", "tides",
    "the periodic table", "earthquakes", "migratory birds", "the Renaissance", "solar panels",
    "bread baking", "chess openings", "the ocean floor", "recycling", "the Olympic Games", "comets",
    "public libraries",
]
AUDIENCES = ["a ten-year-old", "a busy manager", "a first-year student", "my grandmother", "a new employee",
             "a curious tourist", "a software engineer", "a high-school class"]
SHORT_TASKS = [
    "Explain {topic} to {audience} in a few sentences.",
    "Give three surprising facts about {topic}.",
    "Write a short poem about {topic}.",
    "What are the main causes and effects of {topic}?",
    "Summarize the history of {topic} in one paragraph.",
    "List five questions a student might ask about {topic}, with brief answers.",
    "Write a friendly email inviting {audience} to a talk about {topic}.",
    "Compare {topic} and {other} in a short table.",
    "What is the most common misconception about {topic}?",
    "Describe {topic} using a simple analogy.",
]
COMPLETION_OPENERS = [
    "The most important thing to know about {topic} is that",
    "In the early morning, the village near the river woke to news about {topic}, and",
    "Here is a step-by-step guide to understanding {topic}:\n1.",
    "Q: Why does {topic} matter to {audience}?\nA:",
    "Chapter 1\n\nNobody in the small town had ever thought much about {topic} until",
    "Abstract. We study {topic} and show that",
]
SYSTEM_PROMPTS = [
    "You are a helpful assistant. Answer clearly and briefly.",
    "You are a patient teacher who explains things step by step.",
    "You are a concise technical writer.",
]
# Pieces of the generated documents of long prompts.
NAMES = ["Amara", "Bruno", "Chen", "Dalia", "Emil", "Farah", "Goran", "Hana", "Ivo", "Juno", "Kofi", "Lena",
         "Mateo", "Nadia", "Oren", "Priya", "Quinn", "Rosa", "Sven", "Tariq", "Uma", "Viktor", "Wen", "Yusuf"]
PLACES = ["the northern office", "the harbour warehouse", "the mountain station", "the city archive",
          "the east campus", "the river lab", "the old mill", "the central depot", "the coastal site"]
THINGS = ["the budget", "the survey", "the pilot project", "the new schedule", "the inventory", "the audit",
          "the training plan", "the shipment", "the prototype", "the field study", "the annual report"]
VERBS = ["reviewed", "postponed", "approved", "questioned", "expanded", "simplified", "measured",
         "documented", "redesigned", "tested", "summarized", "compared"]
ADJECTIVES = ["careful", "unexpected", "modest", "detailed", "early", "late", "costly", "efficient",
              "ambitious", "cautious", "thorough", "preliminary"]
CONNECTORS = ["Meanwhile,", "As a result,", "In addition,", "However,", "Later that month,", "By contrast,",
              "At the same time,", "Because of this,", "Surprisingly,", "In the end,"]
QUESTIONS = [
    "Who approved the most projects, and where?",
    "Summarize the document in five bullet points.",
    "Which numbers in the document changed the most, and why might that be?",
    "List every person mentioned and what they did.",
    "What are the three most important decisions described above?",
    "Write a short headline and a two-sentence summary of the document.",
]
OUTPUT_LENGTHS = [32, 64, 64, 64, 128]


def _sentence(rng: random.Random) -> str:
    who, where, what = rng.choice(NAMES), rng.choice(PLACES), rng.choice(THINGS)
    n = rng.randint(2, 980)
    forms = [
        f"{who} {rng.choice(VERBS)} {what} at {where} after {rng.choice(ADJECTIVES)} discussions.",
        f"The team at {where} counted {n} items and {rng.choice(VERBS)} {what} twice.",
        f"{rng.choice(CONNECTORS)} {who} noted that {what} was {rng.choice(ADJECTIVES)} and {rng.choice(VERBS)} it.",
        f"According to {who}, {what} at {where} rose by {n % 97 + 1} percent in the third quarter.",
        f"{who} and {rng.choice(NAMES)} met at {where} to discuss {what}, which was {rng.choice(ADJECTIVES)}.",
    ]
    return rng.choice(forms)


def _document(rng: random.Random, words: int) -> str:
    paragraphs, count = [], 0
    while count < words:
        para = " ".join(_sentence(rng) for _ in range(rng.randint(4, 7)))
        paragraphs.append(para)
        count += len(para.split())
    return "\n\n".join(paragraphs)


def _short_text(rng: random.Random) -> str:
    topic, other = rng.sample(TOPICS, 2)
    return rng.choice(SHORT_TASKS).format(topic=topic, other=other, audience=rng.choice(AUDIENCES))


def make_prompts(seed: int = DEFAULT_SEED, count: int = DEFAULT_COUNT) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(count):
        long_ = i % 4 == 3                       # 3 short : 1 long
        chat = (i // 4 + i) % 2 == 0             # half chat, half completion, in both lengths
        max_tokens = rng.choice(OUTPUT_LENGTHS)
        entry: dict = {"id": f"p{i:04d}", "kind": "chat" if chat else "completion",
                       "length": "long" if long_ else "short"}
        if long_:
            doc = _document(rng, rng.randint(350, 700))
            question = rng.choice(QUESTIONS)
            if chat:
                entry["messages"] = [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)},
                                     {"role": "user", "content": f"Read this document.\n\n{doc}\n\n{question}"}]
            else:
                entry["prompt"] = f"Document:\n{doc}\n\nQuestion: {question}\nAnswer:"
        elif chat:
            messages = []
            if rng.random() < 0.4:
                messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
            if rng.random() < 0.3:               # a short multi-turn conversation
                messages += [{"role": "user", "content": _short_text(rng)},
                             {"role": "assistant", "content": "Sure. " + _sentence(rng)}]
            messages.append({"role": "user", "content": _short_text(rng)})
            entry["messages"] = messages
        else:
            entry["prompt"] = rng.choice(COMPLETION_OPENERS).format(topic=rng.choice(TOPICS),
                                                                    audience=rng.choice(AUDIENCES))
        text = entry.get("prompt") or " ".join(m["content"] for m in entry["messages"])
        entry["max_tokens"] = max_tokens
        entry["approx_prompt_words"] = len(text.split())
        out.append(entry)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=DEFAULT_SEED)
    ap.add_argument("--count", type=int, default=DEFAULT_COUNT)
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    args = ap.parse_args(argv)
    prompts = make_prompts(args.seed, args.count)
    with open(args.out, "w", encoding="utf-8", newline="\n") as fh:
        for p in prompts:
            fh.write(json.dumps(p, ensure_ascii=False, sort_keys=True) + "\n")
    kinds = {k: sum(1 for p in prompts if (p["kind"], p["length"]) == k)
             for k in [("chat", "short"), ("chat", "long"), ("completion", "short"), ("completion", "long")]}
    print(f"wrote {len(prompts)} prompts to {args.out}: " + ", ".join(f"{a}/{b} {n}" for (a, b), n in kinds.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
