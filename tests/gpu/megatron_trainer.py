#!/usr/bin/env python3
"""Megatron-core trainer paused and resumed under memsaver, against Megatron's usual offload.

A GPTModel from Megatron-core's local layer spec (no Transformer Engine), bf16, trained on 2
GPUs in one of two layouts (``--layout``):

* ``tp2``: tensor parallel over both GPUs (Megatron's DDP over data-parallel groups of one);
* ``dp2``: data parallel over both GPUs with the distributed optimizer (fp32 main parameters and
  Adam state sharded over the ranks).

Both use Megatron's DDP with contiguous gradient buffers (``grad_reduce_in_fp32``) and the
gradient reduce overlapped with the backward pass (``overlap_grad_reduce``), Megatron's optimizer
(torch's AdamW underneath where neither Transformer Engine nor Apex is installed), and
``forward_backward_func`` with ``finalize_model_grads``, as Megatron's own training loop does.

Each cycle trains one step and then frees the trainer's memory between steps, after the gradient
reduce and the optimizer step have finished (the contract), in one of three modes
(trainer_harness.py): ``none``, ``framework`` (every state storage copied to pinned CPU memory
and its GPU storage resized to zero, then the NCCL communicators destroyed, as slime and verl do;
a reload rebuilds as many communicators as the job uses, with a first collective each, and copies
the states back), ``memsaver`` (the profile ``megatron_trainer.yaml``: tags ``weights`` for the
model and DDP's parameter and gradient buffers, ``optimizer`` for the optimizer's main parameters
and state, both with cpu backup, and ``nccl``; stages ``offload`` and ``onload``).

Checks (exit status non-zero on failure): losses and the digests of every rank's final
parameters and optimizer state bit-identical across the three runs; the borrower's writes
(90% of what was freed) read back intact; in the memsaver run, every tag's memory freed (>= 90%
of what memsaver.stats() said the tags held, for ``nccl`` what nccl_floor.py requires) and no
communicator rebuilt (NCCL's buffers the same handles from the first cycle to the last).

Run on a machine with 2 GPUs, megatron-core installed (carried as a wheel: tests/gpu/README.md)::

    python3 tests/gpu/megatron_trainer.py --layout tp2
    python3 tests/gpu/megatron_trainer.py --layout dp2 --cycles 5
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections import Counter
from importlib.metadata import version
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from trainer_harness import (  # noqa: E402
    MIB,
    MICRO_BATCH,
    MODES,
    SEED,
    SEQ,
    VOCAB,
    device_used,
    digest,
    memsaver_offload,
    optimizer_tensors,
    parser,
    passthrough,
    run_mode,
    start_rank,
    verdict,
)

PROFILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "megatron_trainer.yaml")

def parse() -> argparse.Namespace:
    p = parser(__doc__)
    p.add_argument("--layout", choices=("tp2", "dp2"), default="tp2")
    return p.parse_args()


def batch(step: int, rank_in_dp: int, device: Any) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(SEED + 1000 * step + rank_in_dp)
    tokens = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ + 1), generator=g)
    mask = torch.tril(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool)).logical_not()
    return dict(tokens=tokens[:, :-1].to(device), labels=tokens[:, 1:].to(device),
                position_ids=torch.arange(SEQ).expand(MICRO_BATCH, SEQ).to(device),
                attention_mask=mask.to(device))


def storages(tensors: list[Any]) -> list[Any]:
    """The distinct CUDA storages behind `tensors` (a parameter and the buffer it views share one)."""
    seen: dict[int, Any] = {}
    for t in tensors:
        if t is None:  # DDP's param_data without the distributed optimizer
            continue
        s = t.untyped_storage()
        if s.device.type == "cuda" and s.nbytes() and s.data_ptr() not in seen:
            seen[s.data_ptr()] = s
    return list(seen.values())


def as_bytes(storage: Any) -> Any:
    import torch

    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class StorageOffload:
    """Megatron's usual offload: each storage copied to pinned host memory and resized to zero."""

    def __init__(self, tensors: list[Any]) -> None:
        self.tensors = tensors
        self.saved: list[tuple[Any, Any]] = []

    def offload(self) -> None:
        import torch

        for s in storages(self.tensors):
            host = torch.empty(s.nbytes(), dtype=torch.uint8, pin_memory=True)
            host.copy_(as_bytes(s))
            self.saved.append((s, host))
        for s, _ in self.saved:
            s.resize_(0)

    def reload(self) -> None:
        for s, host in self.saved:
            s.resize_(host.numel())
            as_bytes(s).copy_(host, non_blocking=True)
        self.saved.clear()


class GroupRebuild:
    """slime's process-group rebuild: every NCCL communicator of the job destroyed before a
    rollout and created again after it. Done on twins, groups over the same ranks as each of the
    job's NCCL groups (Megatron's modules keep their own groups, which cannot be recreated in
    place without patching torch.distributed as slime does)."""

    def __init__(self) -> None:
        self.shapes: list[list[int]] = []
        self.groups: list[Any] = []
        self.destroy_s = 0.0
        self.freed = 0

    def survey(self) -> None:
        """The rank lists of every NCCL group of the job, the same list on every rank. Reads
        torch's private registry of process groups (`_world.pg_map`, checked with torch 2.11),
        which only this side-by-side measurement needs."""
        import torch.distributed as dist
        from torch.distributed.distributed_c10d import _world

        mine = Counter(tuple(dist.get_process_group_ranks(g)) for g in list(_world.pg_map)
                       if dist.get_backend(g) == "nccl")
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        union: Counter[tuple[int, ...]] = Counter()
        for c in everyone:
            union |= c
        self.shapes = [list(t) for t in sorted(union.elements())]

    def build(self) -> float:
        import torch
        import torch.distributed as dist

        t0 = time.perf_counter()
        x = torch.ones(1, device="cuda")
        for ranks in self.shapes:
            g = dist.new_group(ranks=ranks, backend="nccl")
            if dist.get_rank() in ranks:
                dist.all_reduce(x, group=g)  # the communicator exists after its first collective
                self.groups.append(g)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    def destroy(self, device: int) -> None:
        import torch.distributed as dist

        before = device_used(device)
        t0 = time.perf_counter()
        for g in self.groups:
            dist.destroy_process_group(g)
        self.groups.clear()
        self.destroy_s = time.perf_counter() - t0
        self.freed = before - device_used(device)


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    rank, local, borrower, log = start_rank(args)

    ms = profile = None
    if args.mode == "memsaver":
        import memsaver
        from memsaver.profile import load_profile

        ms, profile = memsaver, load_profile(PROFILE)

    def region(tag: str) -> Any:
        import contextlib

        return profile.region(tag) if profile else contextlib.nullcontext()

    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    tp = 2 if args.layout == "tp2" else 1
    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    tensor_parallel.model_parallel_cuda_manual_seed(SEED)
    torch.manual_seed(SEED)

    config = TransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=16,
        ffn_hidden_size=4 * args.hidden, bf16=True, params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16, tensor_model_parallel_size=tp,
        hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=True,
        use_distributed_optimizer=args.layout == "dp2", bucket_size=16 * MIB)
    with region("weights"):
        model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
                         vocab_size=VOCAB, max_sequence_length=SEQ).cuda()
        model = Float16Module(config, model)  # bf16 inputs and fp32 outputs, as Megatron trains
        model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = model.no_sync
    opt_config = OptimizerConfig(optimizer="adam", lr=1e-4, bf16=True, params_dtype=torch.bfloat16,
                                 use_distributed_optimizer=args.layout == "dp2", clip_grad=1.0)
    with region("optimizer"):
        optimizer = get_megatron_optimizer(opt_config, [model])
    inner = optimizer.optimizer
    log.extra["optimizer_class"] = f"{type(optimizer).__name__}({type(inner).__name__})"
    forward_backward = get_forward_backward_func()
    dp_rank = ps.get_data_parallel_rank()

    def forward_step(data_iterator: Any, model: Any) -> Any:
        b = next(data_iterator)
        out = model(b["tokens"], b["position_ids"], b["attention_mask"], labels=b["labels"])

        def loss_func(output: Any) -> Any:
            loss = output.float().mean()
            return loss, {"loss": loss.detach()}

        return out, loss_func

    def train_step(step: int) -> float:
        model.zero_grad_buffer()
        optimizer.zero_grad()
        losses = forward_backward(forward_step_func=forward_step,
                                  data_iterator=iter([batch(step, dp_rank, "cuda")]),
                                  model=[model], num_microbatches=1, seq_length=SEQ,
                                  micro_batch_size=MICRO_BATCH, forward_only=False)
        with region("optimizer"):
            ok, _, _ = optimizer.step()
        assert ok, "optimizer step skipped"
        return float(losses[0]["loss"].item())

    states = StorageOffload([])
    rebuild = GroupRebuild()
    handles: list[int] = []

    def offload() -> dict[str, Any]:
        if args.mode == "framework":
            states.offload()
            rebuild.destroy(local)
            torch.cuda.empty_cache()
            return dict(rebuild_groups=len(rebuild.shapes), rebuild_destroy_ms=1e3 * rebuild.destroy_s,
                        rebuild_freed_mib=rebuild.freed / MIB)
        assert ms is not None and profile is not None
        return memsaver_offload(ms, ("weights", "optimizer"), lambda: profile.run("offload"), handles)

    def reload() -> dict[str, Any]:
        if args.mode == "framework":
            t0 = time.perf_counter()
            rebuild_s = rebuild.build()
            states.reload()
            return dict(rebuild_ms=1e3 * (rebuild.destroy_s + rebuild_s),
                        rebuild_build_ms=1e3 * rebuild_s, reload_states_ms=1e3 * (time.perf_counter() - t0 - rebuild_s))
        assert profile is not None
        profile.run("onload")
        return {}

    def after_first() -> None:
        # Every state the step leaves on the GPU: parameters, DDP's buffers, the optimizer's.
        states.tensors = list(model.parameters())
        for buf in model.buffers + model.expert_parallel_buffers:
            states.tensors += [buf.param_data, buf.grad_data]
        states.tensors += optimizer_tensors(inner)
        if args.mode == "framework":
            rebuild.survey()
            rebuild.build()  # the twins of the job's communicators, destroyed at each offload

    log.train(args, rank, train_step, offload, reload, borrower, after_first)
    log.finish(args, rank, handles, borrower, params=digest(p for p in model.parameters()),
               optimizer=digest(optimizer_tensors(inner)),
               trainer=f"megatron-core {version('megatron-core')}")
    dist.barrier()
    ps.destroy_model_parallel()
    dist.destroy_process_group()


def main() -> int:
    args = parse()
    if args.worker:
        worker(args)
        return 0
    env = {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}  # what Megatron asks for with TP and overlap
    with tempfile.TemporaryDirectory() as work:
        results = {m: run_mode(os.path.abspath(__file__), m, passthrough(args, "layout"), work, 2, env) for m in MODES}
    return verdict(f"MEGATRON_{args.layout.upper()}", results)


if __name__ == "__main__":
    sys.exit(main())
