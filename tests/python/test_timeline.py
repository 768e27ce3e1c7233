"""The memory timeline: events recorded by pause/resume and profile steps, the HTML page, and
its rendering in a real headless Chromium (screenshot checked for every series' colour)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import memsaver
import pytest
from helpers import IPC_OPEN, MiB
from memsaver import _memsaver, _timeline_model, timeline


def _hex(c: str) -> tuple[int, int, int]:
    return int(c[1:3], 16), int(c[3:5], 16), int(c[5:7], 16)


def _record(tmp_path, tag, tag2):
    """Records a pause/resume cycle and two profile stages (8 MiB of `tag`, 4 MiB of `tag2`),
    saves the events and frees the memory: (the events recorded, the saved file)."""
    timeline.enable()
    n0 = len(timeline.events())
    profile = memsaver.parse_profile(
        f"""version: 1
tags: {{{tag}: {{backup: cpu}}, {tag2}: {{}}}}
stages:
  sleep: [{{pause: [{tag2}]}}, {{pause: [{tag}]}}]
  wake: [{{resume: [{tag}]}}, {{call: sync}}, {{resume: [{tag2}]}}]
""",
        "t.yaml",
    )
    a = _memsaver.malloc(8 * MiB, 0, tag, "cpu")
    b = _memsaver.malloc(4 * MiB, 0, tag2, "discard")
    try:
        memsaver.pause(tag2)
        memsaver.resume(tag2)
        profile.run("sleep")
        profile.run("wake", callbacks={"sync": lambda: None})
        events = tmp_path / "events.json"
        timeline.save(str(events))
    finally:
        _memsaver.free(a)
        _memsaver.free(b)
    return timeline.events()[n0:], events


def test_pause_resume_and_steps_are_recorded(tmp_path, tag, tag2):
    ev, events = _record(tmp_path, tag, tag2)
    assert [e["label"] for e in ev] == [
        f"pause {tag2}", f"resume {tag2}", f"pause {tag2}", f"pause {tag}",
        f"resume {tag}", "call sync", f"resume {tag2}",
    ]
    assert [e["stage"] for e in ev] == [None, None, "sleep", "sleep", "wake", "wake", "wake"]
    assert ev[3]["resident"][tag] == 0 and ev[4]["resident"][tag] == 8 * MiB
    assert all(e["device_free"] > 0 and e["seconds"] >= 0 for e in ev)

    # Every event holds the state before it too, and the device's total: the starting state and
    # the untagged band come from these.
    assert ev[0]["resident_before"][tag2] == 4 * MiB and ev[0]["resident"][tag2] == 0
    assert ev[0]["tags"] == [tag2] and ev[5].get("tags") is None
    assert all(e["device_total"] >= e["device_free"] and e["start"] <= e["time"] for e in ev)
    assert all(a["time"] <= b["start"] for a, b in zip(ev, ev[1:], strict=False)), "one clock: spans in order"
    # And the memory shared with other processes, after it (test_shared_memory_is_recorded).
    assert all(isinstance(e["shared_exports"], dict) and e["shared_imports"]["count"] == 0 for e in ev)
    assert json.loads(events.read_text())["version"] == 3


def test_the_page_needs_no_browser(tmp_path, tag, tag2):
    """The HTML page, rendered by the command without a browser: checked everywhere."""
    _, events = _record(tmp_path, tag, tag2)
    page = tmp_path / "t.html"
    r = subprocess.run(
        [sys.executable, "-m", "memsaver", "timeline", str(events), "-o", str(page)],
        capture_output=True, text=True,
    )
    assert r.returncode == 0, r.stderr
    text = page.read_text()
    assert f'data-tag="{tag}"' in text and f'data-tag="{tag2}"' in text
    assert 'data-band="untagged"' in text and 'data-band="free"' in text
    assert "(state before the first event)" in text
    rows = len(json.loads(events.read_text())["events"])
    assert text.count("<tr>") == 1 + rows, "every event has its row"
    assert "<script" not in text and "http" not in text.replace("http://www.w3.org/2000/svg", "")


def test_the_page_in_a_headless_browser(tmp_path, tag, tag2):
    """The page as Chromium draws it (screenshot): the only part of the timeline that needs a
    browser. CI installs Chromium (.ci/run), where a skip here is a failure."""
    if timeline.browser() is None:
        pytest.skip("no Chromium on this machine (apt-get install chromium): the screenshot is not checked")
    _, events = _record(tmp_path, tag, tag2)
    page, png = tmp_path / "t.html", tmp_path / "t.png"
    r = subprocess.run(
        [sys.executable, "-m", "memsaver", "timeline", str(events), "-o", str(page), "--png", str(png)],
        capture_output=True, text=True,
    )
    assert r.returncode == 0, r.stderr

    from png import read_rgb

    width, height, pixels = read_rgb(str(png))
    assert width >= 1400 and height > 600  # wider when the table is (many tags: every column is kept)
    counts = {timeline.colour(t): 0 for t in (tag, tag2)}
    for p in pixels:
        for c in counts:
            if p == _hex(c):
                counts[c] += 1
    # Both series are drawn, in their fixed colours.
    assert all(n > 200 for n in counts.values()), counts
    # The whole page is in the screenshot: its last rows are the page's margin below the table.
    assert all(p == (255, 255, 255) for p in pixels[-width * 8:]), "the screenshot cuts the page off"
    assert any(p != (255, 255, 255) for p in pixels[-width * 40:]), "the table ends just above the margin"


def test_colours_are_fixed_per_tag():
    # The well-known tags' colours, written out here (not read from timeline.WELL_KNOWN): a tag
    # has the same colour on every page, of this job and of the next.
    assert {t: timeline.colour(t) for t in ("weights", "optimizer", "kv_cache", "cuda_graph", "nccl")} == {
        "weights": "#1f77b4", "optimizer": "#d62728", "kv_cache": "#2ca02c",
        "cuda_graph": "#ff7f0e", "nccl": "#9467bd",
    }
    # Any other tag: a stable hash into the palette, the same in another process (no
    # PYTHONHASHSEED dependence) and in every release (the values are pinned).
    code = "from memsaver import timeline; print(timeline.colour('rollout_buffers'), timeline.colour('ref_model'))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**__import__("os").environ, "PYTHONHASHSEED": "random"})
    assert r.stdout.split() == ["#3182bd", "#31a354"], r.stderr
    assert timeline.colour("rollout_buffers") == "#3182bd" and timeline.colour("ref_model") == "#31a354"


def _events_of_two_ranks():
    """Two processes on two devices, the second starting 5 ms later; version 2 fields."""
    GiB = 1 << 30
    out = []
    for pid, device, offset in ((101, 0, 0.0), (102, 1, 0.005)):
        t, state, free = 1000.0 + offset, {"weights": GiB, "kv_cache": 4 * GiB}, 60 * GiB
        for kind, label, secs, after in (
            ("pause", "pause kv_cache", 0.002, {"weights": GiB, "kv_cache": 0}),
            ("step", "assert kv_cache released", 0.00005, {"weights": GiB, "kv_cache": 0}),
            ("pause", "pause weights", 1.05, {"weights": 0, "kv_cache": 0}),
            ("resume", "resume weights, kv_cache", 0.08, {"weights": GiB, "kv_cache": 4 * GiB}),
        ):
            freed = sum(state.values()) - sum(after.values())
            e = {"time": t + secs, "start": t, "pid": pid, "tid": pid, "kind": kind, "label": label,
                 "stage": "sleep" if "resume" not in label else "wake", "seconds": secs,
                 "resident_before": state, "resident": after, "device": device,
                 "device_free_before": free, "device_free": free + freed, "device_total": 80 * GiB}
            if kind != "step":
                e["tags"] = [label.split(" ", 1)[1]]
            out.append(e)
            t, state, free = t + secs + 0.01, after, free + freed
    return sorted(out, key=lambda e: e["time"])


def test_page_has_a_time_axis_shared_by_all_processes():
    page = timeline.render_html(_events_of_two_ranks(), "two ranks")
    import re

    spans = [(float(x), float(w), k) for k, x, w in re.findall(
        r'<rect class="span" data-kind="(\w+)" (?:stroke="[^"]*" stroke-width="\d+" )?'
        r'x="([\d.]+)" y="[\d.]+" width="([\d.]+)"', page)]
    assert len(spans) == 8
    widths = [w for _, w, _ in spans]
    # x is time: the 1050 ms pause is about 500 times the 2 ms one, the assert a sliver.
    assert widths[2] / widths[0] > 300 and widths[1] < 1
    # Shared axis: rank 2's first span starts 5 ms to the right of rank 1's.
    px_per_s = widths[2] / 1.05
    assert abs((spans[4][0] - spans[0][0]) - 0.005 * px_per_s) < 1.0
    assert page.count("process 101") == 1 and page.count("process 102") == 1


def _validate_chrome_trace(text: str) -> dict:
    """The rules of the Trace Event Format document (JSON Object Format) that Perfetto and
    chrome://tracing rely on, plus the orderings the export promises."""
    def no_constants(name):
        raise AssertionError(f"{name} is not JSON")

    trace = json.loads(text, parse_constant=no_constants)
    assert isinstance(trace, dict) and isinstance(trace["traceEvents"], list)
    assert trace.get("displayTimeUnit", "ms") in ("ms", "ns")
    last_ts: dict = {}
    open_slices: dict = {}
    named_pids, named_tids = set(), set()
    for ev in trace["traceEvents"]:
        ph = ev["ph"]
        assert isinstance(ev["name"], str) and ev["name"]
        assert isinstance(ev["pid"], int) and isinstance(ev["tid"], int)
        assert isinstance(ev["ts"], (int, float)) and ev["ts"] >= 0
        if ph == "M":
            assert ev["name"] in ("process_name", "process_sort_index", "thread_name", "thread_sort_index",
                                  "process_labels")
            if ev["name"].endswith("_name"):
                assert isinstance(ev["args"]["name"], str)
                (named_pids if ev["name"] == "process_name" else named_tids).add((ev["pid"], ev["tid"]))
            if ev["name"].endswith("sort_index"):
                assert isinstance(ev["args"]["sort_index"], int)
        elif ph == "X":
            assert isinstance(ev["dur"], (int, float)) and ev["dur"] >= 0
            assert isinstance(ev.get("cat", ""), str) and isinstance(ev.get("args", {}), dict)
            track = ("X", ev["pid"], ev["tid"])
            assert ev["ts"] >= last_ts.get(track, 0), f"slices of {track} out of order"
            last_ts[track] = ev["ts"]
            stack = open_slices.setdefault(track, [])
            while stack and stack[-1] <= ev["ts"]:
                stack.pop()
            assert not stack or ev["ts"] + ev["dur"] <= stack[-1] + 1e-3, f"{ev['name']} overlaps its parent"
            stack.append(ev["ts"] + ev["dur"])
            assert (ev["pid"], ev["tid"]) in named_tids, "thread named before its slices"
        elif ph == "C":
            assert ev["args"] and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                      for v in ev["args"].values())
            track = ("C", ev["pid"], ev["name"])
            assert ev["ts"] > last_ts.get(track, -1), f"counter {track} not strictly increasing"
            last_ts[track] = ev["ts"]
        else:
            raise AssertionError(f"unexpected phase {ph}")
    assert {pid for pid, _ in named_pids} == {ev["pid"] for ev in trace["traceEvents"]}
    return trace


def test_chrome_trace_export(tmp_path):
    evts = _events_of_two_ranks()
    events = tmp_path / "ev.json"
    events.write_text(json.dumps({"version": 2, "events": evts}))
    out = tmp_path / "trace.json"
    r = subprocess.run([sys.executable, "-m", "memsaver", "timeline", str(events), "--trace", str(out)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    trace = _validate_chrome_trace(out.read_text())
    te = trace["traceEvents"]
    # Every slice and counter, worked out by hand from _events_of_two_ranks (microseconds since
    # the first event; rank 102 runs 5 ms after rank 101; 10 ms between its spans).
    G = 1 << 30
    spans = [  # (cat, name, ts, dur) of one rank, rank 101's times
        ("stage", "stage sleep", 0, 1_072_050), ("stage", "stage wake", 1_082_050, 80_000),
        ("pause", "pause kv_cache", 0, 2_000), ("step", "assert kv_cache released", 12_000, 50),
        ("pause", "pause weights", 22_050, 1_050_000),
        ("resume", "resume weights, kv_cache", 1_082_050, 80_000),
    ]
    want_slices = sorted((pid, pid, cat, name, ts + shift, dur)
                         for pid, shift in ((101, 0), (102, 5_000)) for cat, name, ts, dur in spans)
    got_slices = sorted((e["pid"], e["tid"], e["cat"], e["name"], e["ts"], e["dur"]) for e in te if e["ph"] == "X")
    assert [s[:4] for s in got_slices] == [s[:4] for s in want_slices]
    assert [s[4:] for s in got_slices] == [pytest.approx(s[4:], abs=1e-3) for s in want_slices]
    resident = [  # (ts, weights, kv_cache) before and after each span of one rank
        (0, G, 4 * G), (2_000, G, 0), (12_000, G, 0), (12_050, G, 0),
        (22_050, G, 0), (1_072_050, 0, 0), (1_082_050, 0, 0), (1_162_050, G, 4 * G),
    ]
    for pid, shift in ((101, 0), (102, 5_000)):
        counters = [e for e in te if e["ph"] == "C" and e["pid"] == pid]
        assert [(e["ts"], e["args"]) for e in counters if e["name"] == "resident bytes"] == [
            (pytest.approx(ts + shift, abs=1e-3), {"weights": w, "kv_cache": kv}) for ts, w, kv in resident
        ]
        # 15 GiB of the device are used by something other than these tags throughout.
        assert [(e["ts"], e["args"]) for e in counters if e["name"] == "device bytes"] == [
            (pytest.approx(ts + shift, abs=1e-3), {"tagged": w + kv, "untagged": 15 * G, "free": 65 * G - w - kv})
            for ts, w, kv in resident
        ]
    slices = [e for e in te if e["ph"] == "X" and e["cat"] != "stage"]
    assert len(slices) == 8
    long = next(e for e in slices if e["name"] == "pause weights" and e["pid"] == 101)
    assert long["dur"] == 1.05e6 and long["cat"] == "pause"  # microseconds
    assert long["args"]["tags"] == ["weights"] and long["args"]["bytes"] == -(1 << 30)
    assert long["args"]["ms"] == 1050.0
    assert {e["args"]["stage"] for e in te if e["ph"] == "X" and e["cat"] == "stage"} == {"sleep", "wake"}
    first = min(e["ts"] for e in slices if e["pid"] == 102)
    assert first == 5000.0, "ts: microseconds since the first event"
    res = [e for e in te if e["ph"] == "C" and e["name"] == "resident bytes" and e["pid"] == 101]
    assert res[0]["ts"] == 0 and res[0]["args"] == {"weights": 1 << 30, "kv_cache": 4 << 30}, "starting state"
    dev = [e for e in te if e["ph"] == "C" and e["name"] == "device bytes" and e["pid"] == 101]
    assert all(sum(e["args"].values()) == 80 << 30 for e in dev), "tagged + untagged + free = total"
    assert dev[0]["args"] == {"tagged": 5 << 30, "untagged": 15 << 30, "free": 60 << 30}


def _with_shared(evts):
    """The events of _events_of_two_ranks with memory shared through CUDA IPC (version 3): rank
    101 gave out a handle of its weights, which rank 102 has open, paused by 101 while its
    weights are (from "pause weights" to "resume weights, kv_cache")."""
    G = 1 << 30
    out = []
    for e in evts:
        e = dict(e)
        if e["pid"] == 101:
            e["shared_exports"] = {"weights": {"bytes": G, "handles": 1, "importers": 1}}
            e["shared_imports"] = {"count": 0, "bytes": 0, "paused": 0}
        else:
            e["shared_exports"] = {}
            e["shared_imports"] = {"count": 1, "bytes": G, "paused": int(e["label"] == "pause weights")}
        out.append(e)
    return out


def test_shared_memory_in_page_and_trace(tmp_path):
    evts = _with_shared(_events_of_two_ranks())
    events = tmp_path / "ev.json"
    events.write_text(json.dumps({"version": 3, "events": evts}))
    loaded = timeline.load([str(events)])
    assert [(e["shared_exports"], e["shared_imports"]) for e in loaded] == [
        (e["shared_exports"], e["shared_imports"]) for e in evts
    ], "round trip"

    page = timeline.render_html(loaded, "shared")
    assert "<th>shared (CUDA IPC)</th>" in page and "The shared column is the memory shared" in page
    cells = [c for c in page.split("<td class='shared'>")[1:]]
    cells = [c[: c.index("</td>")] for c in cells]
    assert len(cells) == 2 + 8, "a cell in every row, the starting states' empty"
    assert cells.count("weights: 1.00 GiB exported, 1 handle, 1 importer") == 4
    assert cells.count("1 import: 1.00 GiB") == 3 and cells.count("1 import: 1.00 GiB, 1 paused") == 1
    assert cells.count("") == 2

    trace = _validate_chrome_trace(json.dumps(timeline.to_chrome_trace(loaded)))
    te = trace["traceEvents"]
    ends = [2_000, 12_050, 1_072_050, 1_162_050]  # rank 101's spans end there (rank 102: 5 ms later)

    def counter(pid, name):
        return [(e["ts"], e["args"]) for e in te if e["ph"] == "C" and e["pid"] == pid and e["name"] == name]

    G = 1 << 30
    assert counter(101, "exported bytes") == [(pytest.approx(ts, abs=1e-3), {"weights": G}) for ts in ends]
    assert counter(101, "imports") == [] and counter(102, "exported bytes") == []
    assert counter(102, "imported bytes") == [(pytest.approx(ts + 5_000, abs=1e-3), {"imported": G}) for ts in ends]
    assert [args for _, args in counter(102, "imports")] == [
        {"mapped": 1, "paused": 0}, {"mapped": 1, "paused": 0}, {"mapped": 0, "paused": 1}, {"mapped": 1, "paused": 0},
    ]
    pause = next(e for e in te if e["ph"] == "X" and e["name"] == "pause weights" and e["pid"] == 102)
    assert pause["args"]["shared_imports"] == {"count": 1, "bytes": G, "paused": 1}
    assert "shared_exports" not in pause["args"]


def test_files_without_shared_memory_still_load(tmp_path):
    """Version 2 files (before the shared fields) load, read as nothing shared: no column on the
    page, no counter in the trace. (Version 1: test_version_1_files_still_render.)"""
    evts = _events_of_two_ranks()
    assert not any("shared_exports" in e or "shared_imports" in e for e in evts)
    events = tmp_path / "ev.json"
    events.write_text(json.dumps({"version": 2, "events": evts}))
    loaded = timeline.load([str(events)])
    assert loaded == evts
    assert all(_timeline_model.shared_exports(e) == {} for e in loaded)
    assert all(_timeline_model.shared_imports(e) == {"count": 0, "bytes": 0, "paused": 0} for e in loaded)
    page = timeline.render_html(loaded)
    assert "shared (CUDA IPC)" not in page and "class='shared'" not in page and "shared column" not in page
    assert page.count("<tr>") == 1 + len(evts)
    names = {e["name"] for e in timeline.to_chrome_trace(loaded)["traceEvents"] if e["ph"] == "C"}
    assert names == {"resident bytes", "device bytes"}
    # Events that recorded nothing shared (version 3, empty fields) read the same.
    empty = [dict(e, shared_exports={}, shared_imports={"count": 0, "bytes": 0, "paused": 0}) for e in evts]
    assert timeline.render_html(empty) == page


# A receiver of the owner's memory (argv: handle, events file): it opens the handle, records an
# event, tells the owner, waits until the owner paused the memory, records another and saves.
IMPORTER = IPC_OPEN + r"""
import sys
from memsaver import timeline
timeline.enable()
rc, p, error = ipc_open(sys.argv[1])
assert rc == 0, error
memsaver.register_tag("own")
memsaver.pause("own")            # an event: the import mapped
print("opened", flush=True)
assert sys.stdin.readline() == "paused\n"
memsaver.resume("own")           # an event: the import paused by its owner
timeline.save(sys.argv[2])
print("saved", flush=True)
"""


def test_shared_memory_is_recorded(tmp_path, hooks, tag):
    """An owner shares memory of a tag with another process, which holds it open while the owner
    pauses: both record it in their events, and the page and the trace show it."""
    timeline.enable()
    n0 = len(timeline.events())
    with memsaver.region(tag, backup="cpu"):
        p = hooks.malloc_ok(2 * MiB)
    mine, theirs = tmp_path / "owner.json", tmp_path / "importer.json"
    child = subprocess.Popen([sys.executable, "-c", IMPORTER, hooks.ipc_handle(p), str(theirs)],
                             env=dict(os.environ), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "opened\n"
        memsaver.pause(tag)      # waits for the importer to release its mapping
        child.stdin.write("paused\n")
        child.stdin.flush()
        assert child.stdout.readline() == "saved\n"
    finally:
        child.stdin.close()
        assert child.wait(timeout=60) == 0
    memsaver.resume(tag)         # the importer exited: released, forgotten
    recorded = timeline.events()[n0:]
    timeline.save(str(mine))
    assert hooks.free(p) == 0

    export = {"bytes": 2 * MiB, "handles": 1, "importers": 1}
    assert [e["label"] for e in recorded] == [f"pause {tag}", f"resume {tag}"]
    assert recorded[0]["shared_exports"][tag] == export, "the importer holds it, paused"
    assert recorded[1]["shared_exports"][tag] == dict(export, importers=0)
    assert all(e["shared_imports"] == {"count": 0, "bytes": 0, "paused": 0} for e in recorded)
    imported = timeline.load([str(theirs)])
    assert [e["shared_imports"] for e in imported] == [
        {"count": 1, "bytes": 2 * MiB, "paused": 0}, {"count": 1, "bytes": 2 * MiB, "paused": 1},
    ]
    assert all(e["shared_exports"] == {} for e in imported)

    both = timeline.load([str(mine), str(theirs)])
    page = timeline.render_html(both)
    assert "<th>shared (CUDA IPC)</th>" in page
    assert f"{tag}: 2.0 MiB exported, 1 handle, 1 importer" in page
    assert "1 import: 2.0 MiB, 1 paused" in page
    trace = _validate_chrome_trace(json.dumps(timeline.to_chrome_trace(both)))
    imports = [e["args"] for e in trace["traceEvents"] if e["ph"] == "C" and e["name"] == "imports"]
    assert imports == [{"mapped": 1, "paused": 0}, {"mapped": 0, "paused": 1}]


def test_trace_of_recorded_events_is_valid(tmp_path, tag):
    timeline.enable()
    n0 = len(timeline.events())
    memsaver.register_tag(tag)
    memsaver.pause(tag)
    memsaver.resume(tag)
    _validate_chrome_trace(json.dumps(timeline.to_chrome_trace(timeline.events()[n0:])))


def test_recording_is_off_by_default_and_env_turns_it_on(tmp_path):
    code = (
        "import memsaver; from memsaver import timeline; "
        "print(timeline.enabled()); memsaver.register_tag('x'); "
        "memsaver.pause('x'); memsaver.resume('x')"
    )
    env = dict(__import__("os").environ)
    env.pop("MEMSAVER_TIMELINE", None)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.stdout.strip() == "False", r.stderr
    out = tmp_path / "ev-{pid}.json"
    env["MEMSAVER_TIMELINE"] = str(out)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.stdout.strip() == "True", r.stderr
    files = list(tmp_path.glob("ev-*.json"))
    assert len(files) == 1, "written at exit, {pid} expanded"
    labels = [e["label"] for e in json.loads(files[0].read_text())["events"]]
    assert labels == ["pause x", "resume x"]


def test_timeline_command_reports_bad_input(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    r = subprocess.run(
        [sys.executable, "-m", "memsaver", "timeline", str(bad), "-o", str(tmp_path / "o.html")],
        capture_output=True, text=True,
    )
    assert r.returncode == 1 and "cannot render" in r.stderr and "no 'events' list" in r.stderr
    r = subprocess.run([sys.executable, "-m", "memsaver", "timeline", str(bad)], capture_output=True, text=True)
    assert r.returncode == 2 and "--trace" in r.stderr


def test_version_1_files_still_render(tmp_path):
    import pathlib

    examples = pathlib.Path(__file__).parents[2] / "docs" / "examples"
    evts = timeline.load([str(examples / "verl_h200x2_events_a.json"), str(examples / "verl_h200x2_events_b.json")])
    page = timeline.render_html(evts)
    assert "device total not recorded" in page and page.count("<tr>") == 1 + len(evts)
    _validate_chrome_trace(json.dumps(timeline.to_chrome_trace(evts)))


def test_demo_command_runs_the_verl_profile_and_writes_the_page(tmp_path):
    import pathlib

    example = pathlib.Path(__file__).parents[2] / "docs" / "examples" / "verl_grpo.yaml"
    r = subprocess.run(
        [sys.executable, "-m", "memsaver", "demo", str(example), "-o", str(tmp_path)],
        capture_output=True, text=True,
    )
    assert r.returncode == 0, r.stderr
    assert "stage 'sleep'" in r.stdout and "stage 'wake'" in r.stdout
    page = (tmp_path / "demo-timeline.html").read_text()
    for tag in ("weights", "kv_cache", "cuda_graph"):
        assert f'data-tag="{tag}"' in page


class _FakeTorch:
    """Stands in for torch in sys.modules: records the NVTX and record_function calls."""

    def __init__(self, calls, cuda=True):
        import types

        self.calls = calls
        self.cuda = types.SimpleNamespace(
            is_available=lambda: cuda,
            is_initialized=lambda: False,
            nvtx=types.SimpleNamespace(range_push=lambda name: calls.append(("push", name)),
                                       range_pop=lambda: calls.append(("pop",))),
        )
        outer = self

        class record_function:
            def __init__(self, name):
                self.name = name

            def __enter__(self):
                outer.calls.append(("enter", self.name))

            def __exit__(self, *exc):
                outer.calls.append(("exit", self.name, exc[0]))

        self.profiler = types.SimpleNamespace(record_function=record_function)


def test_nvtx_and_record_function_ranges(monkeypatch, tag):
    calls = []
    monkeypatch.setitem(sys.modules, "torch", _FakeTorch(calls))
    memsaver.register_tag(tag)
    pause = _memsaver.pause

    def pause_and_note(names):
        calls.append(("pause", tuple(names)))
        pause(names)

    monkeypatch.setattr(_memsaver, "pause", pause_and_note)
    memsaver.pause(tag)
    name = f"memsaver pause {tag}"
    assert calls == [("push", name), ("enter", name), ("pause", (tag,)), ("exit", name, None), ("pop",)]

    # A failing step: the ranges still close, inner first; the error goes on.
    calls.clear()
    profile = memsaver.parse_profile(
        f"version: 1\ntags: {{{tag}: {{}}}}\nstages:\n  check: [{{call: boom}}, {{pause: [{tag}]}}]\n", "t.yaml")

    def boom():
        calls.append(("boom",))
        raise RuntimeError("boom")

    with pytest.raises(memsaver.ProfileStepError, match="boom"):
        profile.run("check", callbacks={"boom": boom})
    step = "memsaver check: call boom"
    assert calls == [("push", step), ("enter", step), ("boom",), ("exit", step, RuntimeError), ("pop",)]


def test_no_ranges_without_cuda_or_torch(monkeypatch, tag):
    calls = []
    monkeypatch.setitem(sys.modules, "torch", _FakeTorch(calls, cuda=False))
    memsaver.register_tag(tag)
    memsaver.pause(tag)
    memsaver.resume(tag)
    assert calls == []
    monkeypatch.delitem(sys.modules, "torch")
    memsaver.pause(tag)
    assert "torch" not in sys.modules, "memsaver never imports torch"
