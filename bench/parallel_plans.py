"""Per-GPU planned peak and estimated step time of data-parallel training plans, from configs
alone (castor's Python API): GPT-2 XL, LLaMA-2-7B and LLaMA-3-70B on 1, 8 and 64 H100 SXM GPUs
under ZeRO stages 0-3. Prints the Markdown table BENCHMARKS.md keeps.

    pip install ./  &&  python bench/parallel_plans.py
"""

from pathlib import Path

import castor

ROOT = Path(__file__).resolve().parents[1]
MODELS = [
    ("GPT-2 XL", "gpt2-xl.json", 8, 1024),
    ("LLaMA-2-7B", "llama-2-7b.json", 1, 4096),
    ("LLaMA-3-70B", "llama-3-70b.json", 1, 4096),
]
GIB = 2**30


def main():
    print("| model | GPUs | ZeRO | per-GPU planned peak | masters + copies | gradients | "
          "moments | step (est.) | of which collectives | step, overlapped | "
          "tokens/s (all GPUs, overlapped) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, config, batch, seq in MODELS:
        for world, stages in [(1, [0]), (8, [0, 1, 2, 3]), (64, [0, 1, 2, 3])]:
            for zero in stages:
                plan = castor.compile(ROOT / "assets" / "configs" / config, "bf16", train=True,
                                      batch=batch, seq=seq, remat="full", gpu="h100",
                                      world_size=world, zero=zero)
                a, c = plan.anatomy, plan.cost
                comm = c["communication_seconds"]
                print(f"| {name} | {world} | {zero} | {a['total'] / GIB:.1f} GiB | "
                      f"{(a['master_weights'] + a['low_precision_weights']) / GIB:.1f} GiB | "
                      f"{a['gradients'] / GIB:.1f} GiB | {a['optimizer_state'] / GIB:.1f} GiB | "
                      f"{c['step_seconds'] * 1e3:.0f} ms | {comm * 1e3:.0f} ms | "
                      f"{c['overlapped_step_seconds'] * 1e3:.0f} ms | "
                      f"{world * c['tokens_per_step'] / c['overlapped_step_seconds']:,.0f} |")


if __name__ == "__main__":
    main()
