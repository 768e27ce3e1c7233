#!/usr/bin/env python3
"""GPU check of memsaver in an RL loop built the way verl and slime build theirs, on one GPU.

One process holds both sides, as in verl's colocated ("hybrid engine") mode:

* trainer: a small Llama (transformers, built from a config, random init with a fixed seed, no
  download) under FSDP2 (``fully_shard`` on each decoder layer and on the model) over an NCCL
  process group of world size 1, AdamW. Weights in ``memsaver.region("actor_weights",
  backup="cpu")``, optimizer state (created by the first ``optimizer.step()``) in
  ``memsaver.region("optimizer", backup="cpu")``.
* rollout: a second copy of the model (``region("rollout_weights", backup="cpu")``) with a
  transformers ``StaticCache`` (``region("kv_cache")``, discard) and greedy decoding whose
  one-token decode step is captured once, at start-up, as a CUDA graph with
  ``memsaver.cuda_graph(g, tag="cuda_graph")`` and replayed for every token; the prefill runs
  eagerly. The rollout "engine" sleeps right after start-up, as verl's does.

Each cycle (``--cycles``, default 5): train step (forward, loss, backward, ``optimizer.step``;
from cycle 2 on the batch is the previous rollout's prompts + tokens) -> resume
``rollout_weights`` and sync them from the trainer (``DTensor.full_tensor()`` + ``copy_``) ->
pause ``actor_weights``, ``optimizer`` and ``nccl`` -> resume ``kv_cache`` and ``cuda_graph``,
reset the cache (discard memory holds garbage after resume), prefill, replay the decode graph
for ``--tokens`` tokens while NCCL is paused -> pause the rollout tags -> resume the trainer
tags and ``nccl``.

Checks (exit status non-zero on any failure, PASS/FAIL lines and a summary at the end):

* a reference run of the same logic without memsaver (``--no-memsaver``: regions, pause and
  resume are no-ops and the graph is captured with plain ``torch.cuda.graph``) runs first in
  its own process; the losses (exact float equality) and the generated tokens of every cycle
  of each memsaver run must be identical to it;
* each pause frees (``cudaMemGetInfo``, after ``torch.cuda.synchronize()``) at least 90% of
  what ``memsaver.stats()`` says the paused tags held resident; for ``nccl``, at least 90% of
  what ``memsaver.nccl_stats()`` says NCCL owns less what it keeps resident, plus the kernel
  stack it says the pause freed, and the hook counts all of NCCL's memory released
  (``nccl_floor.py``; 388 MiB with one rank on an H100);
* ``backup="cpu"`` tags come back bit-exact (trainer weights and optimizer state after each
  rollout, rollout weights from one cycle to the next), at the same addresses;
* no growth: device memory used at each phase of cycle 2 and of the last cycle differ by less
  than 64 MiB (a table of every phase of every cycle is printed);
* the decoding itself, independently of the reference: at least 90% of the generated tokens
  are also the argmax of one forward over prompts + tokens without a cache (rounding differs
  between the two paths, so a near-tie may flip).

The trainer uses eager attention (deterministic backward); the rollout uses SDPA, whose mask is
built from device tensors only (transformers' eager mask calls ``torch.tensor(0.0,
device=...)``, a host-to-device copy that a graph capture refuses).

Hook modes (``--mode``, default ``all``: reference, then preload, then inprocess):

* ``preload``: the child runs with ``LD_PRELOAD`` of libmemsaver.so and
  ``MEMSAVER_HOOK_MODE=preload``, from ``memsaver.subprocess_env()``. The library is the one
  bundled inside the installed ``memsaver`` package (``memsaver.preload_path()``, the same path
  as ``python3 -m memsaver preload-path``), so an installed wheel is all that is needed.
* ``inprocess``: no preload; torch reaches memsaver through ``CUDAPluggableAllocator``. NCCL's
  memory is not hooked in that mode, so ``nccl`` is not paused there (the output says so).

Kernel stack (``--raise-stack BYTES``, default 1744, 0 turns it off): with two or more ranks
NCCL's kernels make the driver raise the CUDA per-thread stack limit (cudaLimitStackSize); with
one rank they do not. The script raises it itself, ``cudaDeviceSetLimit(cudaLimitStackSize,
BYTES)`` through ctypes on the libcudart torch loaded, right after ``init_process_group`` and so
before the decode graph is captured: the graph is instantiated at that limit and then replayed
while ``nccl`` is paused, the scenario in which a pause that lowered the limit killed the replay
with 'unspecified launch failure' (docs/nccl.md, "The kernel stack"). The limit is read back at
each phase, and ``nccl_stats()``'s ``stack_*`` figures (lowered, kept, why) are reported after
each pause of ``nccl``. memsaver counts a limit set with cudaDeviceSetLimit as the
application's, which alone keeps it; ``tests/gpu/graph_stack.py`` separates that reason from the
live graph's.

Run from the repository root on a machine with one GPU (torch, transformers and memsaver
installed, e.g. after ``. tests/gpu/setup_device.sh``)::

    python3 tests/gpu/real_model.py                    # reference, preload, inprocess
    python3 tests/gpu/real_model.py --mode preload     # reference and preload only
    python3 tests/gpu/real_model.py --cycles 8 --tokens 96 --raise-stack 0

Without a GPU, ``--cpu-check`` runs the same model, training and greedy-decoding logic twice on
the CPU (gloo instead of NCCL, the decode step called eagerly instead of replayed, no memsaver,
no memory checks) and checks the two runs agree: a check of the script's own logic only.
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import traceback

from nccl_floor import PauseCheck, releasable

MIB = 1 << 20

# The run's shape. Small enough for seconds per cycle, large enough that each tag holds
# tens to hundreds of MiB.
MODEL_CONFIG = dict(
    hidden_size=512,
    intermediate_size=1408,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    vocab_size=32000,
    max_position_embeddings=512,
    # Wider than the default 0.02, so that greedy tokens vary and depend on the whole context
    # (with 0.02 a random model repeats one token, which would hide a broken KV cache).
    initializer_range=0.1,
)
SEED = 1234
BATCH = 8  # sequences per rollout and per train step
PROMPT_LEN = 32
MAX_CACHE_LEN = 512  # static KV cache length (the engine's max context), >= PROMPT_LEN + tokens
LR = 1e-3

TRAINER_TAGS = ("actor_weights", "optimizer")
ROLLOUT_TAGS = ("rollout_weights", "kv_cache", "cuda_graph")
FREED_MIN_FRACTION = 0.90  # of the paused tags' resident bytes
# Generated tokens that a full forward without cache must predict too (teacher-forced argmax;
# the cached decode and the full forward differ in rounding, so near-ties may flip).
DECODE_AGREEMENT_MIN = 0.90
GROWTH_MAX_BYTES = 64 * MIB  # same phase, cycle 2 vs the last cycle

# Phases at which device memory is recorded, in cycle order.
PHASES = (
    "trained",  # after the train step
    "synced",  # rollout_weights resumed and synced from the trainer
    "trainer_paused",  # actor_weights, optimizer (and nccl) paused
    "generated",  # kv_cache and cuda_graph resumed, rollout done
    "rollout_paused",  # rollout tags paused
    "trainer_resumed",  # trainer tags (and nccl) resumed: end of the cycle
)

# Child kinds: (uses memsaver, device). "cpu" is the --cpu-check logic run.
KINDS = {
    "reference": (False, "cuda"),
    "preload": (True, "cuda"),
    "inprocess": (True, "cuda"),
    "cpu": (False, "cpu"),
}


def mib(n):
    return n / MIB


# --------------------------------------------------------------------------------------------
# The kernel stack limit, through the CUDA runtime torch loaded
# --------------------------------------------------------------------------------------------

CUDA_LIMIT_STACK_SIZE = 0  # cudaLimitStackSize in enum cudaLimit
_CUDART = []  # (CDLL, path) once found


def _cudart():
    """The libcudart that torch loaded (the one in this process's maps), as a ctypes CDLL.

    dlopen of an already loaded path returns that library. Falls back to the global symbol
    namespace (torch loads its CUDA dependencies with RTLD_GLOBAL) if no libcudart is mapped
    (a build with the runtime linked statically into libtorch_cuda)."""
    if _CUDART:
        return _CUDART[0]
    paths = []
    with open("/proc/self/maps") as f:
        for line in f:
            path = line.split()[-1] if len(line.split()) >= 6 else ""
            if "libcudart.so" in os.path.basename(path) and path not in paths:
                paths.append(path)
    for path in paths:
        lib = ctypes.CDLL(path)
        if hasattr(lib, "cudaDeviceSetLimit"):
            _CUDART.append((lib, path))
            return _CUDART[0]
    lib = ctypes.CDLL(None)
    if hasattr(lib, "cudaDeviceSetLimit"):
        _CUDART.append((lib, "(global namespace)"))
        return _CUDART[0]
    raise RuntimeError("no libcudart with cudaDeviceSetLimit found in this process")


def stack_limit():
    """cudaLimitStackSize of the current device, in bytes."""
    lib, _ = _cudart()
    value = ctypes.c_size_t()
    rc = lib.cudaDeviceGetLimit(ctypes.byref(value), ctypes.c_int(CUDA_LIMIT_STACK_SIZE))
    if rc != 0:
        raise RuntimeError(f"cudaDeviceGetLimit(cudaLimitStackSize) returned {rc}")
    return value.value


def raise_stack_limit(nbytes):
    """What NCCL does at communicator init with two or more ranks."""
    lib, path = _cudart()
    rc = lib.cudaDeviceSetLimit(ctypes.c_int(CUDA_LIMIT_STACK_SIZE), ctypes.c_size_t(nbytes))
    if rc != 0:
        raise RuntimeError(f"cudaDeviceSetLimit(cudaLimitStackSize, {nbytes}) returned {rc}")
    return path


# --------------------------------------------------------------------------------------------
# memsaver, or no-ops for the reference run
# --------------------------------------------------------------------------------------------


class Memory:
    """The memsaver calls the loop makes; with ``enabled=False`` (the reference run) regions,
    pause and resume do nothing and graphs are captured with plain ``torch.cuda.graph``."""

    def __init__(self, torch, enabled):
        self.torch = torch
        self.enabled = enabled
        self.ms = None
        if enabled:
            import memsaver

            self.ms = memsaver

    def region(self, tag, backup="discard"):
        if not self.enabled:
            return contextlib.nullcontext()
        return self.ms.region(tag, backup=backup)

    def cuda_graph(self, graph, tag, stream):
        # thread_local: CUDA calls of other threads (NCCL's watchdog) cannot break the capture.
        kwargs = dict(stream=stream, capture_error_mode="thread_local")
        if not self.enabled:
            return self.torch.cuda.graph(graph, **kwargs)
        return self.ms.cuda_graph(graph, tag=tag, **kwargs)

    def pause(self, *tags):
        if self.enabled and tags:
            self.ms.pause(*tags)

    def resume(self, *tags):
        if self.enabled and tags:
            self.ms.resume(*tags)

    def resident(self, tags):
        """Resident bytes of ``tags`` according to memsaver.stats() (0 for an unknown tag)."""
        if not self.enabled:
            return 0
        s = self.ms.stats().tags
        return sum(s[t].resident_bytes for t in tags if t in s)


# --------------------------------------------------------------------------------------------
# The child: one run of the loop
# --------------------------------------------------------------------------------------------


class Run:
    """One run of the RL loop in this process; ``result`` is what goes to the JSON file."""

    def __init__(self, kind, args):
        self.kind = kind
        self.args = args
        self.use_memsaver, device = KINDS[kind]
        self.cpu = device == "cpu"
        self.result = {
            "kind": kind,
            "hook_mode": None,
            "cycles_done": 0,
            "losses": [],
            "tokens": [],
            "memory": {p: [] for p in PHASES},  # device memory used, bytes, per cycle
            "pauses": [],  # one record per pause call
            "stack": [],  # (where, cudaLimitStackSize) read-backs
            "agreement": [],  # per cycle: fraction of tokens a full forward agrees with
            "nccl_paused": False,
            "failures": [],
            "error": None,
            "at": "start",  # the step running now: where an error happened
            "complete": False,
        }

    # -- bookkeeping ------------------------------------------------------------------------

    def at(self, cycle, step):
        self.result["at"] = f"cycle {cycle}: {step}" if cycle else step

    def check(self, cond, msg):
        if not cond:
            self.result["failures"].append(msg)
            print(f"FAIL [{self.kind}] {msg}", flush=True)
        return cond

    def save(self):
        if self.args.json:
            tmp = self.args.json + ".tmp"
            with open(tmp, "w") as f:
                json.dump(self.result, f)
            os.replace(tmp, self.args.json)

    def sync(self):
        if not self.cpu:
            self.torch.cuda.synchronize()

    def used(self):
        """Device memory in use (all processes, cudaMemGetInfo), after letting the caching
        allocator return its free blocks as verl does between phases."""
        self.sync()
        self.torch.cuda.empty_cache()
        free, total = self.torch.cuda.mem_get_info(0)
        return total - free

    def record(self, phase):
        if not self.cpu:
            self.result["memory"][phase].append(self.used())
            self.read_stack(phase)

    def read_stack(self, where):
        if self.cpu:
            return
        try:
            value = stack_limit()
        except (OSError, RuntimeError) as e:  # a diagnostic only: never fail the run for it
            value = f"unreadable: {e}"
        self.result["stack"].append([where, value])

    def pause(self, cycle, tags, nccl=False):
        """Pauses ``tags`` and records what was freed against what the tags held."""
        if not self.use_memsaver or not tags:
            return
        self.sync()
        nccl_before = self.mem.ms.nccl_stats() if nccl else None
        expected = releasable(nccl_before) if nccl else self.mem.resident(tags)
        free0, _ = self.torch.cuda.mem_get_info(0)
        calls0 = self.mem.ms.stats().driver_calls
        t0 = time.perf_counter()
        self.mem.pause(*tags)
        ms = (time.perf_counter() - t0) * 1e3
        calls = {k: v - calls0.get(k, 0) for k, v in self.mem.ms.stats().driver_calls.items()}
        free1, _ = self.torch.cuda.mem_get_info(0)
        freed = free1 - free0
        rec = {"cycle": cycle, "tags": list(tags), "expected": expected, "freed": freed, "ms": ms,
               "calls": {k: v for k, v in calls.items() if v}}
        self.result["pauses"].append(rec)
        if nccl:
            # Freed also includes the local memory of the kernel stack when the pause lowers it;
            # while paused, nccl_stats() says whether it was lowered or kept, and why.
            st = self.mem.ms.nccl_stats()
            for key in ("stack_lowered_bytes", "stack_kept_bytes", "stack_kept_reason"):
                rec[key] = st.get(key)
            floor = PauseCheck()
            floor.before(nccl_before)
            floor.paused(freed, st)
            for failure in floor.failures():
                self.check(False, f"cycle {cycle}: pause('nccl'): {failure}")
            return
        left = self.mem.resident(tags)
        self.check(left == 0, f"cycle {cycle}: {left} bytes of {tags} still resident after pause")
        self.check(
            expected > 0 and freed >= FREED_MIN_FRACTION * expected,
            f"cycle {cycle}: pause{tags} freed {mib(freed):.1f} MiB of {mib(expected):.1f} MiB "
            f"resident (< {FREED_MIN_FRACTION:.0%})",
        )

    # -- set-up -----------------------------------------------------------------------------

    def setup(self):
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from transformers import LlamaConfig, LlamaForCausalLM, StaticCache

        self.torch, self.dist = torch, dist
        args = self.args

        # Determinism: same kernels, same order, no TF32, fixed seeds and inputs.
        # CUBLAS_WORKSPACE_CONFIG is set before CUDA initialises (see child_main).
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.manual_seed(SEED)

        if self.cpu:
            self.device = torch.device("cpu")
            dist.init_process_group("gloo")
        else:
            self.device = torch.device("cuda", 0)
            torch.cuda.set_device(self.device)
            dist.init_process_group("nccl", device_id=self.device)
        self.mem = Memory(torch, self.use_memsaver)
        if self.use_memsaver:
            mode = self.mem.ms.hook_mode()
            self.result["hook_mode"] = mode
            self.check(mode == self.kind, f"runs in hook mode {mode!r}, expected {self.kind!r}")

        self.at(0, "set-up")
        # One collective, so that NCCL has set up its communicator and buffers.
        x = torch.ones(1024, device=self.device)
        dist.all_reduce(x)
        self.sync()

        # NCCL with 2+ ranks raises the kernel stack at init; emulate it (see the docstring).
        self.read_stack("after NCCL init")
        if not self.cpu and args.raise_stack:
            path = raise_stack_limit(args.raise_stack)
            print(f"[{self.kind}] cudaLimitStackSize set to {args.raise_stack} via {path}",
                  flush=True)
            self.read_stack("raised")

        # Whether nccl can be paused: only under the preload, with NCCL's calls hooked.
        self.pause_nccl = False
        if self.kind == "preload":
            hooked = bool(self.mem.ms.nccl_stats()["hooked"])
            self.check(hooked, "NCCL is not hooked under the preload (nccl_stats()['hooked'])")
            self.pause_nccl = hooked
        elif self.kind == "inprocess":
            print(
                "[inprocess] NCCL's memory is not hooked without the preload: the tag nccl is "
                "not paused in this mode",
                flush=True,
            )
        self.result["nccl_paused"] = self.pause_nccl

        # Trainer: eager attention (its backward is deterministic; SDPA's memory-efficient
        # backward is not). Rollout: SDPA, whose mask is built from device tensors only (the
        # eager mask calls torch.tensor(0.0, device=...), a host-to-device copy that a CUDA
        # graph capture refuses), as an inference engine uses its own attention kernels.
        config = LlamaConfig(**MODEL_CONFIG)
        config._attn_implementation = "eager"
        rollout_config = LlamaConfig(**MODEL_CONFIG)
        rollout_config._attn_implementation = "sdpa"

        # Trainer: built on the CPU with a fixed seed, then moved and sharded inside the
        # region so that every device copy of its weights (FSDP2's sharded parameters
        # included) is tagged actor_weights.
        torch.manual_seed(SEED)
        trainer = LlamaForCausalLM(config)
        mesh = init_device_mesh(self.device.type, (1,))
        with self.mem.region("actor_weights", backup="cpu"):
            trainer.to(self.device)
            for layer in trainer.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(trainer, mesh=mesh)
        trainer.train()
        self.trainer = trainer
        # The state (exp_avg, exp_avg_sq) is created by the first step, inside its region.
        self.optimizer = torch.optim.AdamW(trainer.parameters(), lr=LR)

        # Rollout copy: another seed on purpose (its weights come from the first sync).
        torch.manual_seed(SEED + 1)
        rollout = LlamaForCausalLM(rollout_config)
        with self.mem.region("rollout_weights", backup="cpu"):
            rollout.to(self.device)
        rollout.eval()
        self.rollout = rollout

        # Static KV cache, allocated up front inside its region (no compute in the region).
        head_dim = config.hidden_size // config.num_attention_heads
        cache = StaticCache(config=rollout_config, max_cache_len=MAX_CACHE_LEN)
        with self.mem.region("kv_cache"):
            cache.early_initialization(
                batch_size=BATCH,
                num_heads=config.num_key_value_heads,
                head_dim=head_dim,
                dtype=torch.float32,
                device=self.device,
            )
        self.cache = cache

        # Fixed inputs: prompts for every rollout, and the first train batch.
        gen = torch.Generator().manual_seed(SEED + 2)
        self.prompts = torch.randint(0, config.vocab_size, (BATCH, PROMPT_LEN), generator=gen)
        self.prompts = self.prompts.to(self.device)
        first = torch.randint(0, config.vocab_size, (BATCH, PROMPT_LEN + args.tokens),
                              generator=gen)
        self.batch = first.to(self.device)

        # Static buffers of the decode step (untagged: they belong to the engine's process).
        self.step_ids = torch.zeros((BATCH, 1), dtype=torch.long, device=self.device)
        self.step_next = torch.zeros((BATCH,), dtype=torch.long, device=self.device)
        self.at(0, "capture of the decode graph")
        self.capture_decode()

        # Addresses that must survive pause/resume.
        self.ptrs = {
            "kv_cache": [layer.keys.data_ptr() for layer in cache.layers],
            "rollout_weights": [p.data_ptr() for p in rollout.parameters()],
        }
        self.rollout_snapshot = None

        # The rollout engine sleeps after start-up, as verl's does.
        self.at(0, "pause of the rollout after set-up")
        self.record_setup = self.used() if not self.cpu else None
        self.pause(0, ROLLOUT_TAGS)

    def decode_step(self):
        """One greedy token for every sequence: static shapes, no host synchronisation. The
        cache's own position counter (a device tensor in transformers' StaticLayer) places the
        token and builds the mask, so that each replay of the graph advances by itself."""
        with self.torch.no_grad():
            out = self.rollout(input_ids=self.step_ids, past_key_values=self.cache, use_cache=True)
            self.step_next.copy_(out.logits[:, -1].argmax(dim=-1))

    def capture_decode(self):
        """Captures the decode step once (CUDA), after a warm-up on the capture stream."""
        torch = self.torch
        self.graph = None
        if self.cpu:
            return
        step = self.decode_step
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self.cache.reset()
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        # Captured on the warm-up stream, so that cuBLAS's workspace for it already exists
        # (allocated untagged during the warm-up, not inside the graph's tagged pool).
        with self.mem.cuda_graph(graph, "cuda_graph", stream):
            step()
        torch.cuda.synchronize()
        self.graph = graph

    # -- the loop ---------------------------------------------------------------------------

    def train_step(self):
        out = self.trainer(input_ids=self.batch, labels=self.batch, use_cache=False)
        loss = out.loss
        loss.backward()
        with self.mem.region("optimizer", backup="cpu"):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.item()

    def trainer_tensors(self):
        """The trainer's local weights and optimizer state (what backup='cpu' must keep)."""
        from torch.distributed.tensor import DTensor

        def local(t):
            return t.to_local() if isinstance(t, DTensor) else t

        out = [local(p) for p in self.trainer.parameters()]
        for state in self.optimizer.state.values():
            out += [local(v) for v in state.values() if self.torch.is_tensor(v) and v.dim() > 0]
        return out

    def snapshot(self, tensors):
        return [t.detach().to("cpu", copy=True) for t in tensors]

    def same(self, tensors, snap):
        return len(tensors) == len(snap) and all(
            self.torch.equal(t.detach().cpu(), s) for t, s in zip(tensors, snap, strict=True)
        )

    def sync_weights(self):
        """Trainer -> rollout, as verl's FSDP sharding manager does: full tensors gathered
        from the DTensor shards (an NCCL all-gather) copied into the rollout's parameters."""
        from torch.distributed.tensor import DTensor

        target = self.rollout.state_dict()
        with self.torch.no_grad():
            for name, value in self.trainer.state_dict().items():
                full = value.full_tensor() if isinstance(value, DTensor) else value
                target[name].copy_(full)

    def generate(self):
        """Greedy decoding: reset the cache (discard memory is garbage after resume), eager
        prefill of the prompts, then one graph replay per token."""
        torch = self.torch
        n = self.args.tokens
        tokens = torch.empty((BATCH, n), dtype=torch.long, device=self.device)
        with torch.no_grad():
            self.cache.reset()
            out = self.rollout(input_ids=self.prompts, past_key_values=self.cache, use_cache=True,
                               logits_to_keep=1)
            tokens[:, 0] = out.logits[:, -1].argmax(dim=-1)
            self.sync()  # so that an error is placed: prefill or replays
            self.result["at"] += ": after the prefill, in the decode graph replays"
            for i in range(1, n):
                self.step_ids.copy_(tokens[:, i - 1 : i])
                if self.graph is not None:
                    self.graph.replay()
                else:
                    self.decode_step()
                tokens[:, i] = self.step_next
        self.sync()
        return tokens

    def agreement(self, tokens):
        """Fraction of the generated tokens that the rollout model, run once over prompts +
        tokens without a cache, also predicts (argmax at each position): checks the KV cache
        and the graph replays independently of the reference run."""
        torch = self.torch
        with torch.no_grad():
            seq = torch.cat([self.prompts, tokens[:, :-1]], dim=1)
            logits = self.rollout(input_ids=seq, use_cache=False).logits[:, PROMPT_LEN - 1 :]
            return (logits.argmax(dim=-1) == tokens).float().mean().item()

    def cycle(self, c):
        torch = self.torch
        # 1. Train step (trainer resident, rollout asleep).
        self.at(c, "train step")
        loss = self.train_step()
        self.result["losses"].append(loss)
        self.record("trained")

        # 2. Wake the rollout weights and sync them from the trainer (NCCL active).
        self.at(c, "resume rollout_weights, sync from the trainer")
        self.mem.resume("rollout_weights")
        params = list(self.rollout.parameters())
        self.check(
            [p.data_ptr() for p in params] == self.ptrs["rollout_weights"],
            f"cycle {c}: rollout weights moved after resume",
        )
        if self.rollout_snapshot is not None:
            self.check(
                self.same(params, self.rollout_snapshot),
                f"cycle {c}: rollout weights differ after pause/resume (cpu backup)",
            )
        self.sync_weights()
        self.rollout_snapshot = self.snapshot(self.rollout.parameters())
        self.record("synced")

        # 3. Offload the trainer: its tags, then NCCL's memory.
        self.at(c, "pause of the trainer tags and nccl")
        trainer_snapshot = self.snapshot(self.trainer_tensors())
        self.pause(c, TRAINER_TAGS)
        if self.pause_nccl:
            self.pause(c, ("nccl",), nccl=True)
        self.record("trainer_paused")

        # 4. Rollout with NCCL paused: wake the KV cache and the graph's memory, generate.
        self.at(c, "resume kv_cache, cuda_graph")
        self.mem.resume("kv_cache", "cuda_graph")
        self.check(
            [layer.keys.data_ptr() for layer in self.cache.layers] == self.ptrs["kv_cache"],
            f"cycle {c}: KV cache moved after resume",
        )
        self.at(c, "rollout (prefill, decode graph replays) with nccl "
                + ("paused" if self.pause_nccl else "active"))
        tokens = self.generate()
        self.result["tokens"].append(tokens.cpu().tolist())
        agree = self.agreement(tokens)
        self.result["agreement"].append(agree)
        self.check(
            agree >= DECODE_AGREEMENT_MIN,
            f"cycle {c}: only {agree:.1%} of the generated tokens agree with a full forward "
            f"without cache (KV cache or decode graph broken)",
        )
        self.record("generated")

        # 5. Rollout back to sleep, trainer (and NCCL) back.
        self.at(c, "pause of the rollout tags, resume of the trainer tags and nccl")
        self.pause(c, ROLLOUT_TAGS)
        self.record("rollout_paused")
        self.mem.resume(*TRAINER_TAGS, *(("nccl",) if self.pause_nccl else ()))
        self.check(
            self.same(self.trainer_tensors(), trainer_snapshot),
            f"cycle {c}: trainer weights or optimizer state differ after pause/resume",
        )
        self.record("trainer_resumed")

        # 6. verl trains on the rollout: the next batch is prompts + generated tokens.
        self.batch = torch.cat([self.prompts, tokens], dim=1)
        self.result["cycles_done"] = c
        self.save()
        # Info: the weight sync reaches the rollout when its tokens change between cycles.
        toks = self.result["tokens"]
        changed = ""
        if c > 1:
            pairs = zip(toks[-2], toks[-1], strict=True)
            n = sum(x != y for a, b in pairs for x, y in zip(a, b, strict=True))
            changed = f", changed from cycle {c - 1}: {n}/{tokens.numel()}"
        print(f"[{self.kind}] cycle {c}: loss {loss!r}, decode/full-forward agreement "
              f"{agree:.1%}, tokens[0][:8] {tokens[0, :8].tolist()}{changed}", flush=True)

    def run(self):
        self.setup()
        for c in range(1, self.args.cycles + 1):
            self.cycle(c)
        self.at(0, "end")
        self.check_growth()
        self.report()
        self.result["complete"] = True
        self.save()
        self.dist.destroy_process_group()

    # -- report -----------------------------------------------------------------------------

    def check_growth(self):
        if self.cpu or not self.use_memsaver:
            return
        for phase in PHASES:
            v = self.result["memory"][phase]
            diff = v[-1] - v[1]
            self.check(
                abs(diff) < GROWTH_MAX_BYTES,
                f"device memory at '{phase}' changed by {mib(diff):+.1f} MiB from cycle 2 to "
                f"cycle {len(v)} (limit {mib(GROWTH_MAX_BYTES):.0f} MiB)",
            )

    def report(self):
        if self.cpu:
            return
        r = self.result
        n = len(r["losses"])
        print(f"\n[{self.kind}] device memory used (MiB, cudaMemGetInfo) at each phase; "
              f"after set-up {mib(self.record_setup):.1f}")
        print(f"{'phase':<16}" + "".join(f"{'cycle ' + str(c):>12}" for c in range(1, n + 1))
              + f"{'last-c2':>10}")
        for phase in PHASES:
            v = r["memory"][phase]
            growth = f"{mib(v[-1] - v[1]):>+10.1f}" if len(v) >= 2 else ""
            print(f"{phase:<16}" + "".join(f"{mib(x):>12.1f}" for x in v) + growth)
        if r["pauses"]:
            print(f"\n[{self.kind}] pauses (resident: memsaver.stats(); for nccl: "
                  "nccl_stats()'s owned_bytes less resident_pinned_bytes)")
            print(f"{'cycle':>5}  {'tags':<40}{'resident':>10}{'freed':>10}{'freed %':>9}{'ms':>8}")
            for p in r["pauses"]:
                pct = 100.0 * p["freed"] / p["expected"] if p["expected"] else float("nan")
                calls = " ".join(f"{k}={v}" for k, v in p.get("calls", {}).items())
                print(f"{p['cycle']:>5}  {','.join(p['tags']):<40}{mib(p['expected']):>10.1f}"
                      f"{mib(p['freed']):>10.1f}{pct:>9.1f}{p['ms']:>8.1f}  {calls}")
                if "stack_kept_reason" in p:
                    print(f"{'':>7}stack: lowered {mib(p['stack_lowered_bytes'] or 0):.1f} MiB, "
                          f"kept {mib(p['stack_kept_bytes'] or 0):.1f} MiB "
                          f"({p['stack_kept_reason']})")
        if r["stack"]:
            # Set-up and cycle 1 (later cycles repeat it; all of them are in the JSON file).
            first = [w for w, _ in r["stack"]].index(PHASES[-1]) + 1
            print(f"\n[{self.kind}] cudaLimitStackSize (bytes) at set-up and in cycle 1: "
                  + ", ".join(f"{w}={v}" for w, v in r["stack"][:first]))
        if self.use_memsaver:
            print(f"\n[{self.kind}] memsaver.stats() at the end:\n{self.mem.ms.stats()}")
            if self.pause_nccl:
                print(f"[{self.kind}] nccl_stats(): {self.mem.ms.nccl_stats()}")
        print(flush=True)


def child_main(args):
    kind = args.child
    # Before torch initialises CUDA: cuBLAS's deterministic workspace. The rest is what the
    # parent sets; the defaults let a child be started by hand (e.g. --no-memsaver).
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    for name, value in (("MASTER_ADDR", "127.0.0.1"), ("RANK", "0"), ("WORLD_SIZE", "1"),
                        ("LOCAL_RANK", "0")):
        os.environ.setdefault(name, value)
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(free_port())
    run = Run(kind, args)
    try:
        run.run()
    except BaseException as e:  # noqa: BLE001 - a CUDA error poisons the context: report it
        run.result["error"] = f"{run.result['at']}: {type(e).__name__}: {e}"
        run.result["traceback"] = traceback.format_exc()
        traceback.print_exc()
        run.save()
        sys.stdout.flush()
        sys.stderr.flush()
        # Skip interpreter teardown: after a CUDA error NCCL's and torch's destructors can hang.
        os._exit(1)
    ok = not run.result["failures"]
    print(f"[{kind}] child {'PASS' if ok else 'FAIL'}", flush=True)
    sys.exit(0 if ok else 1)


# --------------------------------------------------------------------------------------------
# The parent: starts the children and compares them
# --------------------------------------------------------------------------------------------


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(kind):
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    env.pop("MEMSAVER_HOOK_MODE", None)
    env.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
        CUBLAS_WORKSPACE_CONFIG=":4096:8",
        NCCL_NVLS_ENABLE="0",
    )
    if kind == "preload":
        import memsaver

        # LD_PRELOAD=<the libmemsaver.so inside the installed memsaver package>,
        # MEMSAVER_HOOK_MODE=preload (a child that lost the preload fails instead of
        # running unhooked).
        env.update(memsaver.subprocess_env())
    elif kind == "inprocess":
        env["MEMSAVER_HOOK_MODE"] = "inprocess"
    return env


def run_child(kind, label, args, workdir):
    """Runs one child; returns its result dict (None if it left none) and its exit status."""
    path = os.path.join(workdir, f"{label}.json")
    which = ["--no-memsaver"] if kind == "reference" else ["--child", kind]
    cmd = [sys.executable, os.path.abspath(__file__), *which, "--json", path,
           "--cycles", str(args.cycles), "--tokens", str(args.tokens),
           "--raise-stack", str(args.raise_stack)]
    env = child_env(kind)
    print(f"=== {label}: {' '.join(cmd[1:])}"
          + (f"\n    LD_PRELOAD={env['LD_PRELOAD']}" if "LD_PRELOAD" in env else ""), flush=True)
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
        rc, out, err = p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:
        rc = "timeout"
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
    print(out, end="" if out.endswith("\n") or not out else "\n")
    if rc != 0:
        tail = "\n".join(err.splitlines()[-60:])
        print(f"--- {label} stderr (last 60 lines):\n{tail}")
    print(f"=== {label}: exit {rc} after {time.perf_counter() - t0:.1f} s", flush=True)
    result = None
    if os.path.exists(path):
        with open(path) as f:
            result = json.load(f)
    return result, rc


def compare(ref, res, label):
    """Losses and tokens of every cycle, exactly. Returns a list of failure messages."""
    failures = []
    if ref is None or res is None:
        return [f"{label}: no result to compare"]
    n_ref, n_res = len(ref["losses"]), len(res["losses"])
    if n_res != n_ref:
        failures.append(f"{label}: {n_res} cycles done, reference did {n_ref}")
    for c in range(min(n_ref, n_res)):
        a, b = ref["losses"][c], res["losses"][c]
        if a != b:
            failures.append(f"{label}: cycle {c + 1} loss {b!r} != reference {a!r}")
    for c in range(min(len(ref["tokens"]), len(res["tokens"]))):
        a, b = ref["tokens"][c], res["tokens"][c]
        if a != b:
            where = next(
                ((i, j)
                 for i, (ra, rb) in enumerate(zip(a, b, strict=True))
                 for j, (x, y) in enumerate(zip(ra, rb, strict=True))
                 if x != y),
                None,
            )
            failures.append(f"{label}: cycle {c + 1} tokens differ from the reference "
                            f"(first at sequence, position {where})")
    return failures


def main():
    args = parse_args()
    if args.child:
        child_main(args)
        return
    if args.cpu_check:
        plan = [("cpu", "cpu-a"), ("cpu", "cpu-b")]
    elif args.mode == "all":
        plan = [("reference", "reference"), ("preload", "preload"), ("inprocess", "inprocess")]
    elif args.mode == "reference":
        plan = [("reference", "reference")]
    else:
        plan = [("reference", "reference"), (args.mode, args.mode)]

    workdir = args.out or tempfile.mkdtemp(prefix="memsaver-real-model-")
    os.makedirs(workdir, exist_ok=True)
    lines = []  # (ok, text) for the summary
    ref = None
    for i, (kind, label) in enumerate(plan):
        res, rc = run_child(kind, label, args, workdir)
        ok_run = rc == 0 and res is not None and res.get("complete")
        detail = ""
        if res is not None and res.get("error"):
            detail = f": {res['error'].splitlines()[0][:300]}"
        elif res is not None and res.get("failures"):
            detail = f": {len(res['failures'])} check(s) failed: " + "; ".join(res["failures"][:5])
        elif rc != 0:
            detail = f": exit {rc}"
        if res is not None:
            detail += f" ({res.get('cycles_done', 0)}/{args.cycles} cycles"
            if KINDS[kind][0]:
                detail += (f", hook mode {res.get('hook_mode')}, "
                           f"nccl paused: {res.get('nccl_paused')}")
            detail += ")"
        lines.append((ok_run, f"{label}: run and its own checks{detail}"))
        if i == 0:
            ref = res
            continue
        diffs = compare(ref, res, label)
        counts = f" ({len(res['losses'])} losses, {len(res['tokens'])} rollouts)" if res else ""
        lines.append((not diffs, f"{label}: losses and tokens identical to {plan[0][1]}{counts}"
                      + ("" if not diffs else ": " + "; ".join(diffs[:5]))))

    print("\n=== summary (results in " + workdir + ")")
    for ok, text in lines:
        print(f"{'PASS' if ok else 'FAIL'} {text}")
    failed = sum(not ok for ok, _ in lines)
    print(f"real_model: {len(lines) - failed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=("all", "preload", "inprocess", "reference"), default="all",
                   help="memsaver hook mode(s) to run after the reference run (default: all)")
    p.add_argument(
        "--cycles", type=int, default=5, help="train/rollout cycles (default 5, at least 3)"
    )
    p.add_argument("--tokens", type=int, default=64,
                   help="tokens generated per sequence (default 64)")
    p.add_argument("--raise-stack", type=int, default=1744, metavar="BYTES",
                   help="cudaLimitStackSize set after NCCL init, as NCCL does with 2+ ranks "
                        "(default 1744; 0: leave it)")
    p.add_argument("--timeout", type=int, default=300,
                   help="seconds per child process (default 300)")
    p.add_argument("--out",
                   help="folder for the children's JSON results (default: a temporary one)")
    p.add_argument("--cpu-check", action="store_true",
                   help="no GPU: run the model/train/decode logic twice on the CPU and compare")
    p.add_argument("--no-memsaver", action="store_true",
                   help="run the loop once in this process without memsaver (the reference "
                        "run: regions, pause and resume are no-ops, plain torch.cuda.graph)")
    p.add_argument("--json", metavar="PATH", help="with --no-memsaver: write losses, tokens and "
                   "memory figures to PATH")
    # Internal: one run of the loop in this process, started by the parent.
    p.add_argument("--child", choices=tuple(KINDS), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.no_memsaver:
        if args.child not in (None, "reference"):
            p.error("--no-memsaver is the reference run")
        args.child = "reference"
    if args.cycles < 3:
        p.error("--cycles must be at least 3 (the growth check compares cycle 2 with the last)")
    if PROMPT_LEN + args.tokens > MAX_CACHE_LEN:
        p.error(f"--tokens must be at most {MAX_CACHE_LEN - PROMPT_LEN}")
    return args


if __name__ == "__main__":
    main()
