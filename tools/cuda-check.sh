#!/usr/bin/env bash
# Build the CUDA checks here (needs nvcc: .ci/install-nvcc) and stage them in .carry/ (git-ignored via
# .git/info/exclude), then on the H200 run, from the repo root, with carry [".carry"]:
#   [ -e /work/main ] || { mkdir -p /work; ln -s $PWD /work/main; }   # tests find tests/fixtures by build path
#   TERN_REQUIRE_CUDA=1 ./.carry/gpu-test --test-threads=1 --nocapture; ./.carry/tern-cuda-bench .carry/qwen
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -p tern-cuda --bins
test=$(cargo test --release -p tern-cuda --no-run 2>&1 | grep -oE 'target/release/deps/gpu-[0-9a-f]+' | tail -1)
mkdir -p .carry/qwen
grep -qx '/.carry/' "$(git rev-parse --git-path info/exclude)" || echo '/.carry/' >>"$(git rev-parse --git-path info/exclude)"
cp "$test" .carry/gpu-test
cp target/release/tern-cuda-bench .carry/
cp "${TERN_QWEN_DIR:-../shared/qwen3.6-35b-a3b}/config.json" .carry/qwen/
ls -la .carry
