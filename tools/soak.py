#!/usr/bin/env python3
"""Soak a running tern server the way many users load it for a while: N streaming chat clients for D seconds,
each looping over requests of random prompt length, reply length and sampling, a fraction of them hanging up
mid-stream; /health polled every second; the server's RSS (--pid) and the GPU's memory in use (nvidia-smi, when
present) sampled every 10 s. Standard library and httpx only.

  python3 tools/soak.py --port 8080 --clients 64 --seconds 600 [--pid PID] [--out soak.json]

Checks (exit status 1 if any fails, with the reasons printed):
  - every request that was not hung up on ends with [DONE], a usage block, and no more content/reasoning chunks
    than usage.completion_tokens + 1 (the parser's held-back text ends the reply as one chunk), with
    completion_tokens <= max_tokens;
  - every chunk of a stream carries that stream's id, and no two streams share an id (nothing mixed);
  - no HTTP status other than 200 (429/503 are counted apart: the server may refuse work when full);
  - /health answers 200 at every poll;
  - memory flat: RSS and GPU memory at the end within 10% (+64 MiB) of their level after the first minute, less
    what the prefix cache holds (tern_prefix_cache_bytes: bounded, it fills by design; it lives in host memory on
    the CPU backend, in device memory on CUDA: --state-on).
"""
import argparse, json, random, shutil, subprocess, threading, time

import httpx

WORDS = ("river stone light window garden engine market paper silver orange winter signal forest "
         "music planet copper bridge harbor violet thunder marble lantern canyon meadow").split()


def rss_mib(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def cache_mib(root):
    try:
        for line in httpx.get(root + "/metrics", timeout=5).text.splitlines():
            if line.startswith("tern_prefix_cache_bytes "):
                return float(line.split()[1]) / (1 << 20)
    except Exception:  # noqa: BLE001
        return None
    return None


def gpu_mib():
    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout
        return sum(float(v) for v in out.split())
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return None


class Tally:
    def __init__(self):
        self.lock = threading.Lock()
        self.n = {"requests": 0, "completed": 0, "hung_up": 0, "tokens": 0, "refused": 0}
        self.failures = []
        self.ids = set()

    def fail(self, msg):
        with self.lock:
            if len(self.failures) < 50:
                self.failures.append(msg)

    def add(self, key, v=1):
        with self.lock:
            self.n[key] += v


def one_request(base, model, rng, tally, timeout):
    words = rng.randint(4, 600)
    prompt = " ".join(rng.choice(WORDS) for _ in range(words))
    max_tokens = rng.randint(1, 160)
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "stream": True, "stream_options": {"include_usage": True}}
    if rng.random() < 0.5:
        body.update(temperature=0.7, top_p=0.95, top_k=20, seed=rng.randint(0, 1 << 30))
    else:
        body.update(temperature=0.0)
    hang_up = rng.randint(1, max_tokens) if rng.random() < 0.2 else None
    tally.add("requests")
    sid, chunks, usage, done = None, 0, None, False
    try:
        with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=timeout) as r:
            if r.status_code in (429, 503):
                tally.add("refused")
                return
            if r.status_code != 200:
                tally.fail(f"HTTP {r.status_code}: {r.read()[:200]!r}")
                return
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                ev = json.loads(data)
                if sid is None:
                    sid = ev.get("id")
                    with tally.lock:
                        if sid in tally.ids:
                            tally.failures.append(f"stream id {sid} seen twice")
                        tally.ids.add(sid)
                elif ev.get("id") != sid:
                    tally.fail(f"a chunk of stream {sid} carries id {ev.get('id')}")
                if ev.get("usage"):
                    usage = ev["usage"]
                for ch in ev.get("choices", []):
                    d = ch.get("delta", {})
                    if d.get("content") or d.get("reasoning_content") or d.get("tool_calls"):
                        chunks += 1
                if hang_up is not None and chunks >= hang_up:
                    tally.add("hung_up")
                    return
    except Exception as e:  # noqa: BLE001 - every failure is reported
        tally.fail(f"request failed: {e!r}"[:300])
        return
    if not done or usage is None:
        tally.fail(f"stream {sid} ended without [DONE] and usage (done={done}, usage={usage})")
        return
    n = usage.get("completion_tokens", -1)
    # a token may decode to no text yet (held back until it completes a character or a tag), and what is held back
    # comes out as one last chunk when the reply ends: at most one chunk more than tokens
    if chunks > n + 1 or n > max_tokens:
        tally.fail(f"stream {sid}: {chunks} chunks, usage says {n} tokens (max_tokens {max_tokens})")
    tally.add("completed")
    tally.add("tokens", max(n, 0))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, default=8080)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=600)
    ap.add_argument("--pid", type=int, default=None, help="the server's pid, for its RSS")
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--state-on", choices=["cpu", "gpu"], default="gpu",
                    help="where the backend keeps sequence state (and so the prefix cache): cpu or gpu")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    root = f"http://127.0.0.1:{a.port}"
    t0 = time.monotonic()
    base = root
    tally = Tally()
    stop = time.monotonic() + a.seconds
    health = {"polls": 0, "bad": 0}
    mem = []

    model = httpx.get(root + "/v1/models", timeout=30).json()["data"][0]["id"]

    def client(i):
        rng = random.Random(1000 + i)
        while time.monotonic() < stop:
            one_request(base, model, rng, tally, a.timeout)

    def sample_mem():
        m = {"t": round(time.monotonic() - t0, 1), "rss_mib": rss_mib(a.pid) if a.pid else None,
             "gpu_mib": gpu_mib(), "cache_mib": cache_mib(root)}
        key = "rss_mib" if a.state_on == "cpu" else "gpu_mib"
        m["flat_rss_mib"], m["flat_gpu_mib"] = m["rss_mib"], m["gpu_mib"]
        if m[key] is not None and m["cache_mib"] is not None:
            m["flat_" + key] = m[key] - m["cache_mib"]
        return m

    def monitor():
        last_mem = -1e9
        while time.monotonic() < stop:
            try:
                ok = httpx.get(root + "/health", timeout=5).status_code == 200
            except Exception:  # noqa: BLE001
                ok = False
            health["polls"] += 1
            health["bad"] += 0 if ok else 1
            now = time.monotonic()
            if now - last_mem >= 10:
                last_mem = now
                mem.append(sample_mem())
            time.sleep(1)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(a.clients)]
    mon = threading.Thread(target=monitor)
    for t in threads + [mon]:
        t.start()
    for t in threads + [mon]:
        t.join()
    wall = time.monotonic() - t0
    mem.append(sample_mem())
    if health["bad"]:
        tally.fail(f"/health failed {health['bad']} of {health['polls']} polls")
    # memory flat: the end against the level after the first minute (arenas, caches and graphs warm up first)
    ref = next((m for m in mem if m["t"] >= min(60, a.seconds / 2)), mem[0])
    for key in ("flat_rss_mib", "flat_gpu_mib"):
        if ref[key] is not None and mem[-1][key] is not None and mem[-1][key] > ref[key] * 1.10 + 64:
            tally.fail(f"{key} (less the prefix cache) grew from {ref[key]:.0f} to {mem[-1][key]:.0f}")
    res = dict(tally.n, seconds=round(wall, 1), clients=a.clients, tokens_per_s=round(tally.n["tokens"] / wall, 1),
               health=health, memory=mem, failures=tally.failures)
    print(json.dumps({k: v for k, v in res.items() if k != "memory"}, indent=1))
    print("memory (t s, RSS MiB, GPU MiB, prefix cache MiB):",
          [(m["t"], m["rss_mib"], m["gpu_mib"], m["cache_mib"]) for m in mem])
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    if tally.failures or tally.n["completed"] == 0:
        print("SOAK FAILED:", *tally.failures[:10], sep="\n  ")
        raise SystemExit(1)
    print("soak ok")


if __name__ == "__main__":
    main()
