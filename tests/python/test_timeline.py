"""The memory timeline: events recorded by pause/resume and profile steps, the HTML page, and
its rendering in a real headless Chromium (screenshot checked for every series' colour)."""

from __future__ import annotations

import json
import subprocess
import sys

import memsaver
import pytest
from helpers import MiB
from memsaver import _memsaver, timeline


def _hex(c: str) -> tuple[int, int, int]:
    return int(c[1:3], 16), int(c[3:5], 16), int(c[5:7], 16)


def test_events_html_and_headless_browser(tmp_path, tag, tag2):
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
    memsaver.pause(tag2)
    memsaver.resume(tag2)
    profile.run("sleep")
    profile.run("wake", callbacks={"sync": lambda: None})
    ev = timeline.events()[n0:]
    assert [e["label"] for e in ev] == [
        f"pause {tag2}", f"resume {tag2}", f"pause {tag2}", f"pause {tag}",
        f"resume {tag}", "call sync", f"resume {tag2}",
    ]
    assert [e["stage"] for e in ev] == [None, None, "sleep", "sleep", "wake", "wake", "wake"]
    assert ev[3]["resident"][tag] == 0 and ev[4]["resident"][tag] == 8 * MiB
    assert all(e["device_free"] > 0 and e["seconds"] >= 0 for e in ev)

    events = tmp_path / "events.json"
    timeline.save(str(events))
    assert json.loads(events.read_text())["version"] == 1
    page, png = tmp_path / "t.html", tmp_path / "t.png"
    r = subprocess.run(
        [sys.executable, "-m", "memsaver", "timeline", str(events), "-o", str(page)],
        capture_output=True, text=True,
    )
    assert r.returncode == 0, r.stderr
    text = page.read_text()
    assert f'data-tag="{tag}"' in text and f'data-tag="{tag2}"' in text
    assert "<script" not in text and "http" not in text.replace("http://www.w3.org/2000/svg", "")

    if timeline.browser() is None:
        if __import__("os").environ.get("CI"):
            pytest.fail("CI must have Chromium (.ci/run installs it)")
        pytest.skip("no Chromium on this machine")
    timeline.screenshot(str(page), str(png))
    from png import read_rgb

    width, height, pixels = read_rgb(str(png))
    assert (width, height) == (1400, 1000)
    counts = {c: 0 for c in timeline.PALETTE[:2]}
    for p in pixels:
        for c in counts:
            if p == _hex(c):
                counts[c] += 1
    # Both series are drawn: the first tag seen (tag2, paused first) and the second.
    assert all(n > 200 for n in counts.values()), counts
    _memsaver.free(a)
    _memsaver.free(b)


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
    assert r.returncode == 1 and "cannot render" in r.stderr


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
