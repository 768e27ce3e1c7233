"""What a pause of the `nccl` tag must free, checked the same way by every GPU script that pauses
it (nccl_pause.py, nccl_pynccl.py, nccl_230_check.py).

Per pause: NCCL owns device memory (else the hook saw none: is the preload missing?); the
device gets back (cudaMemGetInfo) at least FLOOR of what the hook says NCCL owns less what it
keeps resident (ranges given to a NIC or bound to multicast), plus the kernel stack's local
memory it says the pause freed by lowering the limit; and the hook itself counts all of NCCL's
releasable memory released. The rest of NCCL's footprint (cudaMalloc'd buffers, the context)
is not its VMM memory. Measured on H100/H200 (docs/benchmarks.md): the device gets back all of
it, to the MiB.
"""

from __future__ import annotations

from typing import Any

FLOOR = 0.9
MIB = 1 << 20


def releasable(s: dict[str, Any]) -> int:
    """Bytes of device memory NCCL owns that a pause releases, by `memsaver.nccl_stats()`."""
    return int(s["owned_bytes"]) - int(s["resident_pinned_bytes"])


class PauseCheck:
    """Call `before(nccl_stats())` just before each `pause("nccl")` and `paused(freed,
    nccl_stats())` just after it, `freed` being the rise in the device's free memory."""

    def __init__(self) -> None:
        self.owned: list[int] = []  # releasable NCCL memory before each pause
        self.expected: list[int] = []  # that, plus the stack memory the pause says it freed
        self.freed: list[int] = []
        self.unreleased: list[int] = []

    def before(self, stats: dict[str, Any]) -> None:
        self.owned.append(releasable(stats))

    def paused(self, freed: int, stats: dict[str, Any]) -> None:
        self.freed.append(freed)
        self.expected.append(self.owned[len(self.freed) - 1] + int(stats["stack_lowered_bytes"]))
        self.unreleased.append(releasable(stats) - int(stats["paused_bytes"]))

    def failures(self) -> list[str]:
        """What went wrong, one line per shortfall (empty: every pause passed)."""
        out = []
        for i, (owned, expected, freed, left) in enumerate(
                zip(self.owned, self.expected, self.freed, self.unreleased, strict=True)):
            if owned <= 0:
                out.append(f"pause {i + 1}: the hook saw no NCCL device memory (is libmemsaver.so preloaded?)")
            elif freed < FLOOR * expected:
                out.append(f"pause {i + 1}: freed {freed / MIB:.1f} MiB, less than {FLOOR:.0%} of the "
                           f"{expected / MIB:.1f} MiB NCCL owns and may release (with the stack lowered)")
            if left:
                out.append(f"pause {i + 1}: {left / MIB:.1f} MiB of NCCL's memory not released by the hook")
        return out

    def report(self) -> dict[str, Any]:
        shares = [100 * f / e for f, e in zip(self.freed, self.expected, strict=True) if e > 0]
        return {
            "freed_by_pause_mib_min": round(min(self.freed) / MIB, 1),
            "releasable_mib_max": round(max(self.owned) / MIB, 1),
            "freed_pct_of_expected_min": round(min(shares), 1) if shares else None,
            "freed_floor_pct": round(100 * FLOOR),
        }
