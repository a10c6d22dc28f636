#!/usr/bin/env bash
# Runs every fuzz target for SECONDS each (default 60) and prints the executions per target.
#
#   fuzz/run.sh 150            # needs a nightly toolchain and `cargo install cargo-fuzz`
#   fuzz/run.sh 60 ir_text     # one target
#
# Each target starts from a fresh corpus seeded with the repository's own inputs (fixtures,
# tests/ir, tests/malformed). A crash leaves its input under fuzz/artifacts/TARGET/ and makes
# the script exit non-zero: turn it into a case under tests/malformed/ and fix the bug.
set -euo pipefail

seconds="${1:-60}"
shift || true
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(dirname "$here")"
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
    targets=(safetensors_header config_to_graph ir_text policy_file token_file)
fi

seed() {
    local target="$1" dir="$2"
    case "$target" in
    safetensors_header)
        for f in "$root"/tests/malformed/checkpoints/*/*.safetensors; do
            cp "$f" "$dir/$(basename "$(dirname "$f")")-$(basename "$f")"
        done ;;
    config_to_graph)
        cp "$root"/tests/malformed/config/*.json "$dir/"
        for f in "$root"/tests/fixtures/*/config.json; do
            cp "$f" "$dir/$(basename "$(dirname "$f")").json"
        done ;;
    ir_text)
        cp "$root"/tests/ir/*.ir "$root"/tests/malformed/ir/*.ir "$dir/" ;;
    policy_file)
        cp "$root"/tests/ir/*.toml "$root"/tests/ir/*.json "$root"/tests/malformed/policy/* "$dir/" ;;
    token_file)
        # A valid llm.c file (header + 8 u16 tokens) and a raw nanoGPT-style one.
        python3 - "$dir" <<'PY'
import struct, sys
header = [20240520, 1, 8] + [0] * 253
open(sys.argv[1] + "/llmc.bin", "wb").write(struct.pack("<256i", *header) + struct.pack("<8H", *range(8)))
open(sys.argv[1] + "/raw.bin", "wb").write(struct.pack("<8H", *range(8)))
PY
        ;;
    esac
}

cd "$here"
# Build every target once (FUZZ_NO_BUILD=1 reuses the binaries already built), then run the
# libFuzzer binaries directly.
if [ -z "${FUZZ_NO_BUILD:-}" ]; then
    cargo +nightly fuzz build
fi
bin_dir="$here/target/x86_64-unknown-linux-gnu/release"
status=0
summary=()
for target in "${targets[@]}"; do
    corpus="$here/corpus/$target"
    rm -rf "$corpus"
    mkdir -p "$corpus" "$here/artifacts/$target"
    seed "$target" "$corpus"
    log="$here/artifacts/$target.log"
    echo "== $target: ${seconds}s"
    if "$bin_dir/$target" "$corpus" -artifact_prefix="$here/artifacts/$target/" \
        -max_total_time="$seconds" -max_len=8192 -timeout=30 -rss_limit_mb=4096 \
        -print_final_stats=1 >"$log" 2>&1; then
        result="ok"
    else
        result="CRASH (see $log and fuzz/artifacts/$target/)"
        status=1
    fi
    execs="$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' | tail -1 || true)"
    summary+=("$(printf '%-20s %6ss %12s executions  %s' "$target" "$seconds" "${execs:-?}" "$result")")
done
echo
printf '%s\n' "${summary[@]}"
exit "$status"
