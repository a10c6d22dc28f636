#!/usr/bin/env python3
"""How long castor's tensor-core attention backward keeps the device busy, by its block schedule.

A model, not a measurement: each block of the backward (`attention_bwd_<t>_d<P>` in
runtime/src/cuda/families/attention/attention.cu) costs the query tiles it reads, a tile
being one unit of time, plus `--overhead` units for the block itself (its K/V load and, with
several links, its share of the dK/dV chain); blocks are handed out in linear index order to
the first free SM, one block per SM (255 registers a thread, 8 warps), as the device
dispatches them. The busiest SM's total is the launch's length in tile times. The 2026-11-30
H200 profile gives the unit for the 64-row tiles of then: about 7 us a tile at d64 (GPT-2
124M: 5.25 ms for 12 layers of 64 tile times each), with a block's own cost taken as 0.3 of
one; the tiles are 128 rows at d64 now, so the same cost is 0.15 of one (the default).

Two schedules:
  whole      one block per (key block, key head): it reads every query tile of the group's
             query heads that sees its keys (castor before segments);
  segments   one block per (key block, query head, segment of 512 query rows) where the mask is
             causal, the blocks of a key block summing dK/dV in a fixed order (castor now).

Usage: python3 bench/attention_schedule.py [--sms 132] [--overhead 0.15]
"""

import argparse
import heapq

KEYS = 128  # keys per backward block
SEGMENT_ROWS = 512


def query_rows(d):
    """Query rows per backward tile: 128 at d <= 64 and 64 at d128 (64 and 32 before
    2026-11-30's change, when the 7 us unit was measured: a tile is twice that work now)."""
    return 128 if d <= 64 else 64


def makespan(works, sms):
    free = [0.0] * sms
    end = 0.0
    for w in works:
        t = heapq.heappop(free)
        heapq.heappush(free, t + w)
        end = max(end, t + w)
    return end


def blocks(batch, heads, kv_heads, t, d, segmented, overhead):
    """Tile counts of the causal backward's blocks (t = s), in dispatch order."""
    qt = query_rows(d)
    tiles = -(-t // qt)
    key_blocks = -(-t // KEYS)
    group = heads // kv_heads
    per_block = KEYS // qt  # tiles one key block's diagonal spans
    first = [kb * per_block for kb in range(key_blocks)]  # the first tile that sees key block kb
    works = []
    if not segmented:
        for _ in range(batch * kv_heads):
            for x in range(key_blocks):
                kb = key_blocks - 1 - x
                works.append(group * (tiles - first[kb]) + overhead)
        return works
    per_seg = SEGMENT_ROWS // qt
    segs = -(-tiles // per_seg)
    for z in range(batch * segs):
        seg = z % segs
        for _ in range(heads):
            for x in range(key_blocks):
                kb = key_blocks - 1 - x
                lo, hi = max(first[kb], seg * per_seg), min(tiles, (seg + 1) * per_seg)
                works.append(max(0, hi - lo) + overhead)
    return works


SHAPES = [
    ("GPT-2 124M B8xT1024", 8, 12, 12, 1024, 64),
    ("GPT-2 124M B4xT1024", 4, 12, 12, 1024, 64),
    ("LLaMA-3.2-1B B4xT2048", 4, 32, 8, 2048, 64),
    ("LLaMA-3-8B shape B1xT4096 (d128, GQA 4)", 1, 32, 8, 4096, 128),
]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--overhead", type=float, default=0.15)
    args = ap.parse_args()
    print(f"causal backward, {args.sms} SMs, block overhead {args.overhead} tile")
    print(f"{'shape':<42} {'ideal':>7} {'whole':>7} {'segments':>9} {'ratio':>6}")
    for name, b, h, kvh, t, d in SHAPES:
        whole = makespan(blocks(b, h, kvh, t, d, False, args.overhead), args.sms)
        seg_works = blocks(b, h, kvh, t, d, True, args.overhead)
        ideal = sum(blocks(b, h, kvh, t, d, True, 0.0)) / args.sms
        seg = makespan(seg_works, args.sms)
        print(f"{name:<42} {ideal:>7.1f} {whole:>7.1f} {seg:>9.1f} {seg / whole:>6.2f}")


if __name__ == "__main__":
    main()
