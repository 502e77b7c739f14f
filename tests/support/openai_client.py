"""Ask an OpenAI-compatible server for greedy completions of vllm_engine.PROMPTS, as a client would, and print
`TOKENS:{"calls": [[token ids per prompt]]}`: `python -m tests.support.openai_client URL MODEL`."""

from __future__ import annotations

import json
import sys
import urllib.request

from tests.support.vllm_engine import PROMPTS, say


def complete(url: str, model: str, prompt: str) -> list[int]:
    body = {"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0, "return_token_ids": True}
    req = urllib.request.Request(
        f"{url}/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return list(json.loads(r.read())["choices"][0]["token_ids"])


def main() -> None:
    url, model = sys.argv[1], sys.argv[2]
    say("TOKENS", calls=[[complete(url, model, p) for p in PROMPTS]])


if __name__ == "__main__":
    main()
