#!/usr/bin/env python3
"""DeepSpeed ZeRO trainer paused and resumed under memsaver, against DeepSpeed's own offload.

A small Llama (transformers, built from a config, random init with a fixed seed, eager
attention for a deterministic backward pass) trained with DeepSpeed ZeRO at DP=2 on 2 GPUs,
stage 2 or stage 3 (``--stage``), bf16, with DeepSpeed's AdamW (its ``FusedAdam``, built just in
time by DeepSpeed with nvcc and ninja at the first run), as OpenRLHF's actor trains.

Each cycle trains one step and then frees the trainer's memory between steps, after the
optimizer step has finished (the contract), in one of three modes (trainer_harness.py):
``none``; ``framework``, DeepSpeed's own ``engine.offload_states()`` (parameters, gradients,
fp32 master weights and optimizer states to pinned CPU memory) and ``reload_states()``, as
OpenRLHF does, with ``empty_partition_cache()`` first for stage 3 and ``torch.cuda.empty_cache()``
after; ``memsaver``, whole-process mode: every CUDA allocation of the trainer is in the process
tag ``trainer`` with cpu backup (``MEMSAVER_PROCESS_TAG=trainer``,
``MEMSAVER_PROCESS_BACKUP=cpu``), and ``memsaver.pause("trainer", "nccl")`` /
``memsaver.resume("nccl", "trainer")``; nothing in the training code changes.

Checks (exit status non-zero on failure): losses and the digests of every rank's final
parameter partitions and optimizer state bit-identical across the three runs; the borrower's
writes (90% of what was freed) read back intact; in the memsaver run, every pause frees >= 90%
of what the tags held and no communicator is rebuilt.

Run on a machine with 2 GPUs, deepspeed installed (carried as a wheel: tests/gpu/README.md)::

    python3 tests/gpu/deepspeed_trainer.py --stage 3
    python3 tests/gpu/deepspeed_trainer.py --stage 2 --cycles 5
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
from importlib.metadata import version
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from trainer_harness import (  # noqa: E402
    MICRO_BATCH,
    MODES,
    SEED,
    SEQ,
    VOCAB,
    digest,
    memsaver_offload,
    optimizer_tensors,
    parser,
    passthrough,
    run_mode,
    start_rank,
    verdict,
)


def parse() -> argparse.Namespace:
    p = parser(__doc__)
    p.add_argument("--stage", type=int, choices=(2, 3), default=3)
    return p.parse_args()


def ds_config(stage: int) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": stage, "overlap_comm": True, "contiguous_gradients": True,
                            "reduce_bucket_size": 1 << 24}
    if stage == 3:
        zero.update(stage3_prefetch_bucket_size=1 << 24, stage3_param_persistence_threshold=0)
    return {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
        "steps_per_print": 1 << 30,
    }


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    rank, local, borrower, log = start_rank(args)

    import deepspeed
    from transformers import LlamaConfig, LlamaForCausalLM

    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    torch.manual_seed(SEED)
    config = LlamaConfig(hidden_size=args.hidden, intermediate_size=int(2.75 * args.hidden),
                         num_hidden_layers=args.layers, num_attention_heads=16,
                         num_key_value_heads=8, vocab_size=VOCAB, max_position_embeddings=SEQ,
                         attn_implementation="eager")
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=ds_config(args.stage))
    inner = engine.optimizer.optimizer
    log.extra["optimizer_class"] = f"{type(engine.optimizer).__name__}({type(inner).__name__})"

    def train_step(step: int) -> float:
        g = torch.Generator().manual_seed(SEED + 1000 * step + rank)
        tokens = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=g).cuda()
        loss = engine(input_ids=tokens, labels=tokens).loss
        engine.backward(loss)
        engine.step()
        return float(loss.item())

    ms = None
    if args.mode == "memsaver":
        import memsaver

        ms = memsaver
    handles: list[int] = []

    def offload() -> dict[str, Any]:
        if args.mode == "framework":
            if args.stage == 3:
                engine.empty_partition_cache()
            engine.offload_states(pin_memory=True, non_blocking=False)
            torch.cuda.empty_cache()
            return {}
        return memsaver_offload(ms, ("trainer",), lambda: ms.pause("trainer", "nccl"), handles)

    def reload() -> dict[str, Any]:
        if args.mode == "framework":
            engine.reload_states(non_blocking=False)
        else:
            ms.resume("nccl", "trainer")
        return {}

    log.train(args, rank, train_step, offload, reload, borrower)
    params = [getattr(p, "ds_tensor", p) for p in engine.module.parameters()]
    log.finish(args, rank, handles, borrower, params=digest(params),
               optimizer=digest(optimizer_tensors(inner)),
               trainer=f"deepspeed {version('deepspeed')}, transformers {version('transformers')}")
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    args = parse()
    if args.worker:
        worker(args)
        return 0
    # DeepSpeed's JIT builder reads TORCH_CUDA_ARCH_LIST but cannot parse architectures with a
    # letter suffix (9.0a), which CUDA images often list: keep their plain form.
    archs = os.environ.get("TORCH_CUDA_ARCH_LIST", "")
    if archs:
        plain = {re.sub(r"[a-z]+$", "", a.replace("+PTX", "")) for a in re.split(r"[;\s]+", archs) if a}
        os.environ["TORCH_CUDA_ARCH_LIST"] = ";".join(sorted(plain))
    with tempfile.TemporaryDirectory() as work:
        results = {}
        for m in MODES:
            env = {"MEMSAVER_PROCESS_TAG": "trainer", "MEMSAVER_PROCESS_BACKUP": "cpu"} if m == "memsaver" else {}
            results[m] = run_mode(os.path.abspath(__file__), m, passthrough(args, "stage"), work, 2, env)
    return verdict(f"DEEPSPEED_ZERO{args.stage}", results)


if __name__ == "__main__":
    sys.exit(main())
