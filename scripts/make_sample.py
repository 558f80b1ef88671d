"""Write examples/prompts.jsonl: the demo's bundled sample (deterministic, so it can be regenerated).

2,100 valid prompts in the three accepted shapes, plus a few lines that show how bad input is
handled: malformed lines (reported with file:line, rejected), a duplicate id (reported, not run
twice) and two prompts longer than the simulated model's context (fail once, with the server's
reason in the export).
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

TOPICS = ["the sea", "a lighthouse", "GPU memory", "prefix caching", "a mamba", "Redis", "autumn", "a kettle",
          "distributed queues", "the number seven", "a quiet library", "batch inference", "a red bicycle",
          "the moon landing", "sourdough bread", "a chess endgame", "tidal power", "a lost umbrella"]
TASKS = ["Write a haiku about {t}.", "Explain {t} to a child in three sentences.", "List five facts about {t}.",
         "Write a limerick about {t}.", "Summarize the history of {t} in one paragraph.",
         "Give three arguments for and against {t}."]
SYSTEM = "You are a concise, helpful assistant."


def lines(rng: random.Random) -> list[str]:
    out: list[str] = []
    for i in range(2100):
        text = rng.choice(TASKS).format(t=rng.choice(TOPICS)) + f" (variant {i})"
        max_tokens = rng.choice([64, 128, 192, 256])
        kind = i % 3
        if kind == 0:  # simple form, completion
            out.append(json.dumps({"id": f"req-{i:05d}", "prompt": text, "max_tokens": max_tokens,
                                   "temperature": 0.7}))
        elif kind == 1:  # simple form, chat
            out.append(json.dumps({"custom_id": f"req-{i:05d}", "messages": [
                {"role": "system", "content": SYSTEM}, {"role": "user", "content": text}],
                "max_tokens": max_tokens}))
        else:  # OpenAI batch input format
            out.append(json.dumps({"custom_id": f"req-{i:05d}", "method": "POST", "url": "/v1/chat/completions",
                                   "body": {"model": "default", "max_tokens": max_tokens, "messages": [
                                       {"role": "user", "content": text}]}}))
    # What bad input looks like, spread through the file.
    out.insert(100, '{"id": "broken-1", "prompt": "an unterminated line')
    out.insert(700, json.dumps({"id": "bad-key", "prompt": "hello", "temprature": 0.5}))
    out.insert(1300, json.dumps({"custom_id": "bad-url", "method": "POST", "url": "/v1/responses",
                                 "body": {"input": "x"}}))
    out.insert(1500, json.dumps({"id": "req-00042", "prompt": "a second line with an id already used"}))
    long_text = " ".join(f"word{j}" for j in range(6000))  # beyond the simulated 4,096-token context
    out.insert(900, json.dumps({"id": "too-long-1", "prompt": long_text, "max_tokens": 16}))
    out.insert(1800, json.dumps({"id": "too-long-2", "messages": [{"role": "user", "content": long_text}]}))
    return out


def main() -> None:
    path = Path(sys.argv[1] if len(sys.argv) > 1 else "examples/prompts.jsonl")
    path.write_text("\n".join(lines(random.Random(7))) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
