"""The timeline page: one self-contained HTML file (inline SVG and CSS, no script, no network).

x is wall-clock time, shared by every process. Each process is a lane: its stage runs, its
pause/resume/step spans (as wide as they took; nested spans one row lower), resident memory per
tag stacked over time (a step function: the state sampled before and after each span, the
first sample being the state before the first event), and the device's memory as tagged /
untagged / free bands (untagged = total - free - tagged: the CUDA context, untagged
allocations and other processes on the device). The table below lists every event with the
resident bytes of every tag after it, and, when any event has some, the memory shared with
other processes through CUDA IPC after it.
"""

from __future__ import annotations

import datetime
import html
import math
from collections.abc import Mapping, Sequence
from typing import Any

from . import _timeline_model as model

# Layout (CSS pixels).
LEFT, PLOT, RIGHT = 150, 1170, 20
AXIS_H, LANE_HEAD, STAGE_H, SLICE_H, RES_H, DEV_H, LANE_GAP = 34, 22, 16, 18, 140, 54, 26
KIND_FILL = {"pause": "#6f6f6f", "resume": "#a9a9a9", "step": "#dcdcdc"}
KIND_TEXT = {"pause": "#fff", "resume": "#111", "step": "#111"}


def _esc(s: object) -> str:
    return html.escape(str(s), quote=True)


def _mib(n: float) -> str:
    if n == 0:
        return "0"
    if abs(n) < (1 << 30):
        return f"{n / (1 << 20):,.1f} MiB"
    return f"{n / (1 << 30):,.2f} GiB"


def _dur(seconds: float) -> str:
    if seconds >= 10:
        return f"{seconds:,.1f} s"
    if seconds >= 1:
        return f"{seconds:.3f} s"
    return f"{seconds * 1e3:.2f} ms"


def _tick_step(span: float) -> float:
    raw = span / 8
    mag = 10 ** math.floor(math.log10(raw))
    return float(next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw))


def _tick_label(v: float, step: float) -> str:
    if step >= 1:
        return f"{round(v, 6):g} s"
    return f"{round(v * 1e3, 6):g} ms"


class _Axis:
    def __init__(self, lo: float, hi: float, t0: float) -> None:
        self.lo, self.hi, self.t0 = lo, hi, t0

    def x(self, t: float) -> float:
        return LEFT + (t - self.lo) / (self.hi - self.lo) * PLOT


def _segments(p: model.Process, pad: float, axis: _Axis) -> list[tuple[float, float, model.Sample]]:
    """(from, to, state) over the lane: the first state from a little before the first event,
    each sample's state until the next sample, the last one a little past the last event."""
    samples = p.samples()
    out: list[tuple[float, float, model.Sample]] = []
    if not samples:
        return out
    if "resident_before" not in p.events[0]:  # version 1 events: the starting state is unknown
        out.append((samples[0].t, samples[0].t, samples[0]))
    else:
        out.append((max(axis.lo, samples[0].t - pad), samples[0].t, samples[0]))
    for a, b in zip(samples, samples[1:], strict=False):
        out.append((a.t, b.t, a))
    out.append((samples[-1].t, min(axis.hi, samples[-1].t + pad), samples[-1]))
    merged: list[tuple[float, float, model.Sample]] = []
    for seg in out:
        if merged and _same(merged[-1][2], seg[2]):
            merged[-1] = (merged[-1][0], seg[1], merged[-1][2])
        elif seg[1] > seg[0]:
            merged.append(seg)
    return merged


def _same(a: model.Sample, b: model.Sample) -> bool:
    keys = set(a.resident) | set(b.resident)
    return (all(a.resident.get(k, 0) == b.resident.get(k, 0) for k in keys)
            and a.free == b.free and a.total == b.total)


def _rect(x0: float, x1: float, y: float, h: float, fill: str, title: str, extra: str = "") -> str:
    w = max(x1 - x0, 0.6)
    return (f'<rect {extra}x="{x0:.2f}" y="{y:.2f}" width="{w:.2f}" height="{h:.2f}" fill="{fill}">'
            f"<title>{_esc(title)}</title></rect>")


def _lane(p: model.Process, tags: list[str], axis: _Axis, peak: int, pad: float, top: float) -> tuple[list[str], float]:
    parts: list[str] = []
    rel = axis.t0
    y = top
    n = len(p.events)
    device = "" if p.device is None else f" · device {p.device}"
    total = next((e.get("device_total") for e in reversed(p.events) if e.get("device_total")), None)
    parts.append(f'<text class="lane" x="4" y="{y + 15:.1f}">process {p.pid}{_esc(device)}'
                 f'<tspan class="note" dx="12">{n} events'
                 + (f" · device total {_esc(_mib(total))}" if total else "") + "</tspan></text>")
    y += LANE_HEAD
    # Stage runs.
    parts.append(f'<text class="axis" x="{LEFT - 6}" y="{y + 12:.1f}" text-anchor="end">stages</text>')
    for st, a, b, _tid in p.stage_runs():
        x0, x1 = axis.x(a), axis.x(b)
        parts.append(_rect(x0, x1, y + 1, STAGE_H - 3, "#eeeeee",
                           f"stage {st}: {_dur(b - a)} from +{_dur(a - rel)}", 'class="stage" stroke="#999" '))
        if x1 - x0 > 7 * len(st) + 8:
            parts.append(f'<text class="slabel" x="{x0 + 4:.1f}" y="{y + 11:.1f}">{_esc(st)}</text>')
    y += STAGE_H
    # Spans.
    depth = model.depths(p.events)
    rows = max(depth, default=0) + 1
    parts.append(f'<text class="axis" x="{LEFT - 6}" y="{y + 13:.1f}" text-anchor="end">steps</text>')
    for e, d in zip(p.events, depth, strict=True):
        a, b = model.start(e), model.end(e)
        x0, x1 = axis.x(a), axis.x(b)
        kind = str(e.get("kind")) if e.get("kind") in KIND_FILL else "step"
        title = f"{e['label']}" + (f" (stage {e['stage']})" if e.get("stage") else "") + \
            f": {_dur(b - a)}, from +{_dur(a - rel)}" + (f"; {e['error']}" if e.get("error") else "")
        extra = f'class="span" data-kind="{kind}" ' + ('stroke="#d00000" stroke-width="2" ' if e.get("error") else "")
        yy = y + d * SLICE_H
        parts.append(_rect(x0, x1, yy + 1, SLICE_H - 3, KIND_FILL[kind], title, extra))
        if x1 - x0 > 6.2 * len(e["label"]) + 8:
            parts.append(f'<text class="slabel" x="{x0 + 4:.1f}" y="{yy + 12:.1f}" '
                         f'fill="{KIND_TEXT[kind]}">{_esc(e["label"])}</text>')
    y += rows * SLICE_H + 16
    # Resident memory per tag.
    segs = _segments(p, pad, axis)
    parts.append(f'<line x1="{LEFT}" y1="{y + RES_H:.1f}" x2="{LEFT + PLOT}" y2="{y + RES_H:.1f}" stroke="#333"/>')
    parts.append(f'<line x1="{LEFT}" y1="{y:.1f}" x2="{LEFT}" y2="{y + RES_H:.1f}" stroke="#333"/>')
    for frac in (0.0, 0.5, 1.0):
        yy = y + RES_H - frac * RES_H
        parts.append(f'<text class="axis" x="{LEFT - 6}" y="{yy + 4:.1f}" text-anchor="end">'
                     f'{_esc(_mib(peak * frac) if frac else "0")}</text>')
    parts.append(f'<text class="axis" x="{LEFT - 6}" y="{y + RES_H / 2 - 14:.1f}" text-anchor="end">resident</text>')
    if segs and "resident_before" in p.events[0]:
        x0, x1 = axis.x(segs[0][0]), axis.x(model.start(p.events[0]))
        parts.append(f'<text class="note" x="{x0 + 2:.1f}" y="{y - 2:.1f}">start</text>')
        parts.append(f'<line x1="{x1:.2f}" y1="{y - 10:.1f}" x2="{x1:.2f}" y2="{y + RES_H:.1f}" stroke="#555" '
                     'stroke-dasharray="3 3"/>')
    for a, b, s in segs:
        x0, x1 = axis.x(a), axis.x(b)
        base = y + RES_H
        for t in tags:
            v = s.resident.get(t, 0)
            if v <= 0:
                continue
            h = v / peak * RES_H
            base -= h
            parts.append(_rect(x0, x1, base, h, model.colour(t),
                               f"{t}: {_mib(v)} (+{_dur(a - rel)} to +{_dur(b - rel)})",
                               f'class="series" data-tag="{_esc(t)}" '))
    y += RES_H + 8
    # Device memory: tagged, untagged, free.
    parts.append(f'<text class="axis" x="{LEFT - 6}" y="{y + 14:.1f}" text-anchor="end">device</text>')
    if not total:
        parts.append(f'<text class="note" x="{LEFT + 4}" y="{y + 14:.1f}">device total not recorded '
                     "(events of an older memsaver): no untagged/free bands</text>")
        return parts, y + 24 - top
    parts.append(f'<text class="axis" x="{LEFT - 6}" y="{y + 28:.1f}" text-anchor="end">{_esc(_mib(total))}</text>')
    for a, b, s in segs:
        if s.free is None or s.total is None:
            continue
        x0, x1 = axis.x(a), axis.x(b)
        scale = DEV_H / s.total
        base = y + DEV_H
        window = f"(+{_dur(a - rel)} to +{_dur(b - rel)})"
        for t in tags:
            v = s.resident.get(t, 0)
            if v > 0:
                base -= v * scale
                parts.append(_rect(x0, x1, base, v * scale, model.colour(t), f"{t}: {_mib(v)} {window}",
                                   f'class="series-dev" data-tag="{_esc(t)}" '))
        u = s.untagged() or 0
        base -= u * scale
        parts.append(_rect(x0, x1, base, u * scale, model.UNTAGGED, f"untagged: {_mib(u)} {window}",
                           'class="band" data-band="untagged" '))
        f = min(s.free, s.total)
        parts.append(_rect(x0, x1, max(y, base - f * scale), min(f * scale, base - y), model.FREE,
                           f"free: {_mib(s.free)} of {_mib(s.total)} {window}", 'class="band" data-band="free" '))
    parts.append(f'<rect x="{LEFT}" y="{y:.1f}" width="{PLOT}" height="{DEV_H}" fill="none" stroke="#999"/>')
    return parts, y + DEV_H - top


def _count(n: int, what: str) -> str:
    return f"{n} {what}" + ("" if n == 1 else "s")


def _shared_cell(e: Mapping[str, Any]) -> str:
    """The memory shared with other processes after ``e``, in a few words: each tag that gave
    out handles, then the imports of other processes' memory."""
    parts = []
    exports = model.shared_exports(e)
    for tag in model.tag_order(set(exports)):
        x = exports[tag]
        parts.append(f"{tag}: {_mib(x['bytes'])} exported, {_count(x['handles'], 'handle')}, "
                     f"{_count(x['importers'], 'importer')}")
    imports = model.shared_imports(e)
    if imports["count"]:
        parts.append(f"{_count(imports['count'], 'import')}: {_mib(imports['bytes'])}"
                     + (f", {imports['paused']} paused" if imports["paused"] else ""))
    return "; ".join(parts)


def _table(evts: Sequence[Mapping[str, Any]], procs: list[model.Process], tags: list[str], t0: float) -> str:
    shared = model.has_shared(evts)  # the column only where some memory was shared
    head = (["pid", "device", "stage", "event", "start", "ms"] + tags + ["untagged", "device free"]
            + (["shared (CUDA IPC)"] if shared else []) + ["error"])
    rows: list[tuple[float, int, str]] = []

    def cells(pid: Any, e: Mapping[str, Any] | None, s: model.Sample, prev: Mapping[str, int] | None,
              label: str, t: float, ms: str) -> str:
        out = [f"<td>{_esc(pid)}</td>", f"<td>{_esc('' if e is None else e.get('device', ''))}</td>",
               f"<td>{_esc('' if e is None else e.get('stage') or '')}</td>", f"<td class='ev'>{_esc(label)}</td>",
               f"<td class='n'>+{_esc(_dur(t - t0))}</td>", f"<td class='n'>{_esc(ms)}</td>"]
        for tag in tags:
            v = s.resident.get(tag, 0)
            changed = prev is not None and prev.get(tag, 0) != v
            out.append(f"<td class='n{' chg' if changed else ''}'>{_esc(_mib(v))}</td>")
        u = s.untagged()
        out.append(f"<td class='n'>{_esc('' if u is None else _mib(u))}</td>")
        out.append(f"<td class='n'>{_esc('' if s.free is None else _mib(s.free))}</td>")
        if shared:
            out.append(f"<td class='shared'>{_esc('' if e is None else _shared_cell(e))}</td>")
        out.append(f"<td class='err'>{_esc(e.get('error', '') if e is not None else '')}</td>")
        return "".join(out)

    for p in procs:
        first = p.events[0]
        if "resident_before" in first:
            s = model.Sample(model.start(first), first["resident_before"], first.get("device_free_before"),
                             first.get("device_total"))
            row = cells(p.pid, None, s, None, "(state before the first event)", s.t, "")
            rows.append((s.t, 0, f"<tr class='start'>{row}</tr>"))
    for e in evts:
        s = model.Sample(model.end(e), e["resident"], e.get("device_free"), e.get("device_total"))
        ms = "" if e.get("seconds") is None else f"{e['seconds'] * 1e3:.2f}"
        row = cells(e["pid"], e, s, e.get("resident_before"), e["label"], model.start(e), ms)
        rows.append((model.start(e), 1, f"<tr>{row}</tr>"))
    rows.sort(key=lambda r: (r[0], r[1]))
    th = "".join(f"<th>{_esc(h)}</th>" for h in head)
    return f'<table id="events"><thead><tr>{th}</tr></thead><tbody>{"".join(r[2] for r in rows)}</tbody></table>'


def render_html(evts: list[dict[str, Any]], title: str = "memsaver timeline") -> str:
    """A self-contained page (inline SVG, no script): every process on one wall-clock axis."""
    procs = model.processes(evts)
    tags = model.tags_of(evts)
    if evts:
        lo = min(model.start(e) for e in evts)
        hi = max(model.end(e) for e in evts)
    else:
        lo = hi = 0.0
    span = hi - lo if hi > lo else 1e-3
    pad = span * 0.04
    axis = _Axis(lo - pad, hi + pad, lo)
    peak = max((sum(s.resident.get(t, 0) for t in tags) for p in procs for s in p.samples()), default=0) or 1
    body: list[str] = []
    y = float(AXIS_H)
    for p in procs:
        parts, h = _lane(p, tags, axis, peak, pad, y)
        body.extend(parts)
        y += h + LANE_GAP
    height = y
    width = LEFT + PLOT + RIGHT
    grid: list[str] = []
    step = _tick_step(axis.hi - axis.lo)
    k = math.ceil((axis.lo - lo) / step)
    while lo + k * step <= axis.hi:
        x = axis.x(lo + k * step)
        grid.append(f'<line x1="{x:.2f}" y1="{AXIS_H - 6}" x2="{x:.2f}" y2="{height - LANE_GAP:.1f}" '
                    'stroke="#e6e6e6"/>')
        grid.append(f'<text class="axis" x="{x:.2f}" y="{AXIS_H - 10}" text-anchor="middle">'
                    f"{_esc(_tick_label(k * step, step))}</text>")
        k += 1
    grid.append(f'<text class="axis" x="{LEFT - 6}" y="{AXIS_H - 10}" text-anchor="end">time</text>')
    svg = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height:.0f}" role="img" '
           f'aria-label="memory timeline of {len(procs)} processes">' + "".join(grid) + "".join(body) + "</svg>")
    swatch = '<span class="key"><span class="swatch" style="background:{}"></span>{}</span>'
    legend = "".join(swatch.format(model.colour(t), _esc(t)) for t in tags)
    legend += swatch.format(model.UNTAGGED, "untagged (context, other allocations, other processes)")
    legend += swatch.format(model.FREE, "free")
    kinds = "".join(swatch.format(c, k) for k, c in KIND_FILL.items())
    shared = (" The shared column is the memory shared with other processes through CUDA IPC after each "
              "event: per tag, the bytes this process exported, their handles and the processes that have "
              "them open; then its imports of other processes' memory, and how many their owner paused."
              if model.has_shared(evts) else "")
    when = datetime.datetime.fromtimestamp(lo, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{_esc(title)}</title>
<style>
body {{ font-family: sans-serif; margin: 24px; color: #222; background: #fff; }}
h1 {{ font-size: 24px; margin: 0 0 8px; }}
p {{ margin: 4px 0 8px; font-size: 14px; max-width: 1300px; }}
.key {{ margin-right: 16px; font-size: 13px; white-space: nowrap; }}
.swatch {{ display: inline-block; width: 13px; height: 13px; margin-right: 5px; vertical-align: middle;
  border: 1px solid #888; }}
svg {{ display: block; margin-top: 10px; }}
svg text {{ font-family: sans-serif; }}
.axis {{ font-size: 11px; fill: #444; }}
.lane {{ font-size: 14px; font-weight: bold; }}
.note {{ font-size: 11px; fill: #666; }}
.slabel {{ font-size: 10px; }}
table {{ border-collapse: collapse; font-size: 12px; margin-top: 16px; }}
td, th {{ border: 1px solid #ccc; padding: 2px 6px; white-space: nowrap; }}
th {{ background: #f4f4f4; }}
td.n {{ text-align: right; font-variant-numeric: tabular-nums; }}
td.chg {{ font-weight: bold; }}
td.err {{ color: #b00000; }}
tr.start td {{ background: #f7f7f7; font-style: italic; }}
</style></head>
<body>
<h1>{_esc(title)}</h1>
<p>{len(evts)} events of {len(procs)} process{"es" if len(procs) != 1 else ""} over {_esc(_dur(hi - lo))},
from {_esc(when)}. x: wall-clock time, shared by all processes; each pause, resume and profile step is a
span as long as it took. Per process: resident memory per tag (a step function, sampled before and after
each span; "start" is the state before the first event) and the device's memory: tagged, untagged
(total - free - tagged) and free. Hover a shape for its values; the table lists every event.{shared}</p>
<div id="legend">{legend}</div>
<div id="kinds">{kinds}</div>
{svg}
{_table(evts, procs, tags, lo)}
</body></html>
"""
