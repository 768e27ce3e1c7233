"""Staged pause/resume profiles on the fake driver: parsing, the bad-file corpus, running."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import memsaver
import pytest
from helpers import CUDA_SUCCESS, MiB, pattern, read, write
from memsaver import _memsaver

BAD = sorted((pathlib.Path(__file__).parent / "profiles" / "bad").glob("*.yaml"))
EXAMPLE = pathlib.Path(__file__).parents[2] / "docs" / "examples" / "verl_grpo.yaml"


@pytest.mark.parametrize("path", BAD, ids=[p.name for p in BAD])
def test_bad_profiles_name_file_line_column_and_reason(path):
    expected = path.read_text().splitlines()[0].removeprefix("# expect: ")
    with pytest.raises(memsaver.ProfileError) as e:
        memsaver.parse_profile(path.read_text(), path.name)
    first = str(e.value).splitlines()[0]
    assert first.startswith(expected), first


def test_corpus_covers_the_kinds_of_mistake():
    assert len(BAD) >= 10


def test_check_command_validates_files(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "memsaver", "check", str(EXAMPLE), str(BAD[0])],
        capture_output=True, text=True,
    )
    assert r.returncode == 1
    assert "verl_grpo.yaml: ok (version 1; tags: cuda_graph, kv_cache, nccl, weights" in r.stdout
    assert "callbacks: sync_weights" in r.stdout
    assert BAD[0].name in r.stderr


def _profile(tmp_path, tag, tag2):
    text = f"""version: 1
tags:
  {tag}: {{backup: cpu}}
  {tag2}: {{}}
stages:
  sleep:
    - pause: [{tag2}]
    - pause: [{tag}]
    - assert: {{released: {tag}}}
  wake:
    - resume: [{tag}]
    - call: sync_weights
    - resume: [{tag2}]
    - assert: {{free_gib_at_least: 0.001}}
"""
    path = tmp_path / "p.yaml"
    path.write_text(text)
    return memsaver.load_profile(str(path))


def test_run_stages_with_callbacks_and_report(tmp_path, tag, tag2):
    profile = _profile(tmp_path, tag, tag2)
    assert profile.tags == {tag: "cpu", tag2: "discard"}
    w = _memsaver.malloc(4 * MiB, 0, tag, profile.tags[tag])
    _memsaver.malloc(2 * MiB, 0, tag2, "discard")
    data = pattern(4 * MiB)
    write(w, data)

    sleep = profile.run("sleep")
    assert [s.description for s in sleep.steps] == [
        f"pause {tag2}", f"pause {tag}", f"assert {tag} released"
    ]
    assert sleep.steps[0].resident_before[tag2] == 2 * MiB
    assert sleep.steps[0].resident_after[tag2] == 0
    assert sleep.steps[1].resident_after[tag] == 0
    assert all(s.seconds >= 0 for s in sleep.steps)

    seen = []

    def sync():
        # Runs with the weights resident again and the second tag still paused.
        seen.append((memsaver.stats().tags[tag].resident_bytes, memsaver.stats().tags[tag2].paused))

    wake = profile.run("wake", callbacks={"sync_weights": sync})
    assert seen == [(4 * MiB, True)]
    assert read(w, len(data)) == data
    assert wake.steps[-1].description.startswith("assert free >=")
    assert "stage 'wake'" in str(wake)


def test_missing_callback_and_unknown_stage(tmp_path, tag, tag2):
    profile = _profile(tmp_path, tag, tag2)
    with pytest.raises(memsaver.ProfileStepError, match="calls sync_weights but no such callback"):
        profile.run("wake")
    with pytest.raises(memsaver.ProfileStepError, match="no stage 'nap'"):
        profile.run("nap")


def test_failed_step_names_stage_step_and_line(tmp_path, tag, tag2):
    profile = _profile(tmp_path, tag, tag2)
    _memsaver.malloc(2 * MiB, 0, tag, "cpu")

    def boom():
        raise RuntimeError("sync failed")

    profile.run("sleep")
    expected = r"stage 'wake' step 2 \(call sync_weights, .*line 12\) failed: sync failed"
    with pytest.raises(memsaver.ProfileStepError, match=expected):
        profile.run("wake", callbacks={"sync_weights": boom})
    # Consistent state: the first step's resume happened, the rest did not; running again works.
    s = memsaver.stats().tags
    assert not s[tag].paused and s[tag2].paused
    profile.run("wake", callbacks={"sync_weights": lambda: None})
    assert not memsaver.stats().tags[tag2].paused


def test_assert_free_memory_fails_clearly(tmp_path, tag):
    path = tmp_path / "q.yaml"
    path.write_text(f"version: 1\ntags: {{{tag}: {{}}}}\nstages:\n  s:\n    - assert: {{free_gib_at_least: 100000}}\n")
    with pytest.raises(memsaver.ProfileStepError, match="expected at least 100000.00 GiB"):
        memsaver.load_profile(str(path)).run("s")


def test_profile_region_uses_the_declared_policy(hooks, tmp_path, tag, tag2):
    profile = _profile(tmp_path, tag, tag2)  # tag: backup cpu; tag2: nothing said, discard
    with pytest.raises(memsaver.MemsaverError, match="not declared"):
        with profile.region("other"):
            pass
    ptrs = {}
    for t, policy in ((tag, "cpu"), (tag2, "discard")):
        with profile.region(t):
            current = json.loads(_memsaver.region_current_json())
            ptrs[t] = hooks.malloc_ok(2 * MiB)
        assert (current["tag"], current["policy"]) == (t, policy)
    data = pattern(2 * MiB)
    write(ptrs[tag], data)
    memsaver.pause(tag, tag2)
    # The policy is what the allocations got: the cpu tag is backed up, the other is not.
    s = memsaver.stats().tags
    assert (s[tag].pinned_backup_bytes, s[tag2].backup_bytes) == (2 * MiB, 0)
    memsaver.resume(tag, tag2)
    assert read(ptrs[tag], len(data)) == data
    for p in ptrs.values():
        assert hooks.free(p) == CUDA_SUCCESS


def test_the_verl_example_runs_on_the_fake_driver():
    profile = memsaver.load_profile(str(EXAMPLE))
    ptrs = {t: _memsaver.malloc(2 * MiB, 0, t, b) for t, b in profile.tags.items() if t != "nccl"}
    data = pattern(2 * MiB)
    write(ptrs["weights"], data)
    profile.run("sleep")
    s = memsaver.stats().tags
    assert all(s[t].paused and s[t].resident_bytes == 0 for t in ptrs)
    order = []
    profile.run("wake", callbacks={"sync_weights": lambda: order.append(memsaver.stats().tags["kv_cache"].paused)})
    assert order == [True], "weights are synced before the KV cache comes back"
    assert read(ptrs["weights"], len(data)) == data
    for p in ptrs.values():
        _memsaver.free(p)
