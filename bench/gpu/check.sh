#!/usr/bin/env bash
# Everything castor checks and measures on a GPU, in one run (after bench/gpu/pack.sh, from the
# repository root): the device layer's GPU test, every kernel family and three training steps
# per family against the CPU executor (failing, not skipping, without a GPU), the demo and a
# training run on CUDA, and the benchmark harness against PyTorch. Logs and results go to
# OUT_DIR; a summary is printed last.
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${1:?usage: bench/gpu/check.sh OUT_DIR}"
mkdir -p "$out"
export CASTOR_REQUIRE_GPU=1 CASTOR_BIN="$PWD/gpu-pack/castor"
export CASTOR_CACHE_DIR="${CASTOR_CACHE_DIR:-$out/ptx-cache}"
status=()
step() { # name, command...
  local name=$1; shift
  local t0=$SECONDS
  "$@" >"$out/$name.log" 2>&1
  local rc=$?
  status+=("$(printf '%-18s exit %-3s %4ss' "$name" "$rc" $((SECONDS - t0)))")
}
nvidia-smi >"$out/nvidia-smi.txt" 2>&1
step device_layer gpu-pack/runtime_tests --nocapture --test-threads 1 cuda::device
step kernels_and_steps gpu-pack/cuda_gpu --nocapture --test-threads 1
step demo gpu-pack/castor demo --device cuda --out "$out/demo"
step train_gpt2_bf16 gpu-pack/castor train tests/fixtures/gpt2_lm --data assets/corpus.txt \
  --batch 4 --seq 32 --steps 50 --precision bf16 --device cuda --log "$out/train.jsonl"
step bench python bench/gpu/bench.py --out "$out/bench" --castor gpu-pack/castor
printf '%s\n' "${status[@]}" | tee "$out/summary.txt"
tail -20 "$out/bench.log"
