"""The figures of ``memsaver.stats()``: per tag, per device, and in total."""

from __future__ import annotations

import json
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Usage:
    """Memory of a set of allocations.

    ``reserved_bytes`` is virtual address space (kept while paused), ``resident_bytes`` the
    device memory mapped now, ``backup_bytes`` the host memory held by backups (``cpu`` and
    ``mmap``; kept after resume while retention is on, to be reused by the next pause), split
    into ``pinned_backup_bytes`` and ``mmap_backup_bytes``. ``disk_backup_bytes`` is the size of
    disk backup files (not host memory, not in ``backup_bytes``). ``prepared_backup_bytes`` is
    pinned host memory allocated ahead of the first pause of ``cpu`` allocations (it becomes
    their backup at that pause; not in ``backup_bytes``).
    """

    allocations: int
    reserved_bytes: int
    resident_bytes: int
    backup_bytes: int
    pinned_backup_bytes: int = 0
    mmap_backup_bytes: int = 0
    disk_backup_bytes: int = 0
    prepared_backup_bytes: int = 0


@dataclass(frozen=True)
class TagStats:
    """One tag: whether it is paused, its totals, and its usage on each device."""

    tag: str
    paused: bool
    allocations: int
    reserved_bytes: int
    resident_bytes: int
    backup_bytes: int
    devices: dict[int, Usage] = field(default_factory=dict)
    pinned_backup_bytes: int = 0
    mmap_backup_bytes: int = 0
    disk_backup_bytes: int = 0
    prepared_backup_bytes: int = 0

    @property
    def usage(self) -> Usage:
        return Usage(
            self.allocations,
            self.reserved_bytes,
            self.resident_bytes,
            self.backup_bytes,
            self.pinned_backup_bytes,
            self.mmap_backup_bytes,
            self.disk_backup_bytes,
            self.prepared_backup_bytes,
        )


@dataclass(frozen=True)
class SharedExport:
    """One tag's memory this process exported to other processes (CUDA IPC handles, NCCL's
    registration of it, and NCCL's own buffers under ``nccl``): ``handles`` allocations or
    buffers shared, ``bytes`` their size, ``importers`` the processes that import them, and
    ``held_while_paused`` the bytes of them that are paused here but still mapped by some
    importer that did not let go (so not free on the device), ``imports_behind`` the imports
    not yet released or mapped again as this process's last pause or resume asked."""

    handles: int
    bytes: int
    importers: int
    held_while_paused: int = 0
    imports_behind: int = 0


@dataclass(frozen=True)
class SharedImport:
    """Memory of another memsaver process (``owner_pid``) that this one maps: ``bytes``,
    ``paused`` while its owner has it paused (the address stays reserved; touching it then is
    the same mistake as touching a paused tensor), ``via`` how it was opened: ``"cuda_ipc"`` (a
    CUDA IPC handle; ``opens``: the opens not closed yet) or ``"nccl"`` (NCCL registered the
    owner's buffer; ``opens``: NCCL's mappings of it)."""

    owner_pid: int
    bytes: int
    paused: bool
    opens: int
    via: str = "cuda_ipc"


@dataclass(frozen=True)
class Stats:
    """Every tag of the process (``tags``, by name) and the process total.

    ``backups_preparing`` counts ``cpu`` allocations whose pinned backup a background thread is
    still preparing, or still pinning the rest of after a pause that came first.
    ``backup_reserve_bytes`` is the pinned backup reserve asked for
    (``MEMSAVER_BACKUP_RESERVE_MB``, ``memsaver.reserve_backups``), ``backup_reserve_pinned_bytes``
    how much of it is pinned so far (less while it is being pinned, or when the host refused to
    pin more), and ``backup_reserve_used_bytes`` how much of that is lent to ``cpu`` backups
    (prepared ones, also in ``prepared_backup_bytes``, and backups, in ``pinned_backup_bytes``).
    ``driver_calls`` counts the CUDA driver calls memsaver has made in this process by kind
    (``create``, ``map``, ``set_access``, ``unmap``, ``release``, ``export``, ``import``,
    ``copy``, ``reserve``, ``address_free``, ``host_alloc``, ``host_free``, ``host_register``,
    ``host_unregister``, ``memset``): the difference
    across a pause or resume is what it asked of the driver. ``freed_held_bytes`` is
    device memory of freed allocations still held because a resume backed them together with
    their neighbours (``MEMSAVER_MERGE_MB``, ``MEMSAVER_NCCL_MERGE_MB`` for ``nccl``); it is
    released at the tag's next pause.
    ``shared_exports`` (by tag) and ``shared_imports`` are the memory shared with other
    processes through CUDA IPC handles (``cudaIpcGetMemHandle`` under the preload, e.g.
    torch.multiprocessing's CUDA tensors) and NCCL's registration of it; ``shared_exports``
    also counts NCCL's own buffers that peers import, under ``nccl``.
    """

    tags: dict[str, TagStats]
    total: Usage
    backups_preparing: int = 0
    backup_reserve_bytes: int = 0
    backup_reserve_pinned_bytes: int = 0
    backup_reserve_used_bytes: int = 0
    freed_held_bytes: int = 0
    driver_calls: dict[str, int] = field(default_factory=dict)
    shared_exports: dict[str, SharedExport] = field(default_factory=dict)
    shared_imports: list[SharedImport] = field(default_factory=list)

    def __str__(self) -> str:
        return format_table(self)


@dataclass(frozen=True)
class Allocation:
    """One allocation, as ``memsaver.allocations()`` lists it: its device address (fixed for
    its life), size (rounded up to the VMM granularity), device, tag, the policy it was
    allocated with, its state (``"resident"``, ``"paused"``, or ``"pausing"``/``"resuming"``
    during a transition), and the backup it holds now (``"pinned"``, ``"mmap"``, ``"disk"`` or
    None: a paused allocation without one resumes with arbitrary bytes) and its size."""

    ptr: int
    size: int
    device: int
    tag: str
    policy: str
    state: str
    backup: str | None
    backup_bytes: int


def parse_allocations(text: str) -> list[Allocation]:
    return [Allocation(**a) for a in json.loads(text)]


def _usage(d: dict[str, int]) -> Usage:
    return Usage(
        allocations=int(d["allocations"]),
        reserved_bytes=int(d["reserved_bytes"]),
        resident_bytes=int(d["resident_bytes"]),
        backup_bytes=int(d["backup_bytes"]),
        # Absent from the stats of an older libmemsaver.so.
        pinned_backup_bytes=int(d.get("pinned_backup_bytes", 0)),
        mmap_backup_bytes=int(d.get("mmap_backup_bytes", 0)),
        disk_backup_bytes=int(d.get("disk_backup_bytes", 0)),
        prepared_backup_bytes=int(d.get("prepared_backup_bytes", 0)),
    )


def parse(text: str) -> Stats:
    """Builds ``Stats`` from the JSON of ``memsaver_stats_json``."""
    doc = json.loads(text)
    tags = {}
    for t in doc["tags"]:
        u = _usage(t)
        tags[t["tag"]] = TagStats(
            tag=t["tag"],
            paused=bool(t["paused"]),
            allocations=u.allocations,
            reserved_bytes=u.reserved_bytes,
            resident_bytes=u.resident_bytes,
            backup_bytes=u.backup_bytes,
            pinned_backup_bytes=u.pinned_backup_bytes,
            mmap_backup_bytes=u.mmap_backup_bytes,
            disk_backup_bytes=u.disk_backup_bytes,
            prepared_backup_bytes=u.prepared_backup_bytes,
            devices={int(d["device"]): _usage(d) for d in t.get("devices", [])},
        )
    return Stats(
        tags=tags,
        total=_usage(doc["total"]),
        backups_preparing=int(doc.get("backups_preparing", 0)),
        backup_reserve_bytes=int(doc.get("backup_reserve_bytes", 0)),
        backup_reserve_pinned_bytes=int(doc.get("backup_reserve_pinned_bytes", 0)),
        backup_reserve_used_bytes=int(doc.get("backup_reserve_used_bytes", 0)),
        freed_held_bytes=int(doc.get("freed_held_bytes", 0)),
        driver_calls={str(k): int(v) for k, v in doc.get("driver_calls", {}).items()},
        shared_exports={
            str(k): SharedExport(
                int(v["handles"]),
                int(v["bytes"]),
                int(v["importers"]),
                int(v.get("held_while_paused", 0)),
                int(v.get("imports_behind", 0)),
            )
            for k, v in doc.get("shared", {}).get("exports", {}).items()
        },
        shared_imports=[
            SharedImport(
                int(i["owner_pid"]),
                int(i["bytes"]),
                bool(i["paused"]),
                int(i["opens"]),
                str(i.get("via", "cuda_ipc")),
            )
            for i in doc.get("shared", {}).get("imports", [])
        ],
    )


def human_bytes(n: int) -> str:
    """1536 -> '1.5 KiB'."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_table(stats: Stats) -> str:
    """A fixed-width table: one row per tag, one per device of tags on several devices."""
    header = ("tag", "state", "allocs", "reserved", "resident", "backup")
    rows: list[tuple[str, ...]] = []

    def row(name: str, state: str, u: Usage) -> tuple[str, ...]:
        return (
            name,
            state,
            str(u.allocations),
            human_bytes(u.reserved_bytes),
            human_bytes(u.resident_bytes),
            human_bytes(u.backup_bytes),
        )

    for t in stats.tags.values():
        rows.append(row(t.tag, "paused" if t.paused else "active", t.usage))
        if len(t.devices) > 1:
            for device, u in sorted(t.devices.items()):
                rows.append(row(f"  cuda:{device}", "", u))
    rows.append(row("total", "", stats.total))
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def fmt(r: tuple[str, ...]) -> str:
        left = [r[i].ljust(widths[i]) for i in range(2)]
        right = [r[i].rjust(widths[i]) for i in range(2, len(r))]
        return "  ".join(left + right).rstrip()

    lines = [fmt(header), *(fmt(r) for r in rows[:-1])]
    lines.append("-" * len(lines[0]))
    lines.append(fmt(rows[-1]))
    return "\n".join(lines)
