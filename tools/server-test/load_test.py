"""Load test, loopback only, bounded in count and time: one client alone, then
CLIENTS concurrent clients x REQUESTS streamed chat requests each. Prints
failures, aggregate generated tokens per second, time to first token (p50,
p99) and the server's resident memory before and after.

Usage: load_test.py BASE_URL MODEL_ID SERVER_PID [--clients 32] [--requests 20] [--max-tokens 32]"""

import argparse
import asyncio
import statistics
import time

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


async def one(client, model, i, max_tokens):
    t0 = time.perf_counter()
    ttft, tokens = None, 0
    stream = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
        max_tokens=max_tokens,
        temperature=0.7,
        seed=i,
        stream=True,
        stream_options={"include_usage": True},
    )
    async for chunk in stream:
        if ttft is None and chunk.choices and chunk.choices[0].delta.content:
            ttft = time.perf_counter() - t0
        if chunk.usage:
            tokens = chunk.usage.completion_tokens
    return ttft if ttft is not None else time.perf_counter() - t0, tokens


async def run(base_url, model, clients, requests, max_tokens):
    client = openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=300)
    results, failures = [], []

    async def worker(c):
        for r in range(requests):
            try:
                results.append(await one(client, model, c * requests + r, max_tokens))
            except Exception as e:  # noqa: BLE001 - every failure is counted and shown
                failures.append(repr(e))

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(c) for c in range(clients)))
    wall = time.perf_counter() - t0
    await client.close()
    return results, failures, wall


def report(name, results, failures, wall):
    ttfts = sorted(t for t, _ in results)
    tokens = sum(n for _, n in results)
    p = lambda q: ttfts[min(len(ttfts) - 1, int(q * len(ttfts)))] * 1000  # noqa: E731
    print(
        f"{name}: {len(results)} ok, {len(failures)} failed, {tokens} tokens in {wall:.1f} s = "
        f"{tokens / wall:.1f} tok/s; TTFT p50 {p(0.5):.0f} ms, p99 {p(0.99):.0f} ms, "
        f"mean {statistics.mean(ttfts) * 1000:.0f} ms"
    )
    for f in failures[:5]:
        print("  failure:", f)
    return tokens / wall


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("base_url")
    ap.add_argument("model")
    ap.add_argument("pid", type=int)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=32)
    a = ap.parse_args()
    idle = rss_kib(a.pid)
    single = report("1 client", *asyncio.run(run(a.base_url, a.model, 1, a.requests, a.max_tokens)))
    # The same load twice: the first touches every slot's KV cache (allocated lazily by the
    # OS), so memory growth from one run to the next is what a leak would show.
    failed = 0
    rss = []
    for run_no in (1, 2):
        res = asyncio.run(run(a.base_url, a.model, a.clients, a.requests, a.max_tokens))
        many = report(f"{a.clients} clients, run {run_no}", *res)
        failed += len(res[1])
        rss.append(rss_kib(a.pid))
    print(f"aggregate speed-up {many / single:.2f}x over one client")
    print(f"RSS idle {idle / 1024:.1f} MiB; after load run 1 {rss[0] / 1024:.1f} MiB, after run 2 "
          f"{rss[1] / 1024:.1f} MiB ({(rss[1] - rss[0]) / rss[0] * 100:+.1f}%)")
    if failed:
        raise SystemExit(f"{failed} requests failed")


if __name__ == "__main__":
    main()
