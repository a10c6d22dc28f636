#!/usr/bin/env bash
# Builds what the GPU machine runs (it has CUDA 13 and PyTorch but no Rust) into gpu-pack/:
# the castor binary, the GPU test binary (tests/cuda_gpu.rs) and the runtime's unit tests
# (the device layer's own GPU test), release builds, stripped so that they travel light.
# The commit they are built from goes to gpu-pack/COMMIT (the benchmark record names it; the
# GPU machine has no git). Then, on the GPU machine, from the repository root:
#   python3 bench/gpu/check.py OUT --part all     (tests, then the benchmark, then the profile)
set -euo pipefail
cd "$(dirname "$0")/../.."
cargo build --release
exe() { # the test executable cargo reports for a target
  cargo test --release "$@" --no-run --message-format=json 2>/dev/null |
    python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("executable") and m.get("profile", {}).get("test"):
        print(m["executable"])' | tail -1
}
rm -rf gpu-pack && mkdir -p gpu-pack
cp target/release/castor gpu-pack/castor
cp "$(exe --test cuda_gpu)" gpu-pack/cuda_gpu
cp "$(exe -p castor-runtime --lib)" gpu-pack/runtime_tests
strip gpu-pack/castor gpu-pack/cuda_gpu gpu-pack/runtime_tests
commit=$(git rev-parse --short=12 HEAD)
[ -z "$(git status --porcelain --untracked-files=no)" ] || commit="$commit-dirty"
echo "$commit" > gpu-pack/COMMIT
ls -la gpu-pack
