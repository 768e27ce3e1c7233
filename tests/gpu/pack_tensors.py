#!/usr/bin/env python3
"""GPU benchmark and check: does a packed backup (``MEMSAVER_PACK=all``) pay for a tensor tag
with the ``cpu`` backup, against whole copies (``MEMSAVER_PACK=off``)? One GPU, torch.

For each content, 4 GiB in 16 tensors of 256 MiB in a region with the cpu backup:

* ``zeros``: freshly zeroed memory (a KV cache or optimizer state just made);
* ``sparse``: one 4 KiB block in 64 holds something (a sixteenth of what a packed backup
  starts with has room for, so it fits);
* ``half``: every other block holds something (more than the backup's first size: it grows);
* ``dense``: random bytes in every block (nothing to pack: the scan costs, then a whole copy).

Each content runs in a process of its own per mode: one warm-up cycle (the backups are pinned
by then), then CYCLES cycles (default 4), each resume compared with a copy kept in untagged
memory, byte for byte. Prints one ``PACK_TENSORS`` JSON line per mode and content (median
pause and resume, GB/s over the 4 GiB), and a table. Exits non-zero if a resume differs or a
run fails.

Usage: python3 tests/gpu/pack_tensors.py [content ...]
"""

import json
import os
import statistics
import subprocess
import sys
import time

GIB = 1 << 30
TENSORS = 16
EACH = 4 * GIB // TENSORS
BLOCK = 4096
CONTENTS = ("zeros", "sparse", "half", "dense")
MODES = ("off", "all")
LINE = "PACK_TENSORS "


def fill(torch, t, content, seed):
    """Writes ``content`` into the uint8 tensor ``t``."""
    if content == "zeros":
        t.zero_()
        return
    g = torch.Generator(device="cuda").manual_seed(seed)
    blocks = t.view(-1, BLOCK)
    t.zero_()
    step = {"sparse": 64, "half": 2, "dense": 1}[content]
    chosen = blocks[::step]
    chosen.copy_(torch.randint(1, 256, chosen.shape, dtype=torch.uint8, device="cuda", generator=g))


def one(content, cycles):
    import memsaver
    import torch

    with memsaver.region("packed", backup="cpu"):
        ts = [torch.empty(EACH, dtype=torch.uint8, device="cuda") for _ in range(TENSORS)]
    for i, t in enumerate(ts):
        fill(torch, t, content, i)
    ref = [t.clone() for t in ts]  # untagged: stays resident
    torch.cuda.synchronize()
    pause_ms, resume_ms = [], []
    for k in range(cycles + 1):
        t0 = time.perf_counter()
        memsaver.pause("packed")
        t1 = time.perf_counter()
        memsaver.resume("packed")
        t2 = time.perf_counter()
        for i, (t, r) in enumerate(zip(ts, ref, strict=True)):
            if not torch.equal(t, r):
                raise AssertionError(f"{content}: tensor {i} differs after resume {k}")
        if k > 0:  # cycle 0 pins the backups
            pause_ms.append((t1 - t0) * 1e3)
            resume_ms.append((t2 - t1) * 1e3)
    p, r = statistics.median(pause_ms), statistics.median(resume_ms)
    row = {
        "mode": os.environ.get("MEMSAVER_PACK", ""),
        "content": content,
        "bytes": TENSORS * EACH,
        "pause_ms": round(p, 2),
        "resume_ms": round(r, 2),
        "pause_gbps": round(TENSORS * EACH / p / 1e6, 1),
        "resume_gbps": round(TENSORS * EACH / r / 1e6, 1),
        "backup_bytes": memsaver.stats().tags["packed"].usage.backup_bytes,
    }
    print(LINE + json.dumps(row), flush=True)


def main(argv):
    if len(argv) > 2 and argv[1] == "--one":
        one(argv[2], int(os.environ.get("CYCLES", "4")))
        return 0
    contents = argv[1:] or list(CONTENTS)
    rows, failed = [], []
    for content in contents:
        for mode in MODES:
            env = dict(os.environ, MEMSAVER_PACK=mode)
            p = subprocess.run(
                [sys.executable, __file__, "--one", content], env=env, capture_output=True, text=True, timeout=300
            )
            got = [json.loads(x[len(LINE) :]) for x in p.stdout.splitlines() if x.startswith(LINE)]
            if p.returncode != 0 or len(got) != 1:
                failed.append(f"{content}, MEMSAVER_PACK={mode}: exit {p.returncode}\n{p.stderr[-2000:]}")
                continue
            print(LINE + json.dumps(got[0]), flush=True)
            rows.append(got[0])
    print(f"{'content':8} {'mode':4} {'pause ms':>9} {'resume ms':>10} {'backup MiB':>11}")
    for r in rows:
        print(
            f"{r['content']:8} {r['mode']:4} {r['pause_ms']:9.1f} {r['resume_ms']:10.1f} "
            f"{r['backup_bytes'] / (1 << 20):11.0f}"
        )
    for f in failed:
        print("FAIL:", f, file=sys.stderr)
    print("pack_tensors:", "FAIL" if failed else "PASS")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
