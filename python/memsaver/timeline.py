"""A measured memory timeline: pause/resume calls and profile steps recorded as events (time,
tags, resident bytes per tag, device free memory), and a self-contained HTML page charting
resident memory per tag across the steps of every process.

Recording is off by default. Turn it on with :func:`enable` or ``MEMSAVER_TIMELINE=PATH`` (the
events are written to PATH, with ``{pid}`` replaced by the process id, at exit and on
:func:`save`). Render with ``python -m memsaver timeline events.json [more.json] -o out.html``.
"""

from __future__ import annotations

import atexit
import html
import json
import os
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any

_lock = threading.Lock()  # guards _events and _path
_context = threading.local()  # .stage: the profile stage running on this thread, if any
_events: list[dict[str, Any]] | None = None
_path: str | None = None

# Colours of the series, one per tag in order of appearance (then cycled).
PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf"]


def enable(path: str | None = None) -> None:
    """Starts recording events in this process; ``path`` (optional, ``{pid}`` expanded) is
    where :func:`save` and process exit write them."""
    global _events, _path
    with _lock:
        if _events is None:
            _events = []
            atexit.register(_save_at_exit)
        if path:
            _path = path.replace("{pid}", str(os.getpid()))


def enabled() -> bool:
    return _events is not None


def _from_env() -> None:
    p = os.environ.get("MEMSAVER_TIMELINE")
    if p and _events is None:
        enable(p)


def events() -> list[dict[str, Any]]:
    """A copy of the events recorded so far."""
    with _lock:
        return list(_events or [])


class stage_context:
    """Marks the events recorded on this thread inside the block as steps of ``stage``."""

    def __init__(self, stage: str) -> None:
        self.stage, self.outer = stage, None

    def __enter__(self) -> None:
        self.outer = getattr(_context, "stage", None)
        _context.stage = self.stage

    def __exit__(self, *exc: object) -> None:
        _context.stage = self.outer


def record(kind: str, label: str, seconds: float | None = None) -> None:
    """Appends an event with the current resident bytes per tag (no-op when not recording)."""
    if _events is None:
        return
    stage = getattr(_context, "stage", None)
    from . import _torch, device_memory, stats

    s = stats()
    torch = _torch.cuda_initialized()
    device = torch.cuda.current_device() if torch is not None else 0
    try:
        free = device_memory(device)[0]
    except Exception:  # a process without that device: keep the event without it
        free = None
    ev = {
        "time": time.time(),
        "pid": os.getpid(),
        "kind": kind,
        "label": label,
        "stage": stage,
        "seconds": seconds,
        "resident": {name: t.resident_bytes for name, t in s.tags.items()},
        "device": device,
        "device_free": free,
    }
    with _lock:
        if _events is not None:
            _events.append(ev)


def save(path: str | None = None) -> str:
    """Writes the events as JSON to ``path`` (or the path given to :func:`enable`)."""
    target = path or _path
    if not target:
        raise ValueError("no path: pass one, or enable(path) / MEMSAVER_TIMELINE=PATH")
    with open(target, "w", encoding="utf-8") as f:
        json.dump({"version": 1, "events": events()}, f)
    return target


def _save_at_exit() -> None:
    if _path:
        try:
            save()
        except OSError:
            pass


def load(paths: Iterable[str]) -> list[dict[str, Any]]:
    """Events of several files (processes), in time order."""
    out: list[dict[str, Any]] = []
    for p in paths:
        with open(p, encoding="utf-8") as f:
            data = json.load(f)
        out.extend(data["events"] if isinstance(data, Mapping) else data)
    return sorted(out, key=lambda e: e["time"])


def _mib(n: float) -> str:
    return f"{n / (1 << 20):,.0f} MiB" if n < (1 << 30) else f"{n / (1 << 30):.2f} GiB"


def _row(e: Mapping[str, Any]) -> str:
    ms = "" if e.get("seconds") is None else f"{e['seconds'] * 1e3:.2f}"
    free = "" if e.get("device_free") is None else _mib(e["device_free"])
    cells = [
        str(e["pid"]), str(e.get("device", "")), str(e.get("stage") or ""), e["label"], ms, free
    ]
    return "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>"


def render_html(evts: list[dict[str, Any]], title: str = "memsaver timeline") -> str:
    """A self-contained page (inline SVG, no script) with one stacked-bar chart per process:
    one bar per event, one colour per tag, height = resident bytes."""
    tags: list[str] = []
    for e in evts:
        for t, b in e["resident"].items():
            if t not in tags and b > 0:
                tags.append(t)
    colour = {t: PALETTE[i % len(PALETTE)] for i, t in enumerate(tags)}
    by_pid: dict[int, list[dict[str, Any]]] = {}
    for e in evts:
        by_pid.setdefault(e["pid"], []).append(e)
    peak = max((sum(e["resident"].get(t, 0) for t in tags) for e in evts), default=0) or 1
    charts = []
    for pid, pe in by_pid.items():
        bar, gap, height, left = 44, 14, 260, 70
        width = left + len(pe) * (bar + gap) + 160  # room for the last rotated label
        parts = [
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height + 120}" '
            f'role="img" aria-label="resident memory of process {pid}">',
            f'<line x1="{left}" y1="{height}" x2="{width - 10}" y2="{height}" stroke="#333"/>',
            f'<text x="4" y="14" font-size="11">{html.escape(_mib(peak))}</text>',
            f'<text x="4" y="{height}" font-size="11">0</text>',
        ]
        for i, e in enumerate(pe):
            x, y = left + i * (bar + gap), height
            for t in tags:
                b = e["resident"].get(t, 0)
                if b <= 0:
                    continue
                h = max(1.0, b / peak * (height - 20))
                y -= h
                parts.append(
                    f'<rect class="series" data-tag="{html.escape(t)}" x="{x}" y="{y:.1f}" '
                    f'width="{bar}" height="{h:.1f}" fill="{colour[t]}">'
                    f"<title>{html.escape(t)}: {html.escape(_mib(b))}</title></rect>"
                )
            label = html.escape(e["label"] if not e.get("stage") else f"{e['stage']}: {e['label']}")
            parts.append(
                f'<text x="{x + bar / 2}" y="{height + 12}" font-size="10" '
                f'transform="rotate(40 {x + bar / 2} {height + 12})">{label}</text>'
            )
        parts.append("</svg>")
        charts.append(f"<h2>process {pid}</h2>\n" + "\n".join(parts))
    legend = "".join(
        f'<span class="key"><span class="swatch" style="background:{colour[t]}"></span>'
        f"{html.escape(t)}</span>"
        for t in tags
    )
    rows = "".join(_row(e) for e in evts)
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>
body {{ font-family: sans-serif; margin: 24px; color: #222; }}
.key {{ margin-right: 18px; font-size: 14px; }}
.swatch {{ display: inline-block; width: 14px; height: 14px; margin-right: 6px;
  vertical-align: middle; }}
table {{ border-collapse: collapse; font-size: 12px; margin-top: 24px; }}
td, th {{ border: 1px solid #ccc; padding: 2px 8px; }}
</style></head>
<body>
<h1>{html.escape(title)}</h1>
<p>Resident device memory per tag after each pause, resume and profile step (stacked bars).</p>
<div id="legend">{legend}</div>
{"".join(charts)}
<table><tr><th>pid</th><th>device</th><th>stage</th><th>event</th><th>ms</th>
<th>device free</th></tr>{rows}</table>
</body></html>
"""


def write_html(paths: Iterable[str], out: str, title: str = "memsaver timeline") -> str:
    """Renders the events of ``paths`` into the self-contained page ``out``."""
    page = render_html(load(paths), title)
    with open(out, "w", encoding="utf-8") as f:
        f.write(page)
    return out


def browser() -> str | None:
    """A headless-capable Chromium on this machine, if any."""
    import shutil

    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


def screenshot(page: str, png: str, width: int = 1400, height: int = 1000) -> str:
    """Renders ``page`` with headless Chromium into ``png``."""
    import subprocess

    exe = browser()
    if exe is None:
        raise RuntimeError("no Chromium found for the PNG (Debian: apt-get install chromium)")
    cmd = [
        exe, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
        f"--window-size={width},{height}", f"--screenshot={os.path.abspath(png)}",
        "file://" + os.path.abspath(page),
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if r.returncode != 0 or not os.path.exists(png):
        raise RuntimeError(f"Chromium could not render {page}: {r.stderr.strip()[-500:]}")
    return png
