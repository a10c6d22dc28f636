#!/usr/bin/env python3
"""Benchmark: castor's CPU executor forward vs PyTorch CPU F32, side by side, same machine.

Makes a randomly initialised GPT-2 (124M config by default) with transformers, saves it as a
checkpoint, runs the same batch through PyTorch (eager attention, no_grad, eval mode) and
through `castor eval --repeat N`, checks that the outputs agree, and prints a table of the
median times and their ratio. Full results go to a JSON file.

    cargo build --release
    python bench/cpu_forward.py [--batch 1] [--seq 128] [--reps 7] [--json out.json]

Needs torch + transformers (not needed by the tests).
"""

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import transformers
from safetensors.torch import load_file, save_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--json", default=None, help="write full results here")
    ap.add_argument("--castor", default=os.path.join(ROOT, "target", "release", "castor"))
    args = ap.parse_args()

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=args.layers)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    model.config._attn_implementation = "eager"
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), dtype=torch.int64)
    mask = torch.ones_like(ids)

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = os.path.join(tmp, "gpt2")
        model.save_pretrained(ckpt, safe_serialization=True)
        inp = os.path.join(tmp, "input.safetensors")
        out = os.path.join(tmp, "out.safetensors")
        save_file({"input_ids": ids, "attention_mask": mask}, inp)

        times = []
        with torch.no_grad():
            ref = model(input_ids=ids, attention_mask=mask).logits  # warm-up
            for _ in range(args.reps):
                t0 = time.perf_counter()
                ref = model(input_ids=ids, attention_mask=mask).logits
                times.append(time.perf_counter() - t0)
        torch_ms = statistics.median(times) * 1e3

        cmd = [args.castor, "eval", ckpt, "--input", inp, "--out", out, "--device", "cpu",
               "--repeat", str(args.reps)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"castor failed ({proc.returncode}):\n{proc.stderr}")
        m = re.search(r"([0-9.]+) ms \(median of", proc.stdout)
        castor_ms = float(m.group(1))
        got = load_file(out)["logits"]
        rel = ((got - ref).norm() / ref.norm()).item()

    n_params = model.num_parameters()
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "model": f"GPT-2 {n_params / 1e6:.0f}M ({args.layers} layers), random init",
        "batch": args.batch,
        "seq": args.seq,
        "reps": args.reps,
        "torch_ms": torch_ms,
        "castor_ms": castor_ms,
        "castor_over_torch": castor_ms / torch_ms,
        "rel_error_logits": rel,
    }
    print()
    print(f"CPU forward, {result['model']}, batch {args.batch} x seq {args.seq}, "
          f"median of {args.reps}, {result['machine']}")
    print(f"{'':10} {'ms':>10}")
    print(f"{'pytorch':10} {torch_ms:10.1f}")
    print(f"{'castor':10} {castor_ms:10.1f}")
    print(f"castor/pytorch time ratio {castor_ms / torch_ms:.2f} (lower is better); "
          f"logits relative error {rel:.2e}")
    print("RESULT " + json.dumps(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
