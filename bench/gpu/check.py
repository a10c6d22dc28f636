#!/usr/bin/env python3
"""Everything castor checks and measures on a GPU (the GPU machine has CUDA 13 and PyTorch but
no Rust: build with bench/gpu/pack.sh first, then run from the repository root):

    python3 bench/gpu/check.py OUT --part all      # the three parts below, in that order, in
                                                   # one budget (default 450 s): a GPU run
                                                   # re-validates before it times anything;
                                                   # torch.compile's first compile of the
                                                   # benchmark's models runs beside the tests
    python3 bench/gpu/check.py OUT --part tests    # device layer, kernels, training steps
                                                   # (their plans in 8 processes at once),
                                                   # demo, a training run with save/resume,
                                                   # CUDA graphs off, sanitizers, the
                                                   # planned peak, three steps of the
                                                   # LLaMA-2-7B fine-tuning plan with its
                                                   # measured device peak; when
                                                   # --attention cudnn fails, cuDNN's API log
                                                   # (bench/gpu/cudnn_log.py), and when the
                                                   # GPU tests fail, cuBLASLt's log of an FP8
                                                   # step
    python3 bench/gpu/check.py OUT --part bench    # castor vs PyTorch (bench/gpu/bench.py):
                                                   # OUT/<date>-<card>.json, the record
    python3 bench/gpu/check.py OUT --part profile  # where a bf16 step spends its device
                                                   # time, command by command: GPT-2 124M's
                                                   # default plan, castor's fused attention
                                                   # kernels alone and eager attention, and
                                                   # LLaMA-3.2-1B's default plan and with
                                                   # cuDNN's engine by heuristics alone, and
                                                   # GPT-2 with unfused epilogues ("all" runs
                                                   # all but the default and eager GPT-2 ones,
                                                   # LLaMA's first); where Nsight Compute is
                                                   # installed, the warp stalls of castor's
                                                   # attention backward (GPT-2 and LLaMA)
                                                   # and the kernels cuBLAS runs for GPT-2's
                                                   # products, by name
    python3 bench/gpu/check.py OUT --preflight     # only find and check the CUDA libraries

Every part starts with a preflight that finds libcuda, libcublas.so.13, libcublasLt.so.13 and
NVRTC 13.0.x (refusing an NVRTC newer than the driver, whose PTX the driver cannot load), and
libcudnn.so.9 where it is installed, sets LD_LIBRARY_PATH, CASTOR_NVRTC_DIR and
CASTOR_CUDNN_DIR for what follows, and prints what it found. Every step
runs with CASTOR_REQUIRE_GPU=1, so nothing skips silently; steps run in the order above until
--budget seconds run out, and the rest are listed as not run (the benchmark gets what the tests
left, less the profile's share, and marks the rows it could not start). Logs and what the
steps write are kept in a temporary folder and packed (files up to 1 MiB) into
OUT/logs-<part>.tar.gz, beside a short OUT/summary-<part>.txt and the benchmark record; the
exit status is non-zero when any step failed, ran out of time or could not start.
"""

import argparse
import ctypes
import glob
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACK = ROOT / "gpu-pack"


# Files larger than this are listed in the archive's left-out.txt instead of packed.
ARCHIVED_FILE_LIMIT = 1 << 20


class PreflightError(Exception):
    pass


def site_dirs():
    """Python package folders where pip puts NVIDIA's wheels (nvidia/cu13/...)."""
    import site

    dirs = list(site.getsitepackages()) + [site.getusersitepackages()]
    return [Path(d) for d in dirs if d and Path(d).is_dir()]


def find_library(name, extra_dirs):
    """The first folder holding `name`: LD_LIBRARY_PATH, the extra folders, then ldconfig."""
    dirs = [d for d in os.environ.get("LD_LIBRARY_PATH", "").split(":") if d] + extra_dirs
    for d in dirs:
        if (Path(d) / name).exists():
            return Path(d)
    try:
        out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    except OSError:
        out = ""
    for line in out.splitlines():
        if line.strip().startswith(name + " ") and "=>" in line:
            return Path(line.split("=>")[1].strip()).parent
    return None


def cuda_dirs():
    """CUDA toolkit and pip-wheel library folders, most specific first."""
    roots = [os.environ.get(v) for v in ("CASTOR_NVRTC_DIR", "CUDA_HOME", "CUDA_PATH")]
    roots = [Path(r) for r in roots if r] + [Path("/usr/local/cuda")]
    roots += [Path(p) for p in sorted(glob.glob("/usr/local/cuda-13*"), reverse=True)]
    libs = []
    for r in roots:
        libs += [r / "lib64", r / "lib", r / "nvidia/cu13/lib", r / "targets/x86_64-linux/lib"]
    for s in site_dirs():
        libs += [s / "nvidia/cu13/lib", s / "nvidia/cublas/lib", s / "nvidia/cuda_nvrtc/lib"]
    return roots, [str(d) for d in libs if d.is_dir()]


def nvrtc_root(lib_dir):
    """The folder castor's NVRTC discovery takes (CASTOR_NVRTC_DIR) for the folder holding
    libnvrtc.so.13: the pip root for .../nvidia/cu13/lib, else the folder above lib or lib64;
    None when the CUDA headers are not beside it."""
    lib_dir = Path(lib_dir)
    if lib_dir.parts[-3:] == ("nvidia", "cu13", "lib"):
        root = lib_dir.parents[2]
    else:
        root = lib_dir.parent
    return root if (lib_dir.parent / "include" / "cuda_fp16.h").is_file() else None


def preflight(env):
    """Finds and checks the libraries; returns lines describing them. Raises PreflightError
    with what is missing and how to fix it."""
    lines = []
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise PreflightError(f"no CUDA driver: libcuda.so.1 cannot be loaded ({e}); this check "
                             "needs a machine with an NVIDIA GPU and its driver")
    rc = cuda.cuInit(0)
    if rc != 0:
        raise PreflightError(f"the CUDA driver failed to start: cuInit returned {rc}")
    count, version = ctypes.c_int(0), ctypes.c_int(0)
    cuda.cuDeviceGetCount(ctypes.byref(count))
    cuda.cuDriverGetVersion(ctypes.byref(version))
    if count.value < 1:
        raise PreflightError("the CUDA driver found no device")
    driver = (version.value // 1000, (version.value % 1000) // 10)
    name = ctypes.create_string_buffer(256)
    cuda.cuDeviceGetName(name, 256, 0)
    lines.append(f"driver     CUDA {driver[0]}.{driver[1]}, {count.value} device(s), "
                 f"device 0: {name.value.decode()}")

    roots, lib_dirs = cuda_dirs()
    found = {}
    for lib in ["libcublas.so.13", "libcublasLt.so.13", "libnvrtc.so.13"]:
        d = find_library(lib, lib_dirs)
        if d is None:
            raise PreflightError(f"{lib} not found in LD_LIBRARY_PATH, {', '.join(lib_dirs) or '(no CUDA folders)'} "
                                 "or the loader cache; install the CUDA 13 toolkit or "
                                 "pip install \"nvidia-cublas==13.*\" \"nvidia-cuda-nvrtc==13.0.*\"")
        found[lib] = d
        lines.append(f"{lib:<18} {d}")
    nvrtc = ctypes.CDLL(str(found["libnvrtc.so.13"] / "libnvrtc.so.13"))
    major, minor = ctypes.c_int(0), ctypes.c_int(0)
    nvrtc.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    lines.append(f"NVRTC      {major.value}.{minor.value}")
    if (major.value, minor.value) > driver:
        raise PreflightError(
            f"NVRTC {major.value}.{minor.value} ({found['libnvrtc.so.13']}) is newer than the CUDA "
            f"driver ({driver[0]}.{driver[1]}), which cannot load the PTX it writes; use NVRTC "
            f"{driver[0]}.{driver[1]} or update the driver")
    root = nvrtc_root(found["libnvrtc.so.13"])
    if root is None:
        raise PreflightError(f"no CUDA headers (cuda_fp16.h) beside {found['libnvrtc.so.13']}: "
                             "install nvidia-cuda-runtime==13.0.* next to NVRTC")
    env["CASTOR_NVRTC_DIR"] = str(root)
    lines.append(f"CASTOR_NVRTC_DIR={root}")
    dirs = []
    for d in found.values():
        if str(d) not in dirs:
            dirs.append(str(d))
    env["LD_LIBRARY_PATH"] = ":".join(dirs + [p for p in env.get("LD_LIBRARY_PATH", "").split(":") if p])
    # cuDNN 9 (optional): `--attention cudnn|auto` runs its fused attention where it loads.
    # PyTorch's environment has it as the nvidia-cudnn-cu13 (or -cu12) wheel.
    cudnn_dirs = [os.environ.get("CASTOR_CUDNN_DIR", "")] + [
        str(s / sub) for s in site_dirs() for sub in ("nvidia/cudnn/lib", "nvidia/cu13/lib")]
    cudnn = find_library("libcudnn.so.9", [d for d in cudnn_dirs if d and Path(d).is_dir()])
    if cudnn is None:
        lines.append("libcudnn.so.9      not found (--attention cudnn is refused; auto runs "
                     "castor's kernels): pip install \"nvidia-cudnn-cu13==9.*\"")
    else:
        env["CASTOR_CUDNN_DIR"] = str(cudnn)
        if str(cudnn) not in env["LD_LIBRARY_PATH"].split(":"):
            env["LD_LIBRARY_PATH"] = f"{cudnn}:{env['LD_LIBRARY_PATH']}"
        lines.append(f"libcudnn.so.9      {cudnn} (CASTOR_CUDNN_DIR)")
    sanitizer = shutil.which("compute-sanitizer") or next(
        (str(r / "bin/compute-sanitizer") for r in roots if (r / "bin/compute-sanitizer").exists()), None)
    env["CASTOR_SANITIZER"] = sanitizer or ""
    # Nsight Compute (optional): the profile part's warp-stall reports of castor's attention
    # backward.
    ncu = shutil.which("ncu") or next(
        (str(p) for p in [r / "bin/ncu" for r in roots]
         + sorted(Path(p) for p in glob.glob("/opt/nvidia/nsight-compute/*/ncu")) if p.exists()),
        None)
    env["CASTOR_NCU"] = ncu or ""
    lines.append(f"ncu                {ncu or 'not found (no warp-stall reports)'}")
    lines.append(f"compute-sanitizer  {sanitizer or 'not found (the sanitizer steps will fail)'}")
    return lines


class Steps:
    """Runs named commands with a time limit each and an overall deadline; records results."""

    def __init__(self, logs, env, deadline):
        self.logs, self.env, self.deadline = logs, env, deadline
        self.rows, self.failed = [], False

    def run(self, name, cmd, limit, env=None):
        left = self.deadline - time.monotonic()
        if left < 5:
            self.rows.append(f"{name:<28} NOT RUN (out of time)")
            self.failed = True
            return False
        limit = min(limit, left)
        t0 = time.monotonic()
        log = self.logs / f"{name}.log"
        with open(log, "w") as f:
            f.write("$ " + " ".join(map(str, cmd)) + "\n")
            f.flush()
            try:
                p = subprocess.run([str(c) for c in cmd], stdout=f, stderr=subprocess.STDOUT,
                                   env={**self.env, **(env or {})}, cwd=ROOT, timeout=limit)
                rc = p.returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
            except OSError as e:
                f.write(f"cannot start: {e}\n")
                rc = "cannot start"
        ok = rc == 0
        self.failed |= not ok
        self.rows.append(f"{name:<28} {'ok' if ok else 'FAILED'} (exit {rc}, {time.monotonic() - t0:.0f} s)")
        return ok

    def spawn(self, log, cmd, env=None):
        """Starts `cmd` with its output to the file `log` (headed by the command and the
        environment it adds); returns the process, or None when it cannot start, and the open
        log."""
        f = open(log, "w")
        shown = "".join(f"{k}={v} " for k, v in (env or {}).items())
        f.write(f"$ {shown}" + " ".join(map(str, cmd)) + "\n")
        f.flush()
        try:
            p = subprocess.Popen([str(c) for c in cmd], stdout=f, stderr=subprocess.STDOUT,
                                 env={**self.env, **(env or {})}, cwd=ROOT)
        except OSError as e:
            f.write(f"cannot start: {e}\n")
            p = None
        return p, f

    @staticmethod
    def reap(p, f, until):
        """The exit status of a `spawn`ed process, waiting for it until the monotonic time
        `until` and killing it then ("timeout"); closes its log."""
        if p is None:
            rc = "cannot start"
        else:
            try:
                rc = p.wait(timeout=max(until - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
                rc = "timeout"
        f.close()
        return rc

    def start(self, name, cmd):
        """Starts `cmd` in the background (log name.log); `finish` waits for it. What it does
        is no check: its end is a row of the summary but never a failure."""
        p, f = self.spawn(self.logs / f"{name}.log", cmd)
        return name, p, f, time.monotonic()

    def finish(self, started, limit):
        """Waits for a `start`ed command, at most `limit` seconds from its start (and never
        past the deadline), killing it then."""
        name, p, f, t0 = started
        rc = self.reap(p, f, min(t0 + limit, self.deadline))
        state = "ok" if rc == 0 else "did not finish" if rc == "timeout" else "failed"
        self.rows.append(f"{name:<28} {state} (exit {rc}, {time.monotonic() - t0:.0f} s, in the "
                         "background; not a check)")

    def run_together(self, name, cmd, limit, envs):
        """Runs `cmd` once per environment of `envs`, all at once, as one step (logs
        name-0.log, name-1.log, ...): ok when every one exits 0 within `limit`; those still
        running then are killed."""
        left = self.deadline - time.monotonic()
        if left < 5:
            self.rows.append(f"{name:<28} NOT RUN (out of time)")
            self.failed = True
            return False
        t0 = time.monotonic()
        until = t0 + min(limit, left)
        running = [self.spawn(self.logs / f"{name}-{i}.log", cmd, env)
                   for i, env in enumerate(envs)]
        codes = [self.reap(p, f, until) for p, f in running]
        ok = all(c == 0 for c in codes)
        self.failed |= not ok
        exits = ", ".join(map(str, codes))
        self.rows.append(f"{name:<28} {'ok' if ok else 'FAILED'} (exits {exits}, "
                         f"{time.monotonic() - t0:.0f} s)")
        return ok


# The GPU test that runs every training plan, and how many processes share its plans
# (CASTOR_GPU_PLAN_SHARE, tests/cuda_gpu.rs).
PLANS_TEST = "training_steps_match_the_cpu_executor"
# The GPU test that reads the device's free memory.
PEAK_TEST = "the_device_allocates_the_planned_peak"
# The GPU test of cuDNN's sliding-window graphs, run only with CASTOR_CUDNN_WINDOWS=1.
WINDOWS_TEST = "cudnn_sliding_windows_match_the_cpu_executor"
PLAN_SHARES = 8


def run_plans(steps, name, gpu_tests, limit, env=None):
    """The training plans' GPU test as PLAN_SHARES processes at once, each with its share."""
    return steps.run_together(
        name, [gpu_tests, "--exact", PLANS_TEST, "--nocapture"], limit,
        [{**(env or {}), "CASTOR_GPU_PLAN_SHARE": f"{k}/{PLAN_SHARES}"}
         for k in range(PLAN_SHARES)])


def part_tests(steps, out_dir, before_memory_checks=None):
    """In order of what a short lease must show first: the device layer, every kernel family
    and training steps against the CPU executor, the demo and a training run with save/resume;
    then CUDA graphs off and the sanitizers; last the two checks that read the device's used
    memory (the planned peak, the 7B step), after `before_memory_checks()` (which waits for
    anything else on the device to end). What the budget cuts off is listed as not run."""
    castor = PACK / "castor"
    gpu_tests = PACK / "cuda_gpu"
    # castor creates an output folder, never its parents: the demo writes under out_dir.
    out_dir.mkdir(parents=True, exist_ok=True)
    # --nocapture: the cuDNN test prints which of castor's attention graphs cuDNN builds.
    steps.run("device_layer", [PACK / "runtime_tests", "--test-threads", "1", "--nocapture",
                               "cuda::device"], 90)
    # Every kernel family and the binary's other tests but the training plans and the planned
    # peak (last: it reads the device's free memory, which other processes move); this
    # compiles every module into the PTX cache the training plans then read. Then the plans
    # as PLAN_SHARES processes at once: one process took 80 s for them without CUDA graphs and
    # more than 180 s with them on the 2026-11-30 H200 run (cuDNN building each auto plan's
    # graphs), time on the host, which the machine's 16 cores share out.
    ok = steps.run("kernels", [gpu_tests, "--test-threads", "1", "--nocapture",
                               "--skip", PLANS_TEST, "--skip", PEAK_TEST], 120)
    ok &= run_plans(steps, "kernels_and_steps", gpu_tests, 150)
    if not ok:
        # cuBLASLt says why it refuses a product only in its log (the H200 runs' FP8 products
        # failed in cublasLtMatmul with NOT_SUPPORTED after the heuristic found an algorithm):
        # one FP8 step with the API trace, kept with the logs. The tiny GPT-2 at 8 x 64
        # tokens, whose every product passes castor's own FP8 checks (the fixtures' 14 tokens
        # do not: castor refuses them before cuBLASLt sees them).
        steps.run("fp8_cublaslt_log",
                  [castor, "train", "assets/tiny-gpt2.json", "--data", "assets/corpus.txt",
                   "--batch", "8", "--seq", "64", "--steps", "1", "--precision", "fp8",
                   "--device", "cuda"], 60,
                  env={"CUBLASLT_LOG_LEVEL": "5",
                       "CUBLASLT_LOG_FILE": str(Path(steps.logs) / "fp8-cublaslt.log")})
    # cuDNN's sliding-window graphs (the earlier ones gave gradients 0.75 off, likely from
    # padded rows that see no key, which those batches scored): Mistral's windowed cuDNN plans
    # against the CPU executor on batches whose padding reaches no loss. Windows stay castor's
    # kernels under `auto` until this passes.
    steps.run("cudnn_windows", [gpu_tests, "--exact", WINDOWS_TEST, "--nocapture"], 60,
              env={"CASTOR_CUDNN_WINDOWS": "1"})
    steps.run("demo", [castor, "demo", "--device", "cuda", "--out", out_dir / "demo"], 90)
    run = out_dir / "run"
    run.mkdir(parents=True, exist_ok=True)
    common = [castor, "train", "assets/tiny-gpt2.json", "--data", "assets/corpus.txt",
              "--batch", "8", "--seq", "64", "--precision", "bf16", "--device", "cuda",
              "--val-fraction", "0.05", "--eval-every", "20", "--profile"]
    steps.run("train_save", common + ["--steps", "40", "--log", run / "full.jsonl", "--save",
                                      run / "full", "--save-every", "20", "--keep", "3"], 90)
    steps.run("train_resume", common + ["--steps", "40", "--log", run / "resumed.jsonl",
                                         "--resume", run / "full" / "step-000020", "--save",
                                         run / "resumed"], 90)
    steps.run("resume_matches", [sys.executable, "-c", RESUME_MATCHES,
                                 run / "full" / "model.safetensors",
                                 run / "resumed" / "model.safetensors"], 30)
    # The attention backward must be deterministic: two runs of the same steps end with the
    # same weights, byte for byte (cuDNN's deterministic engine; castor's kernels sum dQ in a
    # fixed order). GPT-2 124M at full length, so that the backward spans many blocks.
    for mode in ["cudnn", "fused"]:
        ok = steps.run(f"attention_{mode}_deterministic",
                       [sys.executable, "-c", SAME_WEIGHTS_TWICE, castor, run / f"twice-{mode}",
                        "--attention", mode], 90)
        if mode == "cudnn" and not ok:
            # cuDNN says why it builds no engine only in its API log: keep one (castor's and
            # PyTorch's graphs at GPT-2's shape) with the logs.
            steps.run("cudnn_api_log", [sys.executable, "bench/gpu/cudnn_log.py", steps.logs,
                                        "--castor", castor], 90)
    run_plans(steps, "kernels_and_steps_no_graphs", gpu_tests, 90, {"CASTOR_CUDA_GRAPHS": "0"})
    sanitizer = steps.env.get("CASTOR_SANITIZER") or "compute-sanitizer"
    one_step = [castor, "train", "tests/fixtures/gpt2_lm", "--data",
                "tests/fixtures/gpt2_lm/input.safetensors", "--steps", "1", "--precision", "bf16",
                "--device", "cuda"]
    for tool in ["memcheck", "racecheck", "initcheck"]:
        # racecheck takes castor's attention kernels: it reports shared-memory hazards inside
        # cuDNN's own flash backward (cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma,
        # the kernel PyTorch's cuDNN attention runs too), code castor neither owns nor can
        # change, whose outputs the GPU tests compare with the CPU executor's.
        attention = ["--attention", "fused"] if tool == "racecheck" else []
        steps.run(f"sanitize_{tool}_train_step",
                  [sanitizer, "--tool", tool, "--error-exitcode", "1"] + one_step + attention,
                  90)
        steps.run(f"sanitize_{tool}_kernels",
                  [sanitizer, "--tool", tool, "--error-exitcode", "1", gpu_tests,
                   "--test-threads", "1", "every_kernel_family"], 120)
    if before_memory_checks:
        before_memory_checks()
    steps.run("planned_peak", [gpu_tests, "--exact", PEAK_TEST, "--nocapture"], 60)
    # The 7B recipe of docs/commands.md: one step on the card, its peak device memory (polled with
    # nvidia-smi) against the planned peak `castor compile` reports.
    recipe = ["assets/configs/llama-2-7b.json", "--precision", "bf16", "--batch", "1", "--seq",
              "4096", "--remat", "selective", "--optimizer", "adafactor", "--update-in-backward"]
    steps.run("llama_7b_step", [sys.executable, "-c", PEAK_AGAINST_PLAN, castor,
                                str(run / RECIPE_LOG)] + recipe, 180)


# A resumed run must end with the weights of the uninterrupted one, byte for byte.
RESUME_MATCHES = """
import sys
a, b = (open(p, 'rb').read() for p in sys.argv[1:3])
print('identical' if a == b else 'the resumed run ends with other weights')
sys.exit(0 if a == b else 1)
"""


# Trains GPT-2 124M twice from the same seed with the flags given and compares the saved
# weights byte for byte.
SAME_WEIGHTS_TWICE = """
import array, filecmp, os, subprocess, sys
castor, folder, flags = sys.argv[1], sys.argv[2], sys.argv[3:]
os.makedirs(folder, exist_ok=True)
tokens = os.path.join(folder, 'tokens.bin')
array.array('H', [(i * 7919) % 50257 for i in range(8 * 1024)]).tofile(open(tokens, 'wb'))
saved = []
for run in ('first', 'second'):
    out = os.path.join(folder, run)
    subprocess.run([castor, 'train', 'assets/configs/gpt2-124m.json', '--data', tokens,
                    '--steps', '3', '--batch', '2', '--seq', '1024', '--precision', 'bf16',
                    '--device', 'cuda', '--save', out] + flags, check=True)
    saved.append(os.path.join(out, 'model.safetensors'))
same = filecmp.cmp(*saved, shallow=False)
print('identical weights after two runs' if same else 'the two runs end with other weights')
sys.exit(0 if same else 1)
"""


# The 7B recipe's JSON log, under the tests part's run/: the benchmark reads its timed steps.
RECIPE_LOG = "llama-7b.jsonl"


# Three training steps of a plan (the benchmark times the last two) while nvidia-smi polls the device's used memory; the peak above
# the idle level must not exceed the planned peak (plus 1 GiB for the CUDA context, module code
# and the driver's rounding), and must reach 90% of it (the plan is what runs).
PEAK_AGAINST_PLAN = """
import array, os, subprocess, sys, threading, time
castor, log, model, flags = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
os.makedirs(os.path.dirname(log), exist_ok=True)
# A u16 token file (llm.c's format): the model has no tokenizer files beside its config.
tokens = log + '.tokens.bin'
array.array('H', [(i * 7919) % 32000 for i in range(3 * 4096)]).tofile(open(tokens, 'wb'))
out = subprocess.run([castor, 'compile', model, '--train'] + flags, capture_output=True,
                     text=True, check=True).stdout
planned = next(int(l.split()[1].replace(',', '')) for l in out.splitlines()
               if l.strip().startswith('total '))
def used():
    q = ['nvidia-smi', '--query-gpu=memory.used', '--format=csv,noheader,nounits']
    return int(subprocess.run(q, capture_output=True, text=True).stdout.split()[0]) << 20
idle, peak, done = used(), [0], threading.Event()
def poll():
    while not done.is_set():
        peak[0] = max(peak[0], used())
        time.sleep(0.05)
t = threading.Thread(target=poll)
t.start()
r = subprocess.run([castor, 'train', model, '--data', tokens, '--steps', '3',
                    '--device', 'cuda', '--log', log] + flags)
done.set()
t.join()
measured = peak[0] - idle
print(f'planned {planned} bytes, measured {measured} bytes above idle '
      f'({measured / planned:.3f} of the plan)')
sys.exit(r.returncode or (0 if 0.9 * planned <= measured <= planned + (1 << 30) else 1))
"""


def part_bench(steps, out_dir, budget=None):
    """bench/gpu/bench.py with castor's binary; the 7B recipe's row from the tests part's log
    when that part ran first."""
    cmd = [sys.executable, "bench/gpu/bench.py", "--out", out_dir / "bench", "--castor",
           PACK / "castor", "--require-castor"]
    recipe = out_dir / "run" / RECIPE_LOG
    if recipe.exists():
        cmd += ["--recipe-log", recipe]
    if budget is not None:
        cmd += ["--budget", max(budget, 1)]
    steps.run("bench", cmd, 540 if budget is None else budget + 60)


# The plans the profile part times, each (tag, config, batch, seq, flags): the benchmark's
# GPT-2 124M step (B=8, T=1024) with castor's defaults (`--attention auto`: cuDNN where it
# runs, else castor's kernels), with castor's fused kernels alone and with the eager
# attention; and the benchmark's LLaMA-3.2-1B step (B=4, T=2048), the one furthest from its
# roofline, with the defaults and with cuDNN's engine chosen by its heuristics alone (the
# deterministic backward cuDNN ran at 14x its roofline on the 2026-11-28 H100 record: this
# measures what determinism costs); and GPT-2 with the products' epilogues unfused (the
# bias-gradient epilogue's products ran at 2.15x their roofline, plain products at 1.1-1.3x,
# so GPT-2's weight gradients now sum their bias gradients apart; the bias, GELU and GELU
# gradient epilogues ran at 1.6-2.4x: this profile sets each beside its unfused kernels);
# and the benchmark's LoRA step on LLaMA-3.2-1B (r=16 on the seven projections; 2.17x its
# roofline on the 2026-11-28 H100 record, with no profile to say where).
# Each: (tag, config, batch, seq, flags, environment).
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
GPT2 = "assets/configs/gpt2-124m.json"
LLAMA = "assets/configs/llama-3.2-1b.json"
PROFILED = [("default", GPT2, 8, 1024, [], {}),
            ("attention-fused", GPT2, 8, 1024, ["--attention", "fused"], {}),
            ("llama-1b", LLAMA, 4, 2048, [], {}),
            ("llama-1b-any-engine", LLAMA, 4, 2048, [], {"CASTOR_CUDNN_NONDETERMINISTIC": "1"}),
            ("epilogues-eager", GPT2, 8, 1024, ["--attention", "fused", "--epilogues", "eager"],
             {}),
            ("llama-1b-lora", LLAMA, 4, 2048, ["--lora-rank", "16", "--lora-targets",
                                               ",".join(LORA_TARGETS)], {}),
            ("attention-eager", GPT2, 8, 1024, ["--attention", "eager"], {})]


# Where castor's attention backward stalls, from Nsight Compute's counters: one launch of the
# kernel (the last layer's, the first the step runs) in a one-step train of GPT-2 124M (d=64)
# and of LLaMA-3.2-1B (d=128, grouped heads) with castor's kernels, issued one by one (CUDA
# graphs off). On the 2026-11-30 H200 run it took about 7 us per query tile a block reads
# (bench/attention_schedule.py's model of the launch), about 4x what its instruction count
# allows at two warps per scheduler: the warp states say which waits hold it (the dQ
# handoff's barriers and fence, L2 latency, the tensor cores). Each:
# (tag, config, batch, seq, kernel name pattern).
# Last, one launch of castor's attention forward on GPT-2: on the same run it took 1.34 ms of
# the step, 7.8x its roofline, and the warp states say what holds it.
STALLS = [("gpt2-attention-bwd", GPT2, 8, 1024, "regex:attention_bwd_bf16_d"),
          ("llama-attention-bwd", LLAMA, 4, 2048, "regex:attention_bwd_bf16_d"),
          ("gpt2-attention-fwd", GPT2, 8, 1024, "regex:attention_fwd_bf16_d")]
NCU_SECTIONS = ["SpeedOfLight", "LaunchStats", "Occupancy", "SchedulerStats", "WarpStateStats",
                "MemoryWorkloadAnalysis", "SourceCounters"]

# Which kernels cuBLAS and cuBLASLt run for GPT-2 124M's products, by name, with their
# durations and throughput: on the 2026-11-29 H200 profile the bias, GELU and GELU-gradient
# epilogues' products ran at 1.6-2.4x their roofline where plain products ran at about 1.1x.
# A kernel named for an earlier architecture (`sm80_`, `ampere_`) rather than Hopper's
# (`sm90_`, `nvjet`) would say the epilogue has no Hopper kernel. The product launches of one
# step with CUDA graphs off, from the 41st (the last two layers' forward, the classifier, the
# last layer's backward). (tag, config, batch, seq, kernel name pattern, skip, count).
PRODUCT_KERNELS = [("gpt2-products", GPT2, 8, 1024, "regex:gemm|nvjet|xmma|cutlass", 40, 32)]


def part_profile(steps, out_dir, plans=PROFILED, stalls=STALLS, products=()):
    """`castor train --profile-kernels` on each plan of PROFILED (bf16, 3 steps, the last one
    profiled): the printed tables (each kind beside its roofline) are in the logs, every
    command in the CSV files. The quick way to see where castor's step time goes without the
    whole benchmark. Then, where Nsight Compute is installed, its report of the attention
    backward on each case of `stalls` (in the logs)."""
    castor = PACK / "castor"
    out_dir.mkdir(parents=True, exist_ok=True)
    # nanoGPT's raw u16 token file (the configs have no tokenizer files beside them), long
    # enough for three steps of the largest plan; every id is below both vocabularies.
    tokens = out_dir / "tokens.bin"
    tokens.write_bytes(b"".join(((i * 7919) % 50257).to_bytes(2, "little")
                                for i in range(4 * 2048 * 4)))
    for tag, config, batch, seq, extra, env in plans:
        steps.run(f"profile_{tag}", [castor, "train", config, "--data", tokens, "--steps", "3",
                                     "--batch", str(batch), "--seq", str(seq),
                                     "--precision", "bf16", "--device", "cuda",
                                     "--profile-kernels", out_dir / f"kernels-{tag}.csv"] + extra,
                  120, env=env)
    ncu = steps.env.get("CASTOR_NCU")
    for tag, config, batch, seq, kernel in stalls if ncu else []:
        sections = [a for name in NCU_SECTIONS for a in ("--section", name)]
        # --clock-control none: the card's clocks as the benchmark sees them.
        steps.run(f"stalls_{tag}", [ncu, "--clock-control", "none", "--kernel-name", kernel,
                                    "--launch-count", "1"] + sections
                  + [castor, "train", config, "--data", tokens, "--steps", "1",
                     "--batch", str(batch), "--seq", str(seq), "--precision", "bf16",
                     "--device", "cuda", "--attention", "fused"], 90,
                  env={"CASTOR_CUDA_GRAPHS": "0"})
    for tag, config, batch, seq, kernel, skip, count in products if ncu else []:
        steps.run(f"kernels_{tag}", [ncu, "--clock-control", "none", "--kernel-name", kernel,
                                     "--launch-skip", str(skip), "--launch-count", str(count),
                                     "--section", "SpeedOfLight", "--section", "LaunchStats"]
                  + [castor, "train", config, "--data", tokens, "--steps", "1",
                     "--batch", str(batch), "--seq", str(seq), "--precision", "bf16",
                     "--device", "cuda"], 90,
                  env={"CASTOR_CUDA_GRAPHS": "0"})


# Seconds `--part all` keeps for the profile part when it starts the benchmark: LLaMA-3.2-1B's
# default step (three steps, the last timed command by command) and what else fits.
PROFILE_SHARE = 70


def part_all(steps, out_dir):
    # torch.compile's first compile of the benchmark's GPT-2 and LLaMA steps is minutes of host
    # time (the H100 run of 2026-11-28 took 220 s for the LLaMA and LoRA pairs, castor's rows
    # a small part of it): it runs beside the tests, into Inductor's on-disk caches, which the
    # benchmark's compile then reads. The tests' device-memory checks wait for it to end.
    warm = steps.start("torch_compile_warm", [sys.executable, "bench/gpu/bench.py", "--out",
                                              out_dir / "warm", "--warm-compile"])
    part_tests(steps, out_dir, before_memory_checks=lambda: steps.finish(warm, 240))
    left = steps.deadline - time.monotonic()
    part_bench(steps, out_dir, budget=left - PROFILE_SHARE - 30)
    # The benchmark's record holds GPT-2's default profile already. The LLaMA step first (the
    # target furthest from met), then castor's own attention kernels, the LoRA step, the
    # unfused epilogues and LLaMA with either engine choice, until the budget ends (the eager
    # attention's profile is for `--part profile`).
    # The warp stalls of castor's attention backward on GPT-2 come second, then the names of
    # the kernels behind GPT-2's products.
    pick = lambda tags: [next(p for p in PROFILED if p[0] == tag) for tag in tags]
    part_profile(steps, out_dir / "profile", pick(["llama-1b"]), STALLS[:1], PRODUCT_KERNELS)
    part_profile(steps, out_dir / "profile", pick(["attention-fused", "llama-1b-lora",
                                                   "epilogues-eager", "llama-1b-any-engine"]),
                 STALLS[1:])


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--part", choices=["all", "tests", "bench", "profile"], default="tests")
    ap.add_argument("--preflight", action="store_true", help="only check the CUDA libraries")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds the part may take in all (default 450 for all, else 540)")
    args = ap.parse_args()
    started = time.monotonic()
    budget = args.budget or (450 if args.part == "all" else 540)
    out_dir = args.out.resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "CASTOR_REQUIRE_GPU": "1", "CASTOR_BIN": str(PACK / "castor"),
           "PYTHONUNBUFFERED": "1"}
    # Inductor's on-disk caches, on: the benchmark's torch.compile reads what `--part all`'s
    # warm-up compiled (they are on by default in recent PyTorch; said here so that they stay).
    env.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")
    env.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "1")
    # Compiled PTX stays on the machine; only the summary and the log archive go to OUT.
    env.setdefault("CASTOR_CACHE_DIR", tempfile.mkdtemp(prefix="castor-ptx-"))
    label = "preflight" if args.preflight else args.part
    summary = [f"castor GPU check, part {label}, {time.strftime('%Y-%m-%d %H:%M:%S')}"]
    try:
        summary += preflight(env)
    except PreflightError as e:
        summary.append(f"preflight FAILED: {e}")
        (out_dir / f"summary-{label}.txt").write_text("\n".join(summary) + "\n")
        print("\n".join(summary), file=sys.stderr)
        return 1
    if args.preflight:
        (out_dir / f"summary-{label}.txt").write_text("\n".join(summary) + "\n")
        print("\n".join(summary))
        return 0
    missing = [p for p in [PACK / "castor", PACK / "cuda_gpu", PACK / "runtime_tests"] if not p.exists()]
    if missing:
        summary.append(f"FAILED: {', '.join(map(str, missing))} missing: run bench/gpu/pack.sh "
                       "on the build machine first")
        (out_dir / f"summary-{label}.txt").write_text("\n".join(summary) + "\n")
        print("\n".join(summary), file=sys.stderr)
        return 1
    logs = Path(tempfile.mkdtemp(prefix=f"castor-gpu-{label}-"))
    steps = Steps(logs, env, started + budget)
    subprocess.run(["nvidia-smi"], stdout=open(logs / "nvidia-smi.txt", "w"),
                   stderr=subprocess.STDOUT)
    # What the steps write (demo, training runs, benchmark results) lands beside their logs,
    # in the archive.
    work = logs / "work"
    {"all": part_all, "tests": part_tests, "bench": part_bench,
     "profile": lambda s, w: part_profile(s, w / "profile", products=PRODUCT_KERNELS)}[
        args.part](steps, work)
    summary += steps.rows
    summary.append(f"{'FAILED' if steps.failed else 'passed'} in {time.monotonic() - started:.0f} s")
    if (work / "bench" / "table.txt").exists():
        summary += ["", (work / "bench" / "table.txt").read_text()]
    # The record comes back whole, beside the summary: it is committed under bench/results/.
    for record in (work / "bench").glob("*.json"):
        shutil.copy(record, out_dir / record.name)
        summary.append(f"benchmark record: {out_dir / record.name}")
    for table in sorted((work / "profile").glob("kernels-*.csv")):
        shutil.copy(table, out_dir / table.name)
    # Model weights, logits and token files stay behind: only so much comes back from the
    # GPU machine, and the logs and results are what is read.
    left = [p for p in logs.rglob("*") if p.is_file() and p.stat().st_size > ARCHIVED_FILE_LIMIT]
    (logs / "left-out.txt").write_text("".join(f"{p.relative_to(logs)} {p.stat().st_size} bytes\n"
                                               for p in left))
    with tarfile.open(out_dir / f"logs-{label}.tar.gz", "w:gz") as tar:
        tar.add(logs, arcname=f"logs-{label}",
                filter=lambda t: None if t.size > ARCHIVED_FILE_LIMIT else t)
    (out_dir / f"summary-{label}.txt").write_text("\n".join(summary) + "\n")
    print("\n".join(summary))
    return 1 if steps.failed else 0


if __name__ == "__main__":
    sys.exit(main())
