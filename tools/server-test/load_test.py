"""Load test, loopback only, bounded in count and time: one client alone, then
CLIENTS concurrent clients x REQUESTS streamed chat requests each. Prints
failures, aggregate generated tokens per second, time to first token (p50,
p99) and the server's resident memory before and after.

With --mix, requests take turns: plain chat, a tool call (tool_choice
"required": the streamed call must name the tool and its arguments must parse
and carry the required field) and a json_schema reply (strict: the streamed
text must parse and validate under jsonschema). A reply that does not is
counted as invalid, beside transport failures.

Usage: load_test.py BASE_URL MODEL_ID SERVER_PID [--clients 32] [--requests 20] [--max-tokens 32] [--mix]"""

import argparse
import asyncio
import json
import statistics
import time

import jsonschema
import openai

PROMPTS = [
    "Write a short poem about the sea.",
    "Explain what a CPU cache is.",
    "List three fruits and their colors.",
    "What is the difference between a list and a tuple in Python?",
    "Give me a tip for learning a new language.",
    "Describe a sunset in two sentences.",
    "Why is the sky blue?",
    "Tell me a fun fact about octopuses.",
]


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS")


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather of a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                       "required": ["city"], "additionalProperties": False},
    },
}
CITIES = ["Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Perth", "Quito", "Seoul"]
ANSWER = {
    "type": "object",
    "properties": {"answer": {"type": "string", "minLength": 1, "maxLength": 40},
                   "confidence": {"type": "integer", "minimum": 0, "maximum": 100}},
    "required": ["answer", "confidence"],
    "additionalProperties": False,
}
KINDS = ("plain", "tool", "json")


def request(kind, i, max_tokens):
    """The chat request of the given kind (plain, tool, json) for request number i."""
    args = dict(temperature=0.7, seed=i, stream=True, stream_options={"include_usage": True})
    if kind == "tool":
        question = f"What is the weather in {CITIES[i % len(CITIES)]} right now?"
        args.update(tools=[WEATHER], tool_choice="required", max_tokens=max(max_tokens, 64))
    elif kind == "json":
        question = PROMPTS[i % len(PROMPTS)] + " Answer in JSON."
        args.update(response_format={"type": "json_schema",
                                     "json_schema": {"name": "answer", "schema": ANSWER, "strict": True}},
                    max_tokens=max(max_tokens, 96))
    else:
        question = PROMPTS[i % len(PROMPTS)]
        args.update(max_tokens=max_tokens)
    return dict(messages=[{"role": "user", "content": question}], **args)


def check(kind, text, calls, finish):
    """Why a finished reply of this kind is not what was asked for, or None."""
    if kind == "tool":
        if finish != "tool_calls" or not calls:
            return f"no tool call (finish {finish}, text {text[:60]!r})"
        for c in calls.values():
            if c["name"] != "get_weather":
                return f"called {c['name']!r}"
            try:
                if not isinstance(json.loads(c["arguments"]).get("city"), str):
                    return f"arguments without a city: {c['arguments']!r}"
            except (json.JSONDecodeError, AttributeError):
                return f"arguments do not parse: {c['arguments']!r}"
    elif kind == "json":
        try:
            jsonschema.validate(json.loads(text), ANSWER)
        except (json.JSONDecodeError, jsonschema.ValidationError) as e:
            return f"reply does not validate ({finish}): {type(e).__name__} {text[:80]!r}"
    elif not text:
        return "empty reply"
    return None


async def one(client, model, i, max_tokens, kind="plain"):
    """(time to first token, completion tokens, why invalid or None)."""
    t0 = time.perf_counter()
    ttft, tokens, text, calls, finish = None, 0, "", {}, None
    stream = await client.chat.completions.create(model=model, **request(kind, i, max_tokens))
    async for chunk in stream:
        if chunk.choices:
            choice = chunk.choices[0]
            delta = choice.delta
            if ttft is None and (delta.content or delta.tool_calls):
                ttft = time.perf_counter() - t0
            text += delta.content or ""
            for tc in delta.tool_calls or []:
                c = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                if tc.function and tc.function.name:
                    c["name"] += tc.function.name
                if tc.function and tc.function.arguments:
                    c["arguments"] += tc.function.arguments
            finish = choice.finish_reason or finish
        if chunk.usage:
            tokens = chunk.usage.completion_tokens
    elapsed = ttft if ttft is not None else time.perf_counter() - t0
    return elapsed, tokens, check(kind, text, calls, finish)


async def run(base_url, model, clients, requests, max_tokens, mix):
    client = openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=300)
    results, failures = [], []

    async def worker(c):
        for r in range(requests):
            i = c * requests + r
            kind = KINDS[i % len(KINDS)] if mix else "plain"
            try:
                results.append((kind, *await one(client, model, i, max_tokens, kind)))
            except Exception as e:  # noqa: BLE001 - every failure is counted and shown
                failures.append(repr(e))

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(c) for c in range(clients)))
    wall = time.perf_counter() - t0
    await client.close()
    return results, failures, wall


def report(name, results, failures, wall):
    """Prints the run's figures; returns (tokens per second, invalid replies)."""
    ttfts = sorted(r[1] for r in results)
    tokens = sum(r[2] for r in results)
    invalid = [(r[0], r[3]) for r in results if r[3]]
    p = lambda q: ttfts[min(len(ttfts) - 1, int(q * len(ttfts)))] * 1000  # noqa: E731
    kinds = {k: sum(1 for r in results if r[0] == k) for k in KINDS}
    print(
        f"{name}: {len(results)} ok ({', '.join(f'{n} {k}' for k, n in kinds.items() if n)}), "
        f"{len(failures)} failed, {len(invalid)} invalid, {tokens} tokens in {wall:.1f} s = "
        f"{tokens / wall:.1f} tok/s; TTFT p50 {p(0.5):.0f} ms, p99 {p(0.99):.0f} ms, "
        f"mean {statistics.mean(ttfts) * 1000:.0f} ms"
    )
    for f in failures[:5]:
        print("  failure:", f)
    for kind, why in invalid[:5]:
        print(f"  invalid {kind}:", why)
    return tokens / wall, len(invalid)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("base_url")
    ap.add_argument("model")
    ap.add_argument("pid", type=int)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--mix", action="store_true", help="plain, tool and json_schema requests in turn")
    a = ap.parse_args()
    idle = rss_kib(a.pid)
    single, bad = report("1 client", *asyncio.run(run(a.base_url, a.model, 1, a.requests, a.max_tokens, a.mix)))
    # The same load twice: the first touches every slot's KV cache (allocated lazily by the
    # OS), so memory growth from one run to the next is what a leak would show.
    failed = 0
    rss = []
    for run_no in (1, 2):
        res = asyncio.run(run(a.base_url, a.model, a.clients, a.requests, a.max_tokens, a.mix))
        many, invalid = report(f"{a.clients} clients, run {run_no}", *res)
        failed += len(res[1])
        bad += invalid
        rss.append(rss_kib(a.pid))
    print(f"aggregate speed-up {many / single:.2f}x over one client")
    print(f"RSS idle {idle / 1024:.1f} MiB; after load run 1 {rss[0] / 1024:.1f} MiB, after run 2 "
          f"{rss[1] / 1024:.1f} MiB ({(rss[1] - rss[0]) / rss[0] * 100:+.1f}%)")
    if failed or bad:
        raise SystemExit(f"{failed} requests failed, {bad} replies invalid")


if __name__ == "__main__":
    main()
