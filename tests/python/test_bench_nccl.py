"""`memsaver bench nccl --fake`: real rank processes under the preload on the fake driver and
the fake NCCL (tests/fake-nccl), as a user runs it; its lines, its failures and its flags."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

FIELDS = {
    "rank", "ranks", "comms", "mode", "pause_ms", "resume_ms", "calls_per_pause", "calls_per_resume",
    "calls_first_pause", "bytes_copied_per_pause", "bytes_copied_per_resume", "freed_pct",
}
MIB = 1 << 20


@pytest.fixture
def bench_env(child_env) -> dict[str, str]:
    nccl = os.environ.get("MEMSAVER_FAKE_NCCL_LIB") or os.path.join(
        os.path.dirname(os.environ["MEMSAVER_CUDA_LIB"]), "..", "fake-nccl", "libnccl.so.2"
    )
    if not os.path.exists(nccl):
        pytest.skip(f"no fake NCCL at {nccl}: build it with `make fake-cuda`")
    return dict(child_env, MEMSAVER_FAKE_NCCL_LIB=nccl)


def bench(env: dict[str, str], *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "memsaver", "bench", "nccl", "--fake", *flags],
        env=env, capture_output=True, text=True, timeout=120,
    )


def lines(r: subprocess.CompletedProcess[str]) -> list[dict[str, object]]:
    out = [json.loads(line.removeprefix("NCCL_BENCH ")) for line in r.stdout.splitlines()]
    assert len(out) == len(r.stdout.splitlines()), r.stdout
    return out


def test_pause_calls_and_bytes_do_not_grow_with_communicators(bench_env):
    calls, copied = {}, {}
    for comms in (1, 4):
        r = bench(bench_env, "--ranks", "2", "--comms", str(comms), "--cycles", "2")
        assert r.returncode == 0, r.stdout + r.stderr
        got = lines(r)
        assert [g["rank"] for g in got] == [0, 1], r.stdout
        for g in got:
            assert set(g) == FIELDS, g
            assert (g["ranks"], g["comms"], g["mode"]) == (2, comms, "memsaver")
            assert len(g["pause_ms"]) == len(g["resume_ms"]) == 2  # type: ignore[arg-type]
            assert all(t > 0 for t in g["pause_ms"] + g["resume_ms"]), g  # type: ignore[operator]
            assert g["freed_pct"] > 0, g  # type: ignore[operator]
            assert g["calls_per_pause"] > 0 and g["calls_per_resume"] > 0, g  # type: ignore[operator]
        calls[comms] = {g["rank"]: g["calls_per_pause"] for g in got}
        copied[comms] = {g["rank"]: (g["bytes_copied_per_pause"], g["bytes_copied_per_resume"]) for g in got}
    # After the first resume each rank backs its buffers with one physical allocation and maps
    # each peer's whole, once: a pause's driver calls do not depend on the communicators.
    assert calls[1] == calls[4], calls
    # Each communicator's 3 private 2 MiB buffers hold a few KiB (as NCCL's do) and its shared
    # buffer a 64 KiB header kept: only the blocks that hold something are copied, about 88 KiB
    # per communicator where whole copies would be 6 MiB and 64 KiB.
    for rank in (0, 1):
        one, four = copied[1][rank], copied[4][rank]
        assert one[0] == one[1] and four[0] == four[1], copied
        assert 0 < one[0] < 128 << 10, copied
        assert four[0] <= one[0] + 16 * MIB and four[0] < 4 * (128 << 10), copied


def test_more_buffers_per_communicator_copy_more_and_call_the_driver_as_often(bench_env):
    # --buffers lays out NCCL's count of private buffers: each holds a few KiB, so a pause
    # copies more blocks, in the same runs (the same calls), and every byte still comes back.
    got = {}
    for buffers in (2, 10):
        r = bench(bench_env, "--ranks", "2", "--cycles", "2", "--buffers", str(buffers))
        assert r.returncode == 0, r.stdout + r.stderr
        got[buffers] = {g["rank"]: (g["calls_per_pause"], g["bytes_copied_per_pause"]) for g in lines(r)}
    for rank in (0, 1):
        (calls2, bytes2), (calls10, bytes10) = got[2][rank], got[10][rank]
        assert calls10 == calls2, got
        # 8 more buffers, each with its live bytes in two 4 KiB blocks, each block copied with
        # its 4-byte index entry (the packed layout, allocator/src/packed.rs).
        assert bytes10 - bytes2 == 8 * 2 * (4096 + 4), got


def test_chunks_make_the_first_pause_release_per_chunk_not_per_buffer(bench_env):
    # MEMSAVER_NCCL_CHUNK_MB carves NCCL's buffers from physical allocations made ahead, and a
    # peer's first import maps a chunk whole: the first pause then releases one allocation per
    # chunk, own and imported, as later pauses release one per run; without chunks it releases
    # each buffer. Every byte still comes back (cpu backup, junk in fresh memory).
    env = dict(bench_env, MEMSAVER_NCCL_BACKUP="cpu", FAKE_CUDA_FRESH="junk")
    got = {}
    for chunk in ("0", "64"):
        r = bench(dict(env, MEMSAVER_NCCL_CHUNK_MB=chunk), "--ranks", "3", "--comms", "3", "--buffers", "10",
                  "--cycles", "2")
        assert r.returncode == 0, chunk + r.stdout + r.stderr
        got[chunk] = [(g["calls_first_pause"], g["calls_per_pause"]) for g in lines(r)]
    for (plain, steady), (chunked, chunked_steady) in zip(got["0"], got["64"], strict=True):
        assert chunked_steady == steady, got
        # 42 buffers of its own and 6 imports each: an unmap and a release apiece without chunks.
        assert plain == 2 * (42 + 6), got
        # Two chunks of its own and at most two of each peer's.
        assert chunked <= 2 * (2 + 2 * 2) and chunked <= 2 * steady, got


def test_every_byte_comes_back_with_cpu_and_the_headers_with_the_default(bench_env):
    # The ranks read every byte of each peer's shared buffers after each resume with `cpu`, and
    # their first 64 KiB with `headers` (the default): what NCCL keeps across collectives. Fresh
    # device memory holds junk: the zeros of the private buffers come back only because resume
    # zero-fills what the packed backups leave out.
    for policy in ("cpu", "headers"):
        env = dict(bench_env, MEMSAVER_NCCL_BACKUP=policy, FAKE_CUDA_FRESH="junk")
        r = bench(env, "--ranks", "2", "--comms", "2", "--cycles", "2")
        assert r.returncode == 0, policy + r.stdout + r.stderr
        assert len(lines(r)) == 2, r.stdout
    # `discard` keeps nothing of them, and the bench sees it does not check what is not kept.
    r = bench(dict(bench_env, MEMSAVER_NCCL_BACKUP="discard"), "--ranks", "2", "--cycles", "1")
    assert r.returncode == 1 and "private buffer 0" in r.stderr, r.stdout + r.stderr


def test_one_rank_is_refused(bench_env):
    r = bench(bench_env, "--ranks", "1")
    assert r.returncode == 2 and r.stdout == ""
    assert "--ranks 1: NCCL's communicators need 2 or more ranks" in r.stderr, r.stderr


def test_a_rank_that_fails_fails_the_run_naming_it(bench_env):
    # Rank 1's driver cannot create memory after its first few allocations: the fake NCCL's
    # set-up fails there, and the run says which rank and why, with that rank's stderr.
    env = dict(bench_env, FAKE_CUDA_FAIL_CREATE_AT="3")
    r = bench(env, "--ranks", "2", "--comms", "2", "--cycles", "1", "--timeout", "30")
    assert r.returncode == 1, r.stdout + r.stderr
    assert r.stdout == ""
    assert "memsaver bench nccl: rank " in r.stderr and "the fake NCCL could not allocate" in r.stderr, r.stderr
    assert "[rank " in r.stderr  # the rank's own stderr, forwarded


def test_a_rank_that_does_not_finish_is_killed_and_reported(bench_env):
    r = bench(bench_env, "--ranks", "2", "--comms", "1", "--cycles", "50", "--timeout", "0.5")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "did not finish within 0.5 s (killed)" in r.stderr or "did not reach barrier" in r.stderr, r.stderr


def test_help_and_the_missing_fake_nccl(bench_env):
    r = subprocess.run([sys.executable, "-m", "memsaver", "bench", "nccl", "--help"],
                       env=bench_env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    for flag in ("--ranks", "--comms", "--fake", "--fake-nccl", "--buffers", "--cycles", "--mib", "--native",
                 "--timeout"):
        assert flag in r.stdout, r.stdout
    env = dict(bench_env, MEMSAVER_FAKE_NCCL_LIB="/nonexistent/libnccl.so.2")
    r = bench(env)
    assert r.returncode == 1 and "make fake-cuda" in r.stderr, r.stderr
    r = bench(bench_env, "--native")
    assert r.returncode == 2 and "--native" in r.stderr and "fake NCCL lacks" in r.stderr, r.stderr
    r = bench(bench_env, "--fake-nccl")
    assert r.returncode == 2 and "--fake and --fake-nccl: give one" in r.stderr, r.stderr
    r = bench(bench_env, "--buffers", "0")
    assert r.returncode == 2 and "--buffers 0: give 1 or more" in r.stderr, r.stderr


def test_the_nccl_version_code_is_read_as_nccl_writes_it():
    from memsaver._bench_nccl import NATIVE_MIN, nccl_version

    assert nccl_version(22809) == (2, 28, 9)
    assert nccl_version(23007) == (2, 30, 7)
    assert nccl_version(2708) == (2, 7, 8)
    assert nccl_version(22809) < NATIVE_MIN <= nccl_version(23007)
