#!/usr/bin/env python3
"""castor vs PyTorch on one GPU, in one run: the harness of the GPU benchmarks.

    python bench/gpu/bench.py --out results/ [--castor target/release/castor]
    python bench/gpu/bench.py --out /tmp/dry --device cpu --tiny     # dry run, no GPU

Measures, in order, on one machine:
1. The machine's ceilings: device-to-device copy bandwidth (bytes read + written) and the BF16
   GEMM rate at GPT-2 shapes and at 8192^3, on random data.
2. The GPT-2 measurements castor was asked for (transformers GPT-2 124M, random init, one
   sequence of 150 tokens): forward F16 vs F32; gradient of sum(last hidden state) F16 vs F32;
   the AdamW update on F32 master weights; refreshing the F16 working copy from the masters;
   update + refresh together.
3. A training step, GPT-2 124M, B=8, T=1024, AdamW, bf16 and fp16: eager autocast + fused
   AdamW (+ GradScaler for fp16) and torch.compile: ms/step, tokens/s, MFU with
   6N + 6*L*C*T FLOPs per token over the peak (989 TF dense BF16 on an H100 SXM).
4. Memory: max_memory_allocated and step time with and without gradient checkpointing, beside
   castor's planned peak for each --remat mode (from `castor compile --train`).
5. castor's side of every row, where its CUDA executor can run (`castor ... --device cuda`):
   steady-state ms/step and tokens/s (bf16, fp16, bf16 with --remat selective, and bf16 with
   --attention fused --classifier fused --epilogues fused), the
   device time of the optimizer step, the device memory castor allocated beside its planned
   peak, and the forward at one ~150-token sequence in F32 and F16. When castor cannot run a
   row, the row says why, nothing is made up, and --require-castor makes the exit status
   non-zero.

Timing: CUDA events after warm-up, the median of --repeat runs (host timers on the CPU). Every
input is random. A readable table is printed last; everything goes to OUT/results.json.
"""

import argparse
import json
import math
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel

H100_BF16_PEAK = 989e12


class Timer:
    """Median time of a callable, in milliseconds, with CUDA events on the GPU."""

    def __init__(self, device, repeat, warmup):
        self.device, self.repeat, self.warmup = device, repeat, warmup

    def __call__(self, fn):
        for _ in range(self.warmup):
            fn()
        times = []
        for _ in range(self.repeat):
            if self.device == "cuda":
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)


def gpt2_config(tiny):
    if tiny:
        return GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=256,
                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # GPT-2 124M


def ceilings(args, timer, dev):
    n = (1 << 20) if args.tiny else (1 << 28)  # bytes of the copy: 1 MiB dry, 256 MiB real
    src = torch.rand(n // 4, device=dev)
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    copy_gbs = 2 * n / (ms * 1e-3) / 1e9
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    cfg = gpt2_config(args.tiny)
    tokens = args.batch * args.seq
    c, v = cfg.n_embd, cfg.vocab_size
    shapes = {
        "qkv": (tokens, c, 3 * c),
        "fc": (tokens, c, 4 * c),
        "proj": (tokens, 4 * c, c),
        "lm_head": (tokens, c, v),
        "8192^3": (512, 512, 512) if args.tiny else (8192, 8192, 8192),
    }
    gemm = {}
    for name, (m, k, n_) in shapes.items():
        a = torch.randn(m, k, device=dev, dtype=dtype)
        b = torch.randn(k, n_, device=dev, dtype=dtype)
        ms = timer(lambda: a @ b)
        gemm[name] = {"shape": [m, k, n_], "ms": ms, "tflops": 2 * m * k * n_ / (ms * 1e-3) / 1e12}
    return {"copy_bytes": 2 * n, "copy_gb_s": copy_gbs, "gemm": gemm, "gemm_dtype": str(dtype)}


def user_measurements(args, timer, dev):
    """The forward / gradient / AdamW / copy-refresh figures at one ~150-token sequence."""
    cfg = gpt2_config(args.tiny)
    seq = 32 if args.tiny else 150
    ids = torch.randint(0, cfg.vocab_size, (1, seq), device=dev)
    out = {}
    for name, dtype in [("f32", torch.float32), ("f16", torch.float16)]:
        if dev == "cpu" and dtype == torch.float16:
            dtype = torch.bfloat16  # CPU half matmuls are not a meaningful peer
        model = GPT2LMHeadModel(cfg).to(dev, dtype).eval()
        base = model.transformer
        with torch.no_grad():
            out[f"forward_{name}_ms"] = timer(lambda: base(input_ids=ids))

        def grad():
            base.zero_grad(set_to_none=True)
            base(input_ids=ids).last_hidden_state.float().sum().backward()

        out[f"grad_sum_hidden_{name}_ms"] = timer(grad)
    # AdamW on F32 masters, then the F16 working copy refreshed from them.
    master = GPT2LMHeadModel(cfg).to(dev).train()
    params = [p for p in master.parameters()]
    for p in params:
        p.grad = torch.randn_like(p)
    fused = dev == "cuda"
    opt = torch.optim.AdamW(params, lr=1e-4, fused=fused)
    out["adamw_ms"] = timer(opt.step)
    copies = [p.detach().to(torch.float16) for p in params]
    out["refresh_f16_ms"] = timer(lambda: torch._foreach_copy_(copies, params))

    def update_and_refresh():
        opt.step()
        torch._foreach_copy_(copies, params)

    out["adamw_plus_refresh_ms"] = timer(update_and_refresh)
    n_params = sum(p.numel() for p in params)
    out["parameters"] = n_params
    # Bytes the fused update + refresh must move: read grad, master, m, v; write master, m,
    # v and the F16 copy: 4 * 4 + 3 * 4 + 2 = 30 bytes per parameter.
    out["update_refresh_bytes"] = 30 * n_params
    out["forward_speedup_f16"] = out["forward_f32_ms"] / out["forward_f16_ms"]
    return out


def training_step(args, timer, dev):
    cfg = gpt2_config(args.tiny)
    b, t = args.batch, args.seq
    n_params_no_emb = None
    results = {}
    for precision in ["bf16", "fp16"]:
        if dev == "cpu" and precision == "fp16":
            continue  # no fp16 autocast worth timing on the CPU
        dtype = torch.bfloat16 if precision == "bf16" else torch.float16
        for mode in ["eager"] + ([] if args.skip_compile else ["compile"]):
            torch.manual_seed(0)
            model = GPT2LMHeadModel(cfg).to(dev).train()
            n = sum(p.numel() for p in model.parameters())
            n_params_no_emb = n
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=dev == "cuda")
            scaler = torch.amp.GradScaler(dev, enabled=precision == "fp16")
            ids = torch.randint(0, cfg.vocab_size, (b, t), device=dev)
            fwd = torch.compile(model) if mode == "compile" else model

            def step():
                opt.zero_grad(set_to_none=True)
                with torch.autocast(dev, dtype=dtype):
                    loss = fwd(input_ids=ids, labels=ids).loss
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()

            ms = timer(step)
            flops_per_token = 6 * n + 6 * cfg.n_layer * cfg.n_embd * t
            tokens_s = b * t / (ms * 1e-3)
            results[f"{precision}_{mode}"] = {
                "ms_per_step": ms,
                "tokens_per_s": tokens_s,
                "mfu": flops_per_token * tokens_s / H100_BF16_PEAK,
            }
            if dev == "cuda":
                torch.cuda.reset_peak_memory_stats()
                step()
                torch.cuda.synchronize()
                results[f"{precision}_{mode}"]["max_memory_allocated"] = torch.cuda.max_memory_allocated()
            del model, opt
    results["parameters"] = n_params_no_emb
    return results


def memory(args, timer, dev):
    cfg = gpt2_config(args.tiny)
    out = {}
    for mode, checkpointing in [("none", False), ("full", True)]:
        torch.manual_seed(0)
        model = GPT2LMHeadModel(cfg).to(dev).train()
        if checkpointing:
            model.gradient_checkpointing_enable()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=dev == "cuda")
        ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), device=dev)

        def step():
            opt.zero_grad(set_to_none=True)
            with torch.autocast(dev, dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()

        ms = timer(step)
        entry = {"ms_per_step": ms}
        if dev == "cuda":
            torch.cuda.reset_peak_memory_stats()
            step()
            torch.cuda.synchronize()
            entry["max_memory_allocated"] = torch.cuda.max_memory_allocated()
        out[f"pytorch_{mode}"] = entry
        del model, opt
    return out


def run(cmd):
    p = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
    return p.returncode, p.stdout, p.stderr


def median(xs):
    xs = sorted(x for x in xs if x is not None)
    return xs[len(xs) // 2] if xs else None


def castor_train(args, exe, cfg_path, corpus, out_dir, precision, remat, steps, extra=(),
                 tag=""):
    """One `castor train` run on the chosen device, timed from its JSON log: steady-state
    tokens/s (the first quarter of the steps holds NVRTC compiles and graph captures), the
    device time of the micro steps and of the optimizer step (--profile), and the device memory
    castor allocated for the plan. `extra` flags, named by `tag` in the log's file name."""
    log = out_dir / f"castor-train-{precision}-{remat}{tag}.jsonl"
    log.unlink(missing_ok=True)
    code, so, se = run([exe, "train", cfg_path, "--data", corpus, "--steps", steps,
                        "--batch", args.batch, "--seq", args.seq, "--precision", precision,
                        "--remat", remat, "--device", args.castor_device, "--log", log,
                        "--profile", *extra])
    row = {"exit": code, "stdout": so[-2000:], "stderr": se[-2000:]}
    if code != 0 or not log.exists():
        return row
    lines = [json.loads(l) for l in log.read_text().splitlines() if l.strip()]
    steady = lines[steps // 4:]
    rate = median(l["tokens_per_s"] for l in steady)
    if rate:
        row["tokens_per_s"] = rate
        row["ms_per_step"] = 1e3 * args.batch * args.seq / rate
    row["micro_steps_ms"] = median(l.get("micro_steps_ms") for l in steady)
    row["optimizer_step_ms"] = median(l.get("optimizer_step_ms") for l in steady)
    row["losses"] = [l["loss"] for l in lines]
    mem = re.search(r"^memory\s+.*\((\d+) bytes\) allocated", so, re.M)
    row["allocated_bytes"] = int(mem.group(1)) if mem else None
    return row


def castor_kernels(args, exe, cfg_path, corpus, out_dir, extra, tag):
    """`castor train --profile-kernels` for 3 bf16 steps: the printed table of the kinds of
    command that took the most device time in the last one; every command goes to
    OUT/castor-kernels-bf16<tag>.csv."""
    csv = out_dir / f"castor-kernels-bf16{tag}.csv"
    code, so, se = run([exe, "train", cfg_path, "--data", corpus, "--steps", 3, "--batch",
                        args.batch, "--seq", args.seq, "--precision", "bf16", "--device",
                        args.castor_device, "--profile-kernels", csv, *extra])
    lines = so.splitlines()
    start = next((i for i, l in enumerate(lines) if l.startswith("kernels ")), None)
    table = [] if start is None else [l for l in lines[start:] if not l.startswith("profile ")]
    return {"exit": code, "table": table, "stderr": se[-2000:]}


def castor_forward(args, exe, out_dir, precision):
    """`castor eval --repeat` on a random GPT-2 checkpoint, one ~150-token sequence: the median
    forward time, as the user measured it."""
    from safetensors.torch import save_file

    model_dir = out_dir / "gpt2-random"
    if not (model_dir / "config.json").exists():
        torch.manual_seed(0)
        GPT2LMHeadModel(gpt2_config(args.tiny)).save_pretrained(model_dir, safe_serialization=True)
    seq = 32 if args.tiny else 150
    batch = out_dir / "forward-input.safetensors"
    save_file({"input_ids": torch.randint(0, gpt2_config(args.tiny).vocab_size, (1, seq))}, batch)
    code, so, se = run([exe, "eval", model_dir, "--input", batch, "--out",
                        out_dir / f"forward-{precision}.safetensors", "--precision", precision,
                        "--device", args.castor_device, "--repeat", 5 if args.tiny else 30])
    row = {"exit": code, "stderr": se[-2000:]}
    m = re.search(r": ([\d.]+) ms \(median", so + se)
    if code == 0 and m:
        row["ms"] = float(m.group(1))
    return row


# (result tag, table label, flags) of the fused castor rows.
FUSED_VARIANTS = [
    ("_fused", "fused attn+cls+epilogues",
     ["--attention", "fused", "--classifier", "fused", "--epilogues", "fused"]),
    ("_cls_epi", "fused cls+epilogues     ", ["--classifier", "fused", "--epilogues", "fused"]),
]


def castor_side(args, out_dir):
    """castor's rows: the compile-time plan (works anywhere) and the runs on the device."""
    res = {}
    exe = str(args.castor)
    cfg_path = out_dir / "gpt2-config.json"
    cfg = gpt2_config(args.tiny).to_dict()
    cfg["architectures"] = ["GPT2LMHeadModel"]
    cfg_path.write_text(json.dumps(cfg))
    for remat in ["none", "selective", "full"]:
        code, so, se = run([exe, "compile", cfg_path, "--train", "--precision", "bf16",
                            "--batch", args.batch, "--seq", args.seq, "--remat", remat])
        peak = re.search(r"^\s*total\s+([\d,]+)\s", so, re.M) if code == 0 else None
        res[f"planned_peak_{remat}"] = int(peak.group(1).replace(",", "")) if peak else None
        res[f"planned_{remat}_exit"] = code
        if remat == "none":
            res["compile_train_bf16"] = {"exit": code, "stdout": so, "stderr": se[-2000:]}
        if code != 0:
            res[f"planned_{remat}_stderr"] = se[-500:]
    # The config has GPT-2's vocabulary and no tokenizer files, so the text goes in as token
    # ids: its bytes as nanoGPT's raw u16 tokens (castor reads text as bytes only for a
    # 256-token vocabulary).
    corpus = out_dir / "corpus.bin"
    text = ("castor trains transformers in mixed precision. " * 20000).encode()
    corpus.write_bytes(b"".join(b.to_bytes(2, "little") for b in text))
    steps = 8 if args.tiny else 40
    for precision, remat in [("bf16", "none"), ("fp16", "none"), ("bf16", "selective")]:
        res[f"train_{precision}_{remat}"] = castor_train(args, exe, cfg_path, corpus, out_dir,
                                                         precision, remat, steps)
    # The fused kernels (flash attention, the chunked classifier, cuBLASLt epilogues), not
    # yet the defaults: all three, and the classifier and epilogues with eager attention.
    for tag, _, extra in FUSED_VARIANTS:
        res[f"train_bf16{tag}"] = castor_train(args, exe, cfg_path, corpus, out_dir, "bf16",
                                               "none", steps, extra, tag.replace("_", "-"))
    # Where the device time of a bf16 step goes, command by command (a GPU clock only).
    if args.castor_device == "cuda":
        for tag, extra in [("", [])] + [(t, e) for t, _, e in FUSED_VARIANTS]:
            res[f"kernels_bf16{tag}"] = castor_kernels(args, exe, cfg_path, corpus, out_dir,
                                                       extra, tag)
    for precision in ["fp32", "fp16"]:
        res[f"forward_{precision}"] = castor_forward(args, exe, out_dir, precision)
    return res


def castor_failures(results):
    """The castor rows that did not run (for --require-castor)."""
    c = results.get("castor", {})
    if "unavailable" in c:
        return [c["unavailable"]]
    bad = []
    for k, v in c.items():
        if isinstance(v, dict) and v.get("exit", 0) != 0:
            bad.append(f"{k}: exit {v['exit']}: {(v.get('stderr') or '').strip()[-300:]}")
        elif k.startswith("planned_") and k.endswith("_exit") and v != 0:
            bad.append(f"{k}: {v}")
    return bad


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes: a dry run of the harness")
    ap.add_argument("--castor", type=Path, default=Path("target/release/castor"))
    ap.add_argument("--castor-device", default="cuda",
                    help="where castor trains (cpu exercises the harness on a machine with no GPU)")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--repeat", type=int, default=None)
    ap.add_argument("--skip-compile", action="store_true", help="no torch.compile rows")
    ap.add_argument("--require-castor", action="store_true",
                    help="exit non-zero when any of castor's rows fails to run")
    args = ap.parse_args()
    args.batch = args.batch or (2 if args.tiny else 8)
    args.seq = args.seq or (64 if args.tiny else 1024)
    repeat = args.repeat or (5 if args.tiny else 20)
    args.out.mkdir(parents=True, exist_ok=True)
    dev = args.device
    timer = Timer(dev, repeat, warmup=2 if args.tiny else 5)
    torch.manual_seed(0)

    results = {
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name() if dev == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.version.cuda,
        "conditions": {"tiny": args.tiny, "batch": args.batch, "seq": args.seq,
                       "repeat": repeat, "device": dev},
    }
    sections = [("ceilings", ceilings), ("gpt2_user", user_measurements),
                ("training_step", training_step), ("memory", memory)]
    for name, fn in sections:
        print(f"[{name}] ...", file=sys.stderr, flush=True)
        results[name] = fn(args, timer, dev)
    print("[castor] ...", file=sys.stderr, flush=True)
    results["castor"] = castor_side(args, args.out) if args.castor.exists() else {
        "unavailable": f"{args.castor} not found (cargo build --release)"}
    (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")

    c, u, t, m = (results[k] for k in ["ceilings", "gpt2_user", "training_step", "memory"])
    cs = results["castor"]
    lines = [
        f"device {results['device']}, torch {results['torch']}, {results['date']}"
        + (" (DRY RUN: tiny shapes)" if args.tiny else ""),
        f"copy bandwidth            {c['copy_gb_s']:10.1f} GB/s (read + write)",
    ]
    for name, g in c["gemm"].items():
        lines.append(f"GEMM {name:<20} {g['tflops']:10.2f} TFLOP/s  {g['shape']}")
    fwd = {p: cs.get(f"forward_{p}", {}).get("ms") for p in ["fp32", "fp16"]}
    fmt = lambda x, unit="ms": f"{x:8.2f} {unit}" if isinstance(x, (int, float)) else f"{'n/a':>8} {unit}"
    lines += [
        "",
        "one ~150-token sequence           PyTorch            castor",
        f"forward f32                  {fmt(u['forward_f32_ms'])}     {fmt(fwd['fp32'])}",
        f"forward f16                  {fmt(u['forward_f16_ms'])}     {fmt(fwd['fp16'])}",
        f"grad sum(hidden) f32 / f16   {u['grad_sum_hidden_f32_ms']:8.2f} / {u['grad_sum_hidden_f16_ms']:.2f} ms",
        f"AdamW on F32 masters         {fmt(u['adamw_ms'])}",
        f"F16 copy refresh             {fmt(u['refresh_f16_ms'])}",
        f"AdamW + refresh              {fmt(u['adamw_plus_refresh_ms'])}  "
        f"({u['update_refresh_bytes'] / (u['adamw_plus_refresh_ms'] * 1e-3) / 1e9:.1f} GB/s of "
        f"{c['copy_gb_s']:.1f})",
    ]
    n = t.get("parameters") or 0
    cfg = gpt2_config(args.tiny)
    flops_per_token = 6 * n + 6 * cfg.n_layer * cfg.n_embd * args.seq
    lines += ["", f"training step, GPT-2 B={args.batch} T={args.seq}   ms/step   tokens/s    MFU   vs compile"]
    for precision in ["bf16", "fp16"]:
        comp = t.get(f"{precision}_compile", {}).get("tokens_per_s")
        for mode in ["eager", "compile"]:
            v = t.get(f"{precision}_{mode}")
            if isinstance(v, dict):
                lines.append(f"PyTorch {mode:<8} {precision}          {v['ms_per_step']:8.2f}  {v['tokens_per_s']:9.0f}  "
                             f"{100 * v['mfu']:5.1f}%  {v['tokens_per_s'] / comp if comp else float('nan'):6.2f}x")
        r = cs.get(f"train_{precision}_none", {})
        if "tokens_per_s" in r:
            mfu = flops_per_token * r["tokens_per_s"] / H100_BF16_PEAK
            lines.append(f"castor {args.castor_device:<9} {precision}          {r['ms_per_step']:8.2f}  "
                         f"{r['tokens_per_s']:9.0f}  {100 * mfu:5.1f}%  "
                         f"{r['tokens_per_s'] / comp if comp else float('nan'):6.2f}x")
        else:
            lines.append(f"castor {args.castor_device:<9} {precision}          "
                         + ((r.get("stderr") or "").strip().splitlines() or ["did not run"])[-1])
    for tag, label, _ in FUSED_VARIANTS:
        fused = cs.get(f"train_bf16{tag}", {})
        if "tokens_per_s" in fused:
            mfu = flops_per_token * fused["tokens_per_s"] / H100_BF16_PEAK
            comp = t.get("bf16_compile", {}).get("tokens_per_s")
            lines.append(f"castor {label}  {fused['ms_per_step']:8.2f}  "
                         f"{fused['tokens_per_s']:9.0f}  {100 * mfu:5.1f}%  "
                         f"{fused['tokens_per_s'] / comp if comp else float('nan'):6.2f}x")
        elif fused:
            lines.append(f"castor {label}  "
                         + ((fused.get("stderr") or "").strip().splitlines() or ["did not run"])[-1])
    none, sel = cs.get("train_bf16_none", {}), cs.get("train_bf16_selective", {})
    if "ms_per_step" in none and "ms_per_step" in sel:
        lines.append(f"castor --remat selective bf16    {sel['ms_per_step']:8.2f} ms/step "
                     f"({100 * (sel['ms_per_step'] / none['ms_per_step'] - 1):+.1f}% over none)")
    opt = none.get("optimizer_step_ms")
    if opt:
        lines.append(f"castor optimizer step (AdamW + bf16 copies, device time) {opt:8.2f} ms vs PyTorch "
                     f"AdamW + refresh {u['adamw_plus_refresh_ms']:.2f} ms")
    lines.append("")
    for k, v in m.items():
        mem = v.get("max_memory_allocated")
        lines.append(f"PyTorch memory {k:<10} {v['ms_per_step']:8.2f} ms/step  max allocated {mem if mem is not None else 'n/a'}")
    for remat in ["none", "selective", "full"]:
        lines.append(f"castor planned peak {remat:<9} {cs.get(f'planned_peak_{remat}')}")
    for key in ["train_bf16_none", "train_bf16_selective"]:
        alloc = cs.get(key, {}).get("allocated_bytes")
        planned = cs.get(f"planned_peak_{key.rsplit('_', 1)[1]}")
        if alloc and planned:
            lines.append(f"castor {key}: allocated {alloc} vs planned {planned} "
                         f"({100 * (alloc / planned - 1):+.1f}%)")
    for key, title in [("kernels_bf16", "castor bf16 step, kernel by kernel")] + [
            (f"kernels_bf16{tag}", f"castor bf16 {label.strip()} step, kernel by kernel")
            for tag, label, _ in FUSED_VARIANTS]:
        k = cs.get(key)
        if k:
            lines += ["", title] + (k["table"] or [((k.get("stderr") or "").strip().splitlines()
                                                     or ["did not run"])[-1]])
    table = "\n".join(lines)
    (args.out / "table.txt").write_text(table + "\n")
    print(table)
    failures = castor_failures(results)
    if args.require_castor and failures:
        print("castor rows failed:\n  " + "\n  ".join(failures), file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
