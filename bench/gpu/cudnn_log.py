#!/usr/bin/env python3
"""cuDNN's API log of one fused attention, built by castor and by PyTorch, for comparing the
operation graphs the two hand to cuDNN (castor's `--attention cudnn` is refused when cuDNN's
heuristics find no engine for its graph):

    python3 bench/gpu/cudnn_log.py OUT [--castor gpu-pack/castor]

Writes OUT/cudnn-logs.tar.gz with castor.log (castor's descriptors, one GPT-2 124M step with
`--attention cudnn` at B=2, T=1024: 12 heads of 64, causal, bf16), castor-accumulated.log
(the same with CASTOR_CUDNN_NONDETERMINISTIC=1: the backward sums dQ in F32), torch.log
(PyTorch's cuDNN SDPA forward and backward at the same shape) and torch-frontend.log (the
graph PyTorch's cudnn-frontend builds, as JSON). Needs a GPU, PyTorch, and libcudnn.so.9 where check.py's
preflight finds it (CASTOR_CUDNN_DIR).
"""

import argparse
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

TORCH_SDPA = """
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
torch.manual_seed(0)
q, k, v = (torch.randn(2, 12, 1024, 64, device='cuda', dtype=torch.bfloat16,
                       requires_grad=True) for _ in range(3))
with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    o.float().square().sum().backward()
torch.cuda.synchronize()
print('torch cuDNN SDPA ran: out', tuple(o.shape), 'dq norm', q.grad.float().norm().item())
"""


def logged(env, log):
    return {**env, "CUDNN_LOGLEVEL_DBG": "3", "CUDNN_LOGDEST_DBG": str(log)}


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--castor", type=Path, default=ROOT / "gpu-pack" / "castor")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="castor-cudnn-"))
    tokens = work / "tokens.bin"
    tokens.write_bytes(b"".join(((i * 7919) % 50257).to_bytes(2, "little")
                                for i in range(4 * 1024)))
    env = dict(os.environ)
    # castor's graphs twice: the deterministic backward (dQ written directly, the default) and
    # the accumulating one (dQ summed in F32, the graph of cuDNN's flash backward), which tells
    # whether the backward's form is what cuDNN refuses.
    for name, extra in [("castor", {}), ("castor-accumulated",
                                         {"CASTOR_CUDNN_NONDETERMINISTIC": "1"})]:
        castor = subprocess.run(
            [str(args.castor), "train", "assets/configs/gpt2-124m.json", "--data", str(tokens),
             "--steps", "1", "--batch", "2", "--seq", "1024", "--precision", "bf16", "--device",
             "cuda", "--attention", "cudnn"],
            env=logged({**env, **extra}, work / f"{name}.log"), cwd=ROOT, capture_output=True,
            text=True)
        (work / f"{name}.out").write_text(castor.stdout + castor.stderr)
        print(f"{name} --attention cudnn: exit {castor.returncode}: "
              f"{(castor.stderr.strip().splitlines() or ['no output'])[-1]}")
    torch_env = {**logged(env, work / "torch.log"), "CUDNN_FRONTEND_LOG_INFO": "1",
                 "CUDNN_FRONTEND_LOG_FILE": str(work / "torch-frontend.log")}
    torch = subprocess.run([sys.executable, "-c", TORCH_SDPA], env=torch_env, cwd=ROOT,
                           capture_output=True, text=True)
    (work / "torch.out").write_text(torch.stdout + torch.stderr)
    print(f"torch cuDNN SDPA: exit {torch.returncode}: "
          f"{((torch.stdout + torch.stderr).strip().splitlines() or ['no output'])[-1]}")
    with tarfile.open(args.out / "cudnn-logs.tar.gz", "w:gz") as tar:
        tar.add(work, arcname="cudnn-logs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
