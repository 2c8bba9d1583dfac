#!/usr/bin/env bash
# Stage the CUDA checks for the H200 (needs nvcc here: .ci/install-nvcc). Builds the release `tern` binary and the
# GPU test binaries and copies them, with the model config, into .carry/ (git-ignored).
# Then, through the device tool, with carry [".carry"], from the repo root:
#   bash tools/cuda-run.sh tests            # every GPU test, one process each (a trap in one cannot hide the rest)
#   bash tools/cuda-run.sh bench 256,4096   # tern bench --backend cuda on random full-shape weights
#   bash tools/cuda-run.sh serve            # tern serve --backend cuda on a full-shape random checkpoint + serve_probe
#   bash tools/cuda-run.sh soak 560 64      # the same server, 64 clients of tools/soak.py for 560 s
#   bash tools/cuda-run.sh moe              # tools/moe_bench.cu: the streamed expert kernels alone
# Logs go to $OUT (the device tool brings them back).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -p tern-cli
mkdir -p .carry/qwen
for t in gpu kernels prefill batch sample; do
  bin=$(cargo test --release -p tern-cuda --test "$t" --no-run 2>&1 | grep -oE "target/release/deps/$t-[0-9a-f]+" | tail -1)
  cp "$bin" ".carry/$t"
done
cp target/release/tern .carry/
# the streamed experts' microbenchmark (tools/moe_bench.cu, `cuda-run.sh moe`), with the nvcc that builds the kernels
cu13=$(python3 -c "import nvidia, os; print(os.path.join(nvidia.__path__[0], 'cu13'))")
"$cu13/bin/nvcc" -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 -I"$cu13/include" -L"$cu13/lib" \
  -o .carry/moe_bench tools/moe_bench.cu
# binaries go compressed (the transfer limit is 64 MiB; tools/cuda-run.sh unpacks them)
for f in .carry/tern .carry/gpu .carry/kernels .carry/prefill .carry/batch .carry/sample .carry/moe_bench; do
  gzip -f "$f"
done
qwen=${TERN_QWEN_DIR:-../shared/qwen3.6-35b-a3b}
cp "$qwen"/{config.json,tokenizer_config.json,chat_template.jinja,generation_config.json} .carry/qwen/
gzip -c "$qwen/tokenizer.json" >.carry/qwen/tokenizer.json.gz  # 33 MB -> a few: the transfer limit is 64 MiB
cp "$qwen/../tools/serve_probe.py" tools/soak.py tools/ncu_stalls.py tools/probe_client_cost.py tools/serve_load.py .carry/
git rev-parse --short HEAD >.carry/commit
ls -la .carry
