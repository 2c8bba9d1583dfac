#!/usr/bin/env bash
# Serving throughput measured by vLLM's own load client: benchmarks/benchmark_serving.py of vLLM v0.9.2 (random
# dataset, streamed requests, --max-concurrency, --ignore-eos), kept git-ignored in .whl/vllm_bench/ with three small
# patches (its PATCHES.md: no vllm or datasets imports; one kept-alive aiohttp session per client process;
# tokenizer.json read as it is, since transformers 5 re-splits Qwen3.6 prompts and miscounts them).
# .whl/ is not in the repository: a fresh checkout rebuilds it from PyPI's sdist (`pip download --no-deps
# --no-binary :all: vllm==0.9.2`, then benchmarks/{benchmark_serving,backend_request_func,benchmark_dataset,
# benchmark_utils}.py into .whl/vllm_bench/) and makes the three changes above by hand (the last rebuild keeps them as
# .whl/vllm_bench/tern.patch, with wheels of aiohttp and tokenizers in .whl/wheels/ that its ensure_deps.sh installs
# offline where the device's python lacks them).
# Device side, from the repo root after tools/cuda-check.sh, carry [".carry", ".whl"]:
#   bash tools/serve-bench.sh "CONC:IN:OUT:PROMPTS ..."     e.g. "128:1024:128:512 64:1024:1024:256"
# Serves the full-shape random q4 checkpoint on CUDA (as cuda-run.sh serve does), then runs one client process per
# profile. $OUT gets serve_bench.txt (one summary line a run), serve.log, and serve_bench.tgz (vLLM's result JSON
# with per-request lists, and the client's log, for each run).
# Env: SERVE_ARGS (more `tern serve` flags), BACKEND (openai = /v1/completions, the default; openai-chat),
# IGNORE_EOS (1, the default: every reply must be OUT tokens long; 0 lets replies stop at EOS), DEADLINE (seconds
# after the start at which a run is cut and the files are packed; default 570, the call's limit being 600).
# Local use: TERN, MODEL, TOKENIZER, DEVICE (cuda) and PYTHON (python3) override the device's paths.
set -u
OUT=${OUT:-/tmp/tern-out}
TERN=${TERN:-./.carry/tern} MODEL=${MODEL:-/tmp/tern-rq4} TOKENIZER=${TOKENIZER:-.carry/qwen}
PORT=${PORT:-8080} BACKEND=${BACKEND:-openai} PYTHON=${PYTHON:-python3} DEADLINE=${DEADLINE:-570}
profiles=${1:?usage: serve-bench.sh \"CONC:IN:OUT:PROMPTS ...\"}
mkdir -p "$OUT"
work=$(mktemp -d)
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
[ -f .whl/vllm_bench/ensure_deps.sh ] && PYTHON=$PYTHON bash .whl/vllm_bench/ensure_deps.sh
# the binaries and the tokenizer come gzipped (tools/cuda-check.sh)
for f in .carry/*.gz; do [ -e "$f" ] && gunzip -kf "$f"; done
[ -f "$TOKENIZER/tokenizer.json" ] || gunzip -k "$TOKENIZER/tokenizer.json.gz"
[ -f "$MODEL/config.json" ] ||
  "$TERN" random-model --config .carry/qwen --out "$MODEL" --quant q4 --tokenizer-from .carry/qwen 2>&1 | tail -2
"$TERN" serve --model "$MODEL" --backend "${DEVICE:-cuda}" --port "$PORT" ${SERVE_ARGS:-} >"$OUT/serve.log" 2>&1 &
pid=$!
url=http://127.0.0.1:$PORT
until curl -sf "$url/health" >/dev/null; do
  kill -0 $pid 2>/dev/null && [ $SECONDS -lt "$DEADLINE" ] || { echo "server not up"; tail "$OUT/serve.log"; exit 1; }
  sleep 1
done
model=$(curl -s "$url/v1/models" | "$PYTHON" -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')
endpoint=/v1/completions
[ "$BACKEND" = openai-chat ] && endpoint=/v1/chat/completions
eos_flag=--ignore-eos
[ "${IGNORE_EOS:-1}" = 1 ] || eos_flag=
echo "server up after ${SECONDS}s; model $model; client vLLM v0.9.2 benchmark_serving.py --backend $BACKEND $eos_flag" |
  tee "$OUT/serve_bench.txt"
seed=0
for p in $profiles; do
  IFS=: read -r conc inl outl n <<<"$p"
  tag=c${conc}_i${inl}_o${outl}_n${n}
  seed=$((seed + 1)) # a new seed a run: the same prompts again would hit the prefix cache
  left=$((DEADLINE - SECONDS))
  [ $left -gt 10 ] || { echo "$tag: skipped, past the deadline" | tee -a "$OUT/serve_bench.txt"; continue; }
  curl -s "$url/metrics" >"$work/$tag.m0"
  timeout $left "$PYTHON" .whl/vllm_bench/benchmark_serving.py --backend "$BACKEND" --base-url "$url" \
    --endpoint $endpoint --model "$model" --tokenizer "$TOKENIZER" --dataset-name random --random-input-len "$inl" \
    --random-output-len "$outl" --num-prompts "$n" --max-concurrency "$conc" $eos_flag --seed $seed \
    --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,99 --disable-tqdm \
    --save-result --save-detailed --result-dir "$work" --result-filename "$tag.json" >"$work/$tag.log" 2>&1
  rc=$?
  curl -s "$url/metrics" >"$work/$tag.m1"
  [ -f "$work/$tag.json" ] || { echo "$tag: client rc=$rc, no result" | tee -a "$OUT/serve_bench.txt"; tail -5 "$work/$tag.log"; continue; }
  # the summary line: vLLM's numbers, each reply's length against the asked one, and the server's own counters
  "$PYTHON" - "$work/$tag" "$conc" "$inl" "$outl" "$n" "$eos_flag" <<'EOF' | tee -a "$OUT/serve_bench.txt"
import json, sys
base, conc, inl, outl, n, eos = sys.argv[1], *map(int, sys.argv[2:6]), sys.argv[6]
r = json.load(open(base + ".json"))
def counters(path):
    return {k: float(v) for k, v in (l.split() for l in open(path) if l.startswith("tern_") and "{" not in l)}
m0, m1 = counters(base + ".m0"), counters(base + ".m1")
d = {k: m1.get(k, 0) - m0.get(k, 0) for k in m1}
done = [l for l, e in zip(r["output_lens"], r["errors"]) if not e]
failed = n - r["completed"]
if eos:
    bad = [l for l in done if l != outl]
    lens = "lens ok" if not bad else f"lens BAD: {len(bad)} of {len(done)} replies not {outl} tokens (min {min(bad)}, max {max(bad)})"
else:
    lens = f"lens (EOS allowed) min {min(done, default=0)} max {max(done, default=0)}"
reqs = max(d.get("tern_requests_total", 0), 1)  # the client's warm-up request included
print(f"c={conc} in={inl} out={outl} n={n}: output {r['output_throughput']:.1f} tok/s, total "
      f"{r['total_token_throughput']:.1f} tok/s, TTFT median {r['median_ttft_ms']:.1f} p99 {r['p99_ttft_ms']:.1f} ms, "
      f"TPOT median {r['median_tpot_ms']:.2f} ms, {r['completed']} done {failed} failed, {lens}; per request, "
      f"server {d.get('tern_prompt_tokens_total', 0) / reqs:.0f} prompt tokens (client "
      f"{r['total_input_tokens'] / max(r['completed'], 1):.0f}), {d.get('tern_cached_prompt_tokens_total', 0) / reqs:.0f} "
      f"cached, {d.get('tern_completion_tokens_total', 0) / reqs:.0f} completion ({r['duration']:.1f} s)")
first_error = next((e for e in r["errors"] if e), "")
if first_error:
    print("  first error:", first_error.strip().splitlines()[-1][:300])
EOF
done
kill -INT $pid
sleep 2
kill -9 $pid 2>/dev/null
tar czf "$OUT/serve_bench.tgz" -C "$work" .
grep -iE "error|panic" "$OUT/serve.log" | tail -5
