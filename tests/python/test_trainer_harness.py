"""The verdicts of the trainer checks (tests/gpu/megatron_trainer.py, deepspeed_trainer.py), which
run on GPUs only: what makes them fail, checked here on made-up results, and the Megatron profile
they run, parsed by memsaver."""

from __future__ import annotations

import pathlib
import sys

import memsaver

GPU = pathlib.Path(__file__).parents[1] / "gpu"
sys.path.insert(0, str(GPU))

import trainer_harness as th  # noqa: E402

MiB = th.MIB


def _rank(losses, params="p", optimizer="o"):
    return dict(losses=losses, params=params, optimizer=optimizer, failures=[], cycles=[],
                context_bytes=0, trainer="t", optimizer_class="c")


def _row(cycle=0, freed=1000 * MiB, **resident):
    return dict(cycle=cycle, freed=freed, tag_resident=resident or {"weights": 600 * MiB, "nccl": 400 * MiB},
                stack_lowered=0, nccl_unreleased=0)


def test_identical_runs_pass():
    runs = {m: [_rank([1.5, 1.25]), _rank([1.5, 1.25])] for m in th.MODES}
    assert th.compare(runs) == []


def test_a_loss_or_a_digest_that_differs_fails_naming_mode_and_rank():
    runs = {m: [_rank([1.5, 1.25]), _rank([1.5, 1.25])] for m in th.MODES}
    runs["memsaver"][1] = _rank([1.5, 1.2500001])
    runs["framework"][0] = _rank([1.5, 1.25], optimizer="other")
    failures = th.compare(runs)
    assert len(failures) == 2
    assert failures[0].startswith("framework rank 0: final optimizer")
    assert failures[1].startswith("memsaver rank 1: losses")


def test_pauses_that_free_what_the_tags_held_pass():
    assert th.memsaver_failures([_row(0), _row(1)], handles=[98, 98]) == []


def test_a_rebuilt_communicator_fails():
    failures = th.memsaver_failures([_row(0), _row(1)], handles=[98, 196])
    assert failures == ["NCCL's buffers changed between cycles ([98, 196]): a communicator was rebuilt"]


def test_memory_not_given_back_fails():
    short = _row(1, freed=800 * MiB)
    assert th.memsaver_failures([short], [1]) == [
        "cycle 1: freed 800.0 MiB, less than 90% of the 1000.0 MiB the paused tags held"]
    unreleased = dict(_row(2), nccl_unreleased=64 * MiB)
    assert th.memsaver_failures([unreleased], [1]) == [
        "cycle 2: 64.0 MiB of NCCL's memory not released by the hook"]


def test_a_tag_that_held_nothing_fails():
    empty = _row(0, freed=400 * MiB, weights=0, nccl=400 * MiB)
    assert th.memsaver_failures([empty], [1]) == [
        "cycle 0: tag weights held nothing (a region or the preload missing?)"]


def test_the_megatron_profile_parses_with_its_two_stages():
    profile = memsaver.load_profile(GPU / "megatron_trainer.yaml")
    assert sorted(profile.stages) == ["offload", "onload"]
    assert profile.callbacks() == []
