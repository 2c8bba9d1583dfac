#!/usr/bin/env bash
# Device side of tools/cuda-check.sh: run from the repo root on the GPU machine with .carry/ carried.
#   tools/cuda-run.sh tests [filter]     each GPU test in its own process (TERN_REQUIRE_CUDA=1), summary at the end;
#                                        filter: an extended regex on bin::name (prefill::, 'batch::|moe_rows', ...)
#   tools/cuda-run.sh ignored [filter]   the slow full-shape tests
#   tools/cuda-run.sh racecheck FILTER   the matching GPU tests under compute-sanitizer's shared-memory race checker
#                                        (slow: a few tests at a time); a hazard fails the test (rc 9)
#   tools/cuda-run.sh bench CTXS [args]  tern bench --backend cuda --random-weights at CTXS
#   tools/cuda-run.sh serve [serve args] the batch-1 bench at ctx 256, then tern serve --backend cuda on a full-shape
#                                        random checkpoint, serve_probe.py, probe_client_cost.py, serve_load.py
#   tools/cuda-run.sh soak SECS [clients] [serve args]  the same server under tools/soak.py (default 64 clients)
#   tools/cuda-run.sh soak-start SECS [clients], then soak-wait  a soak longer than one call (two calls back to back)
#   tools/cuda-run.sh fla [T ...]         FLA's chunked GDN at the model's shape, GPU time (tools/gdn_fla.py; carry .whl)
#   tools/cuda-run.sh moe                tools/moe_bench.cu: the streamed expert kernels alone at B = 1 / 8 / 32 / 64 (each
#                                        variant's time, where the time goes, ring = register-streamed bit for bit)
#   tools/cuda-run.sh ncu [kernel regex]  Nsight Compute on the batched decode's kernels (NCU_SKIP, NCU_COUNT)
#   tools/cuda-run.sh stalls REGEX SKIP   per-instruction stall sampling of one launch (tools/ncu_stalls.py)
# Serving throughput under vLLM's own load client: tools/serve-bench.sh (carry .whl too, for .whl/vllm_bench/).
# The environment passes through (TERN_STEP_LOG=1 logs every engine step to serve.log; MAX_CONCURRENT, default 256).
set -u
OUT=${OUT:-/tmp/tern-out}
mkdir -p "$OUT"
# the test binaries find tests/fixtures through the path they were built at
[ -e /work/main ] || { mkdir -p /work && ln -s "$PWD" /work/main; }
export TERN_REQUIRE_CUDA=1 PYTHONUNBUFFERED=1
# the binaries come gzipped (tools/cuda-check.sh); unpack this carry's over any left from an earlier call
for f in .carry/*.gz; do gunzip -kf "$f"; done
# Each carried test binary's tests whose bin::name matches FILTER (an extended regex; empty: all), each in its own
# process under the command prefix PREFIX... (none, or the sanitizer): run_tests FILTER FLAG LOG SUMMARY LIMIT PREFIX...
run_tests() {
  local filter=$1 flag=$2 logf=$3 sumf=$4 limit=$5 summary="" bin name log rc
  shift 5
  for bin in prefill kernels gpu batch sample; do
    for name in $(./.carry/$bin --list $flag 2>/dev/null | sed -n 's/: test$//p'); do
      [ -n "$filter" ] && [[ ! "$bin::$name" =~ $filter ]] && continue
      log=$(mktemp)
      timeout "$limit" "$@" ./.carry/$bin "$name" --exact --nocapture --test-threads=1 $flag >"$log" 2>&1
      rc=$?
      summary+="$rc $bin::$name"$'\n'
      { echo "=== $bin::$name rc=$rc"; cat "$log"; } >>"$OUT/$logf"
      echo "=== $bin::$name rc=$rc"
      grep -vE '^(running|test result|$)' "$log" | tail -n 12
    done
  done
  echo "=== summary (rc test)"
  printf '%s' "$summary" | tee "$OUT/$sumf"
}
what=${1:-tests}
shift || true
case "$what" in
tests | ignored)
  flag=""
  [ "$what" = ignored ] && flag="--ignored"
  run_tests "${1:-}" "$flag" tests.log summary.txt "${TERN_TEST_TIMEOUT:-240}"
  ;;
racecheck)
  filter=${1:?racecheck needs a test filter (the tests run ~100x slower under the sanitizer)}
  san=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
  [ -n "$san" ] || { echo "compute-sanitizer not found"; exit 1; }
  run_tests "$filter" "" racecheck.log racecheck-summary.txt "${TERN_TEST_TIMEOUT:-540}" \
    "$san" --tool racecheck --racecheck-report hazard --error-exitcode 9
  ;;
moe)
  ./.carry/moe_bench 2>&1 | tee "$OUT/moe_bench.txt"
  ;;
fla)
  # FLA's chunk_gated_delta_rule at the model's GDN shape (tools/gdn_fla.py; carry .whl, which holds .whl/fla/)
  python3 -m pip install --no-deps -q .whl/fla/*.whl 2>&1 | grep -v WARNING
  python3 tools/gdn_fla.py "${@:-4096}" 2>&1 | tee "$OUT/fla.txt"
  ;;
bench)
  ctx=${1:-256,4096,32768}
  shift || true
  ./.carry/tern bench --backend cuda --random-weights --config .carry/qwen --ctx "$ctx" "$@" 2>&1 | tee "$OUT/bench.txt"
  ;;
ncu)
  # Nsight Compute on the batched decode's heaviest kernels, as the bench's batched table runs them: the report to
  # $OUT/ncu.txt, clocks left alone (METHOD.md). Kernels: a regex, default the streamed MoE and the GDN step (110
  # launches a step: 40 + 40 + 30). The table runs 96 steps per batch size (4 runs of 8 steps, 3 columns) in the
  # order 1, 2, 4, 8, 16, 32, 64, so the default skip of 5 x 96 x 110 = 52,800 lands on B = 32.
  kernels=${1:-moe_gate_up_seqs|moe_down_seqs|gdn_step_seqs}
  ncu --clock-control none --kernel-name "regex:$kernels" --launch-skip ${NCU_SKIP:-52800} --launch-count ${NCU_COUNT:-6} \
    --set full ./.carry/tern bench --backend cuda --random-weights --config .carry/qwen --ctx 256 --repeats 1 \
    >"$OUT/ncu.txt" 2>&1
  echo "ncu rc=$?"
  grep -E "^  [a-z_]+seqs|Duration|Memory Throughput|DRAM Throughput|Compute \(SM\) Throughput|Achieved Occupancy|Registers Per|Block Limit|Warp Cycles Per Issued|No Eligible|One or More Eligible|Stall" "$OUT/ncu.txt" | head -120
  ;;
stalls)
  # where one launch of a kernel waits: Nsight Compute's stall sampling per SASS instruction, summarised by
  # tools/ncu_stalls.py. The bench runs at ctx 4096 so that its prefill takes the GEMMs, not the streamed kernels:
  # the batched table then runs 96 steps per batch size in the order 1, 2, 4, 8, 16, 32, 64, so SKIP = 5 x 96 x
  # (the regex's launches per step) lands on the first step at B = 32 (moe_gate_up_seqs: 40 a step, SKIP 19200;
  # dense_seqs_w2_k1: only the lm_head below B = 32, SKIP 480 for B = 32's first in_proj).
  regex=${1:?kernel regex}
  skip=${2:?launches to skip}
  ncu --clock-control none --kernel-name "regex:$regex" --launch-skip "$skip" --launch-count 1 \
    --section SourceCounters --section WarpStateStats --section SpeedOfLight -o "$OUT/stalls" \
    ./.carry/tern bench --backend cuda --random-weights --config .carry/qwen --ctx 4096 --repeats 1 >"$OUT/stalls.log" 2>&1
  echo "ncu rc=$?"
  ncu --import "$OUT/stalls.ncu-rep" --page source --csv --print-source sass >"$OUT/stalls.csv" 2>&1
  ncu --import "$OUT/stalls.ncu-rep" --page details 2>&1 | grep -E "^  [a-z_0-9]+ \(|Duration|DRAM Throughput|Warp Cycles Per Issued" | head
  python3 .carry/ncu_stalls.py "$OUT/stalls.csv" --top 40 | tee "$OUT/stalls.txt"
  rm -f "$OUT/stalls.ncu-rep" "$OUT/stalls.csv"
  ;;
serve | soak)
  # a full-shape random 4-bit checkpoint with the real tokenizer (kept in /tmp while the machine stays warm), served
  # on CUDA and driven by serve_probe.py or tools/soak.py
  dir=/tmp/tern-rq4
  [ -f .carry/qwen/tokenizer.json ] || gunzip -k .carry/qwen/tokenizer.json.gz
  [ -f $dir/config.json ] || ./.carry/tern random-model --config .carry/qwen --out $dir --quant q4 --tokenizer-from .carry/qwen 2>&1 | tail -2
  if [ "$what" = soak ]; then
    secs=${1:-300}
    clients=${2:-64}
    shift 2 || shift $#
  fi
  if [ "$what" = serve ]; then
    # the batch-1 bench on this machine first: what one stream through the server is held against (machines differ
    # by a few percent, more than the criterion's margin)
    ./.carry/tern bench --backend cuda --random-weights --config .carry/qwen --ctx 256 --repeats 3 2>&1 |
      grep -E "^ +ctx |^ +256 " | tee "$OUT/bench_b1.txt"
  fi
  ./.carry/tern serve --model $dir --backend cuda --port 8080 --max-concurrent "${MAX_CONCURRENT:-256}" "$@" >"$OUT/serve.log" 2>&1 &
  pid=$!
  if [ "$what" = serve ]; then
    timeout 500 python3 .carry/serve_probe.py --port 8080 ${PROBE_ARGS:-} --out "$OUT/probe.json" 2>&1 | tee "$OUT/probe.txt"
    # what the probe's own client costs (a fresh httpx client per request): the floor under its TTFT and wall
    python3 .carry/probe_client_cost.py --port 8080 2>&1 | tee "$OUT/client_cost.txt"
    # the same streams from one kept-alive asyncio client: what the server sustains without the probe's client
    python3 .carry/serve_load.py --port 8080 --streams 8,32,64 --repeats 2 2>&1 | tee "$OUT/serve_load.txt"
  else
    for _ in $(seq 120); do curl -sf localhost:8080/health >/dev/null && break; sleep 1; done
    python3 .carry/soak.py --port 8080 --clients "$clients" --seconds "$secs" --pid $pid --state-on gpu \
      --out "$OUT/soak.json" 2>&1 | tee "$OUT/soak.txt"
  fi
  curl -s localhost:8080/metrics >"$OUT/metrics.txt"
  kill -INT $pid; sleep 2; kill -9 $pid 2>/dev/null
  grep -E "tern:|error|panic" "$OUT/serve.log" | tail -8
  ;;
soak-start)
  # a soak longer than one call (at most 600 s, the server's start included): the `soak` above detached into its
  # own session, writing to /tmp/soak-out; `soak-wait` in the next call (within the machine's 30 s of idle) waits
  # for it and brings its files back
  rm -rf /tmp/soak-out && mkdir -p /tmp/soak-out
  setsid nohup bash -c "OUT=/tmp/soak-out bash tools/cuda-run.sh soak $* >/tmp/soak-out/run.txt 2>&1; touch /tmp/soak-out/done" \
    >/dev/null 2>&1 &
  sleep 5
  echo "soak started in the background: $*"
  ;;
soak-wait)
  for _ in $(seq "${1:-590}"); do [ -e /tmp/soak-out/done ] && break; sleep 1; done
  [ -e /tmp/soak-out/done ] || echo "soak not finished yet (call soak-wait again)"
  cp -r /tmp/soak-out/. "$OUT/"
  tail -n 30 "$OUT/run.txt"
  ;;
*)
  echo "unknown: $what" >&2
  exit 2
  ;;
esac
