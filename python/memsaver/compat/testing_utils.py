"""torch_memory_saver's ``testing_utils``, so that test suites written for it run unchanged."""

from __future__ import annotations

from typing import Any

from .utils import is_xpu

__all__ = ["get_device", "empty_cache", "get_and_print_gpu_memory", "is_xpu"]


def _torch() -> Any:
    import torch  # the helpers are for torch programs; memsaver itself never imports torch

    return torch


def get_device() -> str:
    return "cuda"


def empty_cache() -> None:
    _torch().cuda.empty_cache()


def get_and_print_gpu_memory(message: str, gpu_id: int = 0) -> int:
    """Device memory in use on ``gpu_id`` by every process (as NVML reports it), printed."""
    mem = int(_torch().cuda.device_memory_used(gpu_id))
    print(f"GPU {gpu_id} memory: {mem / 1024**3:.2f} GB ({message})")
    return mem
