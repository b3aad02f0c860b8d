"""Decode speed of a server with and without structured output: the same chat
request unconstrained, with response_format json_object and with a json_schema,
greedy, streamed; tokens after the first over the time from the first chunk to
the last (so prefill is left out). Prints each run and the medians.
Usage: structured_speed.py BASE_URL [REPETITIONS]"""

import json
import statistics
import sys
import time
import urllib.request

ASK = [{"role": "user", "content": "List thirty short names of fruits and vegetables."}]
SCHEMA = {"type": "object", "properties": {"items": {"type": "array", "minItems": 40, "maxItems": 40,
          "items": {"type": "string", "maxLength": 12}}}, "required": ["items"], "additionalProperties": False}
KINDS = {
    "unconstrained": {},
    "json_object": {"response_format": {"type": "json_object"}},
    "json_schema": {"response_format": {"type": "json_schema", "json_schema": {"name": "list", "schema": SCHEMA}}},
}


def decode_speed(base, extra, max_tokens=128):
    """Tokens per second after the first token, and the tokens generated."""
    body = {"messages": ASK, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **extra}
    req = urllib.request.Request(base + "/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    first = last = None
    tokens = 0
    with urllib.request.urlopen(req) as r:
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                last = time.perf_counter()
                first = first or last
    return (tokens - 1) / (last - first), tokens


def main():
    base = sys.argv[1]
    reps = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    decode_speed(base, {}, 8)
    runs = {k: [] for k in KINDS}
    for _ in range(reps):
        for kind, extra in KINDS.items():
            tps, n = decode_speed(base, extra)
            runs[kind].append(tps)
            print(f"{kind:14} {n:4} tokens {tps:6.1f} t/s", flush=True)
    for kind, v in runs.items():
        print(f"median {kind:14} {statistics.median(v):6.1f} t/s")


if __name__ == "__main__":
    main()
