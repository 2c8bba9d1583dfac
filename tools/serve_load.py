"""Aggregate streaming throughput of a running server from a client that costs (almost) nothing: one asyncio
httpx client with kept-alive connections, all N requests sent at once, the same requests as serve_probe.py's
"N streams" phase (a 60-word prompt, 128 greedy tokens each). serve_probe.py opens a fresh client per request
from a thread per stream (~20 ms of Python each, one after another), which puts a floor under its wall time
(tools/probe_client_cost.py measures it); this shows what the server itself sustains.

    python3 tools/serve_load.py --port 8080 --streams 8,32,64 [--repeats 2]
"""
import argparse
import asyncio
import json
import random
import time

import httpx

# serve_probe.py's words and prompts, so that the requests are the same
WORDS = ("river stone light window garden engine market paper silver orange winter signal forest "
         "music planet copper bridge harbor violet thunder marble lantern canyon meadow").split()


def text_of(n_words, seed):
    r = random.Random(seed)
    return " ".join(r.choice(WORDS) for _ in range(n_words))


async def one(client, base, model, i, gen, t0):
    body = {"model": model, "messages": [{"role": "user", "content": f"Request {i}: " + text_of(60, 1000 + i)}],
            "max_tokens": gen, "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    res = {"ttft": None, "tokens": 0, "err": None}
    try:
        async with client.stream("POST", base + "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                res["err"] = f"HTTP {r.status_code}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                if ev.get("usage"):
                    res["tokens"] = ev["usage"].get("completion_tokens", 0)
                for ch in ev.get("choices", []):
                    d = ch.get("delta", {})
                    if (d.get("content") or d.get("reasoning_content")) and res["ttft"] is None:
                        res["ttft"] = time.perf_counter() - t0
    except Exception as e:  # noqa: BLE001 - every failure is reported
        res["err"] = repr(e)[:200]
    return res


async def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, default=8080)
    ap.add_argument("--streams", default="8,32,64")
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args()
    base = f"http://127.0.0.1:{a.port}"
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        for _ in range(600):  # until the model is loaded
            try:
                if (await client.get(base + "/health")).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            await asyncio.sleep(1)
        model = (await client.get(base + "/v1/models")).json()["data"][0]["id"]
        for n in [int(x) for x in a.streams.split(",") if x]:
            for rep in range(a.repeats):
                t0 = time.perf_counter()
                rs = await asyncio.gather(*(one(client, base, model, i, a.gen, t0) for i in range(n)))
                wall = time.perf_counter() - t0
                toks = sum(r["tokens"] for r in rs)
                ttfts = sorted(r["ttft"] for r in rs if r["ttft"] is not None)
                errs = [r["err"] for r in rs if r["err"]]
                p50 = ttfts[len(ttfts) // 2] if ttfts else float("nan")
                print(f"{n} streams (one kept-alive client, run {rep + 1}): {toks} tokens in {wall:.2f} s = "
                      f"{toks / wall:.0f} tok/s aggregate; ttft p50 {p50:.3f} s max {ttfts[-1] if ttfts else 0:.3f} s; "
                      f"errors {len(errs)} {errs[:2]}", flush=True)


if __name__ == "__main__":
    asyncio.run(main())
