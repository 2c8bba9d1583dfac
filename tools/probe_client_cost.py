"""What serve_probe.py's client costs before a request reaches the server: N threads start together, each opens
its own httpx.stream (a fresh client per request, as the probe does) and GETs /health of a running server (an
answer that costs the server ~nothing). Prints, per N, when the responses' heads arrived after the start (p50,
max) -- the part of the probe's "time to first token" and wall time that no server can remove."""
import argparse
import threading
import time

import httpx


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, default=8080)
    ap.add_argument("--streams", default="1,8,32,64")
    a = ap.parse_args()
    url = f"http://127.0.0.1:{a.port}/health"
    for n in [int(x) for x in a.streams.split(",") if x]:
        done = [None] * n

        def worker(i):
            with httpx.stream("GET", url, timeout=60) as r:
                r.read()
                done[i] = time.perf_counter() - t0

        t0 = time.perf_counter()
        ths = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
        for t in ths:
            t.start()
        for t in ths:
            t.join()
        d = sorted(x for x in done if x is not None)
        print(f"{n} clients: responses after p50 {d[len(d) // 2] * 1e3:.0f} ms, max {d[-1] * 1e3:.0f} ms", flush=True)


if __name__ == "__main__":
    main()
