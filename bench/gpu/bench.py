#!/usr/bin/env python3
"""castor against PyTorch on one GPU, side by side in one run: the benchmark record.

    python3 bench/gpu/bench.py --out OUT [--castor gpu-pack/castor] [--recipe-log LOG]
    python3 bench/gpu/bench.py --out OUT --dry-run     # tiny shapes, castor on the CPU
    python3 bench/gpu/bench.py --out OUT --warm-compile  # only fill torch.compile's caches

Writes OUT/<date>-<card>.json, the benchmark record (its format: bench/record.py; commit it
under bench/results/ and run `python3 bench/record.py render`), OUT/table.txt (the same rows,
readable), and the castor runs' logs and kernel profile under OUT/runs/.

The configurations, in the order they run (the most wanted first, so that a time budget cuts
the least wanted):

1. GPT-2 124M, B=8, T=1024, bf16, AdamW: castor's defaults against `torch.compile`
   (transformers' GPT2LMHeadModel with SDPA attention, autocast, fused AdamW).
2. LLaMA-3.2-1B's shape (assets/configs/llama-3.2-1b.json), B=4, T=2048, bf16, AdamW:
   castor's defaults against `torch.compile` on LlamaForCausalLM (SDPA), then eager.
3. LoRA on it, rank 16 on q, k, v, o, gate, up and down: castor against PEFT (a BF16 base,
   F32 adapters, autocast).
4. One step of the LLaMA-2-7B recipe in docs/commands.md (castor), read from the log of the GPU check's
   tests part (--recipe-log) or run here.
5. The kernel profile of castor's default GPT-2 step: calls, device ms and the program
   roofline's ms per kind of command.
6. castor's other attentions on GPT-2: `--attention eager` (the default before 2026-11-27)
   and `--attention fused` (castor's kernels without cuDNN).
7. PyTorch eager on GPT-2 and LLaMA, and castor's other attentions on LLaMA.
8. castor's LLaMA-3.2-1B step under `--precision fp8` and `fp8:delayed` (group `fp8`), beside
   the bf16 row of 2. (MFU against the card's BF16 peak, as every row).

Every model starts from random weights and every token is random: speed does not depend on
them. PyTorch is timed with CUDA events after warm-up (the median of --repeat steps; host
timers on the CPU); castor from its JSON log (the median tokens/s of the steps after the
first quarter, which hold the NVRTC compiles and graph captures). MFU is model FLOPs (6N +
6LCT per token for training, 4N + 6N_adapters + 6LCT for LoRA, whose base gets no weight
gradient) over the card's dense BF16 peak, as `castor compile` states it. torch,
transformers and PEFT are optional: a row whose library is missing says so and has no
numbers, so the dry run needs only castor and the standard library.
"""

import argparse
import csv
import ctypes
import json
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import record as record_format  # noqa: E402

try:
    import torch
except ImportError:
    torch = None

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

# A LLaMA small enough for the dry run, with the 1B shape's features (GQA, tied embeddings).
TINY_LLAMA = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 256,
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "hidden_act": "silu",
    "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "initializer_range": 0.02, "tie_word_embeddings": True,
}


class Bench:
    """The run's settings, its deadline, and the record it fills row by row (written after
    every row, so that a run cut short still leaves what it measured)."""

    def __init__(self, args):
        self.args = args
        self.out = args.out
        # The castor runs' logs, configs and token files, apart from the record.
        self.runs = args.out / "runs"
        self.runs.mkdir(parents=True, exist_ok=True)
        self.deadline = time.monotonic() + args.budget if args.budget else None
        self.dry = args.dry_run
        self.dev = "cuda" if not self.dry and torch is not None and torch.cuda.is_available() else "cpu"
        self.record = {
            "date": time.strftime("%Y-%m-%d"),
            "device": device_name(self.dev),
            "castor_commit": castor_commit(),
            "versions": versions(),
            "torch_compile_sdpa": "not measured",
            "dry_run": self.dry,
            "conditions": {
                "castor_device": args.castor_device, "repeat": args.repeat,
                "castor_steps": args.steps,
            },
            "rows": [],
            "profile": {},
        }
        card = record_format.card_slug(self.record["device"])
        self.path = self.out / f"{self.record['date']}-{'dry-run-' if self.dry else ''}{card}.json"

    def time_left(self):
        return self.deadline is None or time.monotonic() < self.deadline

    def add(self, row):
        self.record["rows"].append(row)
        self.save()
        shown = f"{row['ms_per_step']:.2f} ms/step" if row.get("ms_per_step") else row.get("note")
        print(f"[bench] {row['model']} {row['shape']} {row['system']} {row['flags']}: {shown}",
              file=sys.stderr, flush=True)

    def save(self):
        self.out.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.record, indent=1) + "\n")


def device_name(dev):
    if dev == "cuda":
        return torch.cuda.get_device_name()
    return f"CPU ({platform.machine() or 'unknown'})"


def castor_commit():
    """The commit the castor binary was built from: gpu-pack/COMMIT (bench/gpu/pack.sh writes
    it; the GPU machine has no git), else the checkout's HEAD."""
    pack = ROOT / "gpu-pack" / "COMMIT"
    if pack.exists():
        return pack.read_text().strip()
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short=12", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain",
                                "--untracked-files=no"], capture_output=True, text=True).stdout
        return head + ("-dirty" if dirty.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def cublas_version():
    """cuBLAS's version from the library itself (cublasGetProperty: major, minor, patch)."""
    for name in ("libcublas.so.13", "libcublas.so.12", "libcublas.so"):
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        parts = []
        for prop in range(3):
            v = ctypes.c_int(0)
            if lib.cublasGetProperty(prop, ctypes.byref(v)) != 0:
                return f"{name} (version unreadable)"
            parts.append(str(v.value))
        return ".".join(parts)
    return "not found"


def versions():
    if torch is None:
        return {"torch": "not installed", "cuda": "n/a", "cublas": cublas_version(),
                "cudnn": "n/a", "transformers": "n/a", "peft": "n/a"}
    out = {"torch": torch.__version__, "cuda": torch.version.cuda or "n/a (CPU build)",
           "cublas": cublas_version() if torch.cuda.is_available() else "n/a",
           "cudnn": str(torch.backends.cudnn.version() or "n/a")}
    for lib in ("transformers", "peft"):
        try:
            out[lib] = __import__(lib).__version__
        except ImportError:
            out[lib] = "not installed"
    return out


# --- the configurations -------------------------------------------------------------------


class Config:
    """One measured configuration: a model config file, its shape and what castor is told."""

    def __init__(self, model, path, batch, seq, optimizer="adamw", lora=None, castor_flags=(),
                 family="gpt2"):
        self.model, self.path, self.batch, self.seq = model, path, batch, seq
        self.optimizer, self.lora, self.family = optimizer, lora, family
        self.castor_flags = list(castor_flags)
        self.shape = f"B{batch}xT{seq}"

    def json(self):
        return json.loads(Path(self.path).read_text())

    def lora_flags(self):
        if not self.lora:
            return []
        return ["--lora-rank", str(self.lora), "--lora-targets", ",".join(LORA_TARGETS)]


def configurations(bench):
    """(GPT-2, LLaMA, LoRA) at the benchmark's shapes, or tiny ones for the dry run."""
    if bench.dry:
        tiny_llama = bench.runs / "tiny-llama.json"
        tiny_llama.write_text(json.dumps(TINY_LLAMA))
        return (Config("GPT-2 (tiny)", ROOT / "assets/tiny-gpt2.json", 2, 64),
                Config("LLaMA (tiny)", tiny_llama, 2, 64, family="llama"),
                Config("LLaMA (tiny) LoRA r16", tiny_llama, 2, 64, lora=16, family="llama"))
    llama = ROOT / "assets/configs/llama-3.2-1b.json"
    return (Config("GPT-2 124M", ROOT / "assets/configs/gpt2-124m.json", 8, 1024),
            Config("LLaMA-3.2-1B", llama, 4, 2048, family="llama"),
            Config("LLaMA-3.2-1B LoRA r16", llama, 4, 2048, lora=16, family="llama"))


def row(cfg, system, flags="", precision="bf16", **measured):
    r = {"model": cfg.model, "shape": cfg.shape, "precision": precision,
         "optimizer": cfg.optimizer, "system": system, "flags": flags,
         "ms_per_step": None, "tokens_per_s": None, "mfu": None}
    r.update(measured)
    return r


# --- castor ---------------------------------------------------------------------------------


def run(cmd, timeout=None):
    try:
        p = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout)
        return p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:
        return "timeout", e.stdout or "", e.stderr or ""


def last_line(text):
    lines = [l for l in (text or "").strip().splitlines() if l.strip()]
    return lines[-1][-300:] if lines else "no output"


def split_precision(flags):
    """(the precision a row's flags name, bf16 unless they do; the other flags)."""
    flags = list(flags)
    if "--precision" in flags:
        i = flags.index("--precision")
        precision = flags[i + 1]
        del flags[i:i + 2]
        return precision, flags
    return "bf16", flags


class Plan:
    """What `castor compile --train` says of a configuration: parameters, model FLOPs per
    token, the program roofline on the card, the planned peak and the card's BF16 peak (the
    MFU of an FP8 row is against it too, so rows compare)."""

    def __init__(self, bench, cfg, flags):
        precision, flags = split_precision(flags)
        # --unpadded: the plan `castor train` runs on the benchmark's token file, which reads
        # no attention mask.
        cmd = [bench.args.castor, "compile", cfg.path, "--train", "--precision", precision,
               "--batch", cfg.batch, "--seq", cfg.seq, "--optimizer", cfg.optimizer,
               "--unpadded", *cfg.lora_flags(), *flags]
        gpu = castor_gpu(bench.record["device"])
        if gpu:
            cmd += ["--gpu", gpu]
        code, so, se = run(cmd, timeout=300)
        self.error = None if code == 0 else f"castor compile: exit {code}: {last_line(se)}"
        num = lambda pattern: (lambda m: float(m.group(1).replace(",", "")) if m else None)(
            re.search(pattern, so, re.M))
        self.params = num(r"\(N ([\d,]+),")
        layers, width = num(r"\bL (\d+), C"), num(r"\bC (\d+), T")
        self.roofline_ms = num(r"program roofline ([\d.]+) ms per step")
        self.planned_bytes = num(r"^\s*total\s+([\d,]+)\s")
        self.peak_flops = (num(r"target GPU\s+.*?: ([\d.]+) TFLOP/s bf16") or 0) * 1e12 or None
        adapters = num(r"([\d,]+) adapter parameters")
        self.flops_per_token = None
        if self.params and layers and width:
            attention = 6 * layers * width * cfg.seq
            if adapters:
                self.flops_per_token = 4 * (self.params - adapters) + 6 * adapters + attention
            else:
                self.flops_per_token = 6 * self.params + attention

    def mfu(self, tokens_per_s):
        if tokens_per_s and self.flops_per_token and self.peak_flops:
            return self.flops_per_token * tokens_per_s / self.peak_flops
        return None


def castor_gpu(device):
    """castor's `--gpu` name for the card the benchmark runs on, if it is one castor knows."""
    for name in ("H200", "H100", "A100", "L40S", "RTX 4090"):
        if name.lower() in device.lower():
            return name.lower().replace(" ", "")
    return None


def token_file(bench, vocab):
    """nanoGPT's raw u16 token file of random ids: the configs have no tokenizer beside them."""
    path = bench.runs / f"tokens-{vocab}.bin"
    if not path.exists():
        import random

        rng = random.Random(0)
        top = min(vocab, 1 << 16)
        path.write_bytes(b"".join(rng.randrange(top).to_bytes(2, "little")
                                  for _ in range(1 << 18)))
    return path


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def castor_train(bench, cfg, flags, tag):
    """One castor row: `castor train` on the configuration for --steps steps, timed from its
    JSON log, beside the plan's roofline and planned peak."""
    plan = Plan(bench, cfg, flags) if bench.time_left() else None
    precision, flags = split_precision(flags)
    shown = " ".join(cfg.lora_flags() + flags)
    if plan is None:
        return row(cfg, "castor", shown, precision,
                   note="not run: the benchmark's time budget ran out")
    if plan.error:
        return row(cfg, "castor", shown, precision, note=plan.error)
    log = bench.runs / f"castor-{tag}.jsonl"
    log.unlink(missing_ok=True)
    steps = bench.args.steps
    cmd = [bench.args.castor, "train", cfg.path, "--data", token_file(bench, cfg.json()["vocab_size"]),
           "--steps", steps, "--batch", cfg.batch, "--seq", cfg.seq, "--precision", precision,
           "--optimizer", cfg.optimizer, "--device", bench.args.castor_device, "--log", log,
           "--profile", *cfg.lora_flags(), *flags]
    code, so, se = run(cmd, timeout=600)
    (bench.runs / f"castor-{tag}.out").write_text(f"$ {' '.join(map(str, cmd))}\n{so}\n{se}")
    if code != 0 or not log.exists():
        return row(cfg, "castor", shown, precision,
                   note=f"castor train: exit {code}: {last_line(se)}")
    return castor_row_from_log(cfg, shown, log, plan, bench.args.castor_device == "cuda", so,
                               precision=precision)


def castor_row_from_log(cfg, flags, log, plan, on_gpu, stdout="", steady_from=None,
                        precision="bf16"):
    lines = [json.loads(l) for l in log.read_text().splitlines() if l.strip()]
    lines = [l for l in lines if "tokens_per_s" in l]
    if not lines:
        return row(cfg, "castor", flags, precision, note=f"{log.name} has no timed step")
    steady = lines[len(lines) // 4 if steady_from is None else steady_from:] or lines[-1:]
    rate = median(l["tokens_per_s"] for l in steady)
    ms = 1e3 * cfg.batch * cfg.seq / rate if rate else None
    mem = re.search(r"^memory\s+.*\((\d+) bytes\) allocated", stdout, re.M)
    # What ran the fused attention (cuDNN and which engines, or castor's kernels and why):
    # a record once credited castor's kernels' time to cuDNN for want of it.
    attention = re.search(r"^attention\s+(.+)$", stdout, re.M)
    return row(cfg, "castor", flags, precision, ms_per_step=ms, tokens_per_s=rate,
               attention=attention.group(1).strip() if attention else None,
               mfu=plan.mfu(rate),
               roofline_ms=plan.roofline_ms,
               # The roofline is the card's: a step on the CPU is not measured against it.
               x_roofline=ms / plan.roofline_ms if ms and plan.roofline_ms and on_gpu else None,
               micro_steps_ms=median(l.get("micro_steps_ms") for l in steady),
               optimizer_step_ms=median(l.get("optimizer_step_ms") for l in steady),
               planned_bytes=plan.planned_bytes,
               allocated_bytes=int(mem.group(1)) if mem else None,
               steps_timed=len(steady))


# The 7B fine-tuning recipe of docs/commands.md (bench/gpu/check.py's tests part runs it too).
RECIPE_FLAGS = ["--remat", "selective", "--update-in-backward"]


def recipe_row(bench):
    cfg = Config("LLaMA-2-7B recipe", ROOT / "assets/configs/llama-2-7b.json", 1, 4096,
                 optimizer="adafactor", family="llama")
    flags = " ".join(RECIPE_FLAGS)
    if bench.dry:
        return row(cfg, "castor", flags, note="not run in a dry run: a GPU step")
    plan = Plan(bench, cfg, RECIPE_FLAGS)
    if plan.error:
        return row(cfg, "castor", flags, note=plan.error)
    log = bench.args.recipe_log
    if log is None or not log.exists():
        if not bench.time_left():
            return row(cfg, "castor", flags, note="not run: the benchmark's time budget ran out")
        log = bench.runs / "castor-llama-7b.jsonl"
        code, so, se = run([bench.args.castor, "train", cfg.path, "--data",
                            token_file(bench, 32000), "--steps", 3, "--batch", 1, "--seq", 4096,
                            "--precision", "bf16", "--optimizer", "adafactor", "--device",
                            bench.args.castor_device, "--log", log, *RECIPE_FLAGS], timeout=300)
        if code != 0:
            return row(cfg, "castor", flags, note=f"castor train: exit {code}: {last_line(se)}")
    # Its first step holds the compiles and the graph capture: the steps after it are timed.
    return castor_row_from_log(cfg, flags, log, plan, True, steady_from=1)


def castor_profile(bench, cfg):
    """The default GPT-2 step kernel by kernel (`--profile-kernels`: a GPU clock only), each
    kind beside the program roofline's time for it."""
    if bench.args.castor_device != "cuda":
        return {"plan": f"{cfg.model} {cfg.shape} bf16 AdamW, castor's defaults",
                "note": "no device clock: castor's kernel profile needs a GPU", "kinds": []}
    if not bench.time_left():
        return {"note": "not run: the benchmark's time budget ran out", "kinds": []}
    path = bench.runs / "castor-kernels-default.csv"
    code, so, se = run([bench.args.castor, "train", cfg.path, "--data",
                        token_file(bench, cfg.json()["vocab_size"]), "--steps", 3, "--batch",
                        cfg.batch, "--seq", cfg.seq, "--precision", "bf16", "--device", "cuda",
                        "--profile-kernels", path], timeout=300)
    (bench.runs / "castor-kernels-default.out").write_text(so + se)
    if code != 0 or not path.exists():
        return {"note": f"castor train --profile-kernels: exit {code}: {last_line(se)}",
                "kinds": []}
    return {"plan": f"{cfg.model} {cfg.shape} bf16 AdamW, castor's defaults",
            **kinds_of_profile(path)}


def kinds_of_profile(path):
    """The per-command CSV summed by kind: calls, device ms, roofline ms and their ratio, the
    most time first."""
    kinds = {}
    with open(path, newline="") as f:
        for c in csv.DictReader(f):
            k = kinds.setdefault(c["what"], {"kind": c["what"], "calls": 0, "ms": 0.0,
                                             "roofline_ms": 0.0})
            k["calls"] += 1
            k["ms"] += float(c["ms"])
            if c.get("roofline_ms"):
                k["roofline_ms"] += float(c["roofline_ms"])
            else:
                k["roofline_ms"] = None
    out = sorted(kinds.values(), key=lambda k: (-k["ms"], k["kind"]))
    for k in out:
        k["ratio"] = k["ms"] / k["roofline_ms"] if k["roofline_ms"] else None
    total = sum(k["ms"] for k in out)
    roof = sum(k["roofline_ms"] or 0 for k in out)
    return {"total_ms": total, "roofline_ms": roof, "kinds": out}


# --- PyTorch --------------------------------------------------------------------------------


class Timer:
    """Median time of a callable in milliseconds: CUDA events on the GPU, host clock on the CPU."""

    def __init__(self, dev, repeat, warmup):
        self.dev, self.repeat, self.warmup = dev, repeat, warmup

    def __call__(self, fn):
        for _ in range(self.warmup):
            fn()
        times = []
        for _ in range(self.repeat):
            if self.dev == "cuda":
                start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
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


def torch_model(cfg, dev, dtype):
    """transformers' model for the configuration, random weights, SDPA attention, no dropout
    (castor's plans have none)."""
    import transformers

    d = cfg.json()
    d.pop("architectures", None)
    for k in ("resid_pdrop", "embd_pdrop", "attn_pdrop", "attention_dropout"):
        d[k] = 0.0
    config = transformers.AutoConfig.for_model(**d)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa",
                                                          torch_dtype=dtype)
    return model.to(dev).train()


def torch_row(bench, cfg, system, plan, timer):
    """`torch eager`, `torch.compile` or `peft` on the configuration: one training step is
    zero_grad, the forward and loss under bf16 autocast, backward, fused AdamW."""
    if torch is None:
        return row(cfg, system, note="torch is not installed"), None
    if not bench.time_left():
        return row(cfg, system, note="not run: the benchmark's time budget ran out"), None
    dev = bench.dev
    try:
        if system == "peft":
            try:
                import peft  # noqa: F401
            except ImportError:
                return row(cfg, system, note="peft is not installed"), None
        step = torch_step(cfg, system, dev)
        ms = timer(step)
        sdpa = sdpa_backend(step, dev) if system == "torch.compile" else None
        rate = cfg.batch * cfg.seq / (ms * 1e-3)
        measured = {"ms_per_step": ms, "tokens_per_s": rate, "mfu": plan.mfu(rate)}
        if dev == "cuda":
            torch.cuda.reset_peak_memory_stats()
            step()
            torch.cuda.synchronize()
            measured["max_memory_allocated"] = torch.cuda.max_memory_allocated()
        del step
        if dev == "cuda":
            torch.cuda.empty_cache()
        return row(cfg, system, **measured), sdpa
    except Exception as e:  # a failed peer is a row that says why, not a lost benchmark
        return row(cfg, system, note=f"{type(e).__name__}: {str(e).strip()[:300]}"), None


def torch_step(cfg, system, dev):
    """One training step of `system` on the configuration, as a callable: zero_grad, the
    forward and loss under bf16 autocast, backward, fused AdamW."""
    torch.manual_seed(0)
    if system == "peft":
        import peft

        base = torch_model(cfg, dev, torch.bfloat16)
        model = peft.get_peft_model(base, peft.LoraConfig(
            r=cfg.lora, lora_alpha=cfg.lora, lora_dropout=0.0, target_modules=LORA_TARGETS))
    else:
        model = torch_model(cfg, dev, torch.float32)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, fused=dev == "cuda")
    vocab = cfg.json()["vocab_size"]
    ids = torch.randint(0, vocab, (cfg.batch, cfg.seq), device=dev)
    fwd = torch.compile(model) if system == "torch.compile" else model

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast(dev, dtype=torch.bfloat16):
            loss = fwd(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()

    return step


def warm_compile(bench, cfgs):
    """Compiles the `torch.compile` rows' steps once, into Inductor's on-disk caches (the FX
    graph and AOTAutograd caches, per user under the system's temporary folder unless
    TORCHINDUCTOR_CACHE_DIR says otherwise), so that a benchmark run after it on this machine
    reads them instead of compiling: the GPU check runs this beside its tests. Nothing is
    timed or recorded."""
    if torch is None:
        sys.exit("--warm-compile: torch is not installed")
    for cfg in cfgs:
        t0 = time.monotonic()
        step = torch_step(cfg, "torch.compile", bench.dev)
        step()
        step()
        if bench.dev == "cuda":
            torch.cuda.synchronize()
        del step
        if bench.dev == "cuda":
            torch.cuda.empty_cache()
        print(f"[warm-compile] {cfg.model} {cfg.shape}: {time.monotonic() - t0:.0f} s",
              file=sys.stderr, flush=True)


def sdpa_backend(step, dev):
    """Which SDPA kernel a compiled step ran, from the profiler's kernel names."""
    if dev != "cuda":
        return "n/a on the CPU"
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    names = {e.key for e in prof.key_averages()}
    for pattern, backend in [("cudnn", "cuDNN attention"), ("flash", "FlashAttention-2"),
                             ("fmha", "memory-efficient (CUTLASS)"),
                             ("efficient_attention", "memory-efficient (CUTLASS)")]:
        hits = sorted(n for n in names if pattern in n.lower())
        if hits:
            return f"{backend} ({hits[0][:80]})"
    return "math (no fused attention kernel in the profile)"


# --- the run --------------------------------------------------------------------------------


# The benchmark's groups of rows, in the order they run (`--only` picks some: a second GPU
# run completes a record that a time budget cut short; `bench/record.py merge` joins them).
GROUPS = ["gpt2", "llama", "lora", "recipe", "profile", "gpt2-attention", "eager",
          "llama-attention", "fp8"]


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--castor", type=Path, default=ROOT / "gpu-pack" / "castor")
    ap.add_argument("--dry-run", action="store_true",
                    help="tiny shapes with castor on the CPU: the harness, not a measurement")
    ap.add_argument("--castor-device", default=None,
                    help="where castor trains (default: cuda, or cpu for --dry-run)")
    ap.add_argument("--recipe-log", type=Path, default=None,
                    help="the JSON log of a 7B recipe run made earlier on this card (check.py's "
                         "tests part), read instead of running it again")
    ap.add_argument("--repeat", type=int, default=None, help="timed PyTorch steps (median)")
    ap.add_argument("--steps", type=int, default=None, help="castor steps per row")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds for the whole benchmark: rows not started by then say so")
    ap.add_argument("--require-castor", action="store_true",
                    help="exit non-zero when any castor row did not run")
    ap.add_argument("--warm-compile", action="store_true",
                    help="only compile the torch.compile rows' steps into Inductor's on-disk "
                         "caches (the GPU check runs this beside its tests); no record")
    ap.add_argument("--only", default=None,
                    help="run only these groups, comma-separated (default: all, in order): "
                         + ", ".join(GROUPS))
    args = ap.parse_args()
    unknown = set((args.only or "").split(",")) - set(GROUPS) - {""}
    if unknown:
        sys.exit(f"--only: unknown group(s) {', '.join(sorted(unknown))}; the groups are "
                 + ", ".join(GROUPS))
    wanted = lambda group: args.only is None or group in args.only.split(",")
    args.out = args.out.resolve()
    args.castor = args.castor.resolve()
    args.castor_device = args.castor_device or ("cpu" if args.dry_run else "cuda")
    args.repeat = args.repeat or (3 if args.dry_run else 10)
    args.steps = args.steps or (4 if args.dry_run else 24)
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.castor.exists():
        sys.exit(f"{args.castor} not found: build it (bench/gpu/pack.sh or cargo build --release)")
    bench = Bench(args)
    timer = Timer(bench.dev, args.repeat, warmup=1 if args.dry_run else 3)
    gpt2, llama, lora = configurations(bench)
    if args.warm_compile:
        warm_compile(bench, [cfg for group, cfg in (("gpt2", gpt2), ("llama", llama))
                             if wanted(group)])
        return

    def pair(cfg, castor_variants, peers):
        """castor's default first, then the peers (the ratio's denominator), then the rest."""
        plan = Plan(bench, cfg, [])
        bench.add(castor_train(bench, cfg, [], f"{cfg.family}{'-lora' if cfg.lora else ''}"))
        for system in peers:
            r, sdpa = torch_row(bench, cfg, system, plan, timer)
            bench.add(r)
            if sdpa and cfg is gpt2:
                bench.record["torch_compile_sdpa"] = sdpa
        for flags in castor_variants:
            tag = f"{cfg.family}-" + "-".join(f.strip("-") for f in flags)
            bench.add(castor_train(bench, cfg, flags, tag))

    # The targets first: castor's defaults against their peers.
    if wanted("gpt2"):
        pair(gpt2, [], ["torch.compile"])
    if wanted("llama"):
        pair(llama, [], ["torch.compile"])
    if wanted("lora"):
        pair(lora, [], ["peft"])
    if wanted("recipe"):
        bench.add(recipe_row(bench))
    if wanted("profile"):
        bench.record["profile"] = castor_profile(bench, gpt2)
    bench.save()
    # What is worth knowing but not the targets: castor's other attentions on GPT-2 (the
    # default is `auto`), PyTorch eager, and castor's other attentions on LLaMA.
    if wanted("gpt2-attention"):
        for flags in (["--attention", "eager"], ["--attention", "fused"]):
            bench.add(castor_train(bench, gpt2, flags, f"gpt2-{'-'.join(flags).strip('-')}"))
    if wanted("eager"):
        for cfg in (gpt2, llama):
            r, _ = torch_row(bench, cfg, "torch eager", Plan(bench, cfg, []), timer)
            bench.add(r)
    if wanted("llama-attention"):
        for flags in (["--attention", "eager"], ["--attention", "fused"]):
            bench.add(castor_train(bench, llama, flags, f"llama-{'-'.join(flags).strip('-')}"))
    # FP8 beside the llama group's bf16 row (issue: at least 1.3x at this shape).
    if wanted("fp8"):
        for precision in ("fp8", "fp8:delayed"):
            bench.add(castor_train(bench, llama, ["--precision", precision],
                                   f"llama-{precision.replace(':', '-')}"))
    bench.save()
    problems = record_format.validate(bench.record)
    table = record_format.render_record(bench.path, bench.record, root=bench.out)
    (args.out / "table.txt").write_text(table + "\n")
    print(table)
    print(f"record: {bench.path}")
    if problems:
        print("the record does not follow its format:\n  " + "\n  ".join(problems),
              file=sys.stderr)
        sys.exit(1)
    failed = [r for r in bench.record["rows"] if r["system"] == "castor"
              and r["tokens_per_s"] is None and "dry run" not in (r.get("note") or "")]
    if args.require_castor and failed:
        print("castor rows that did not run:\n  " + "\n  ".join(
            f"{r['model']} {r['flags']}: {r.get('note')}" for r in failed), file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
