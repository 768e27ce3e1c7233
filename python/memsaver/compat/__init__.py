"""torch_memory_saver's public API, backed by memsaver.

Two ways in:

* one import in the code::

      # from torch_memory_saver import torch_memory_saver
      from memsaver.compat import torch_memory_saver

* no code change at all (SGLang, slime, Miles and verl ``import torch_memory_saver`` by name):
  start the processes with ``MEMSAVER_TORCH_MEMORY_SAVER=1``. Every Python process of this
  environment that sees the variable then gets this package for ``import torch_memory_saver``
  (and its submodules ``hooks.mode_preload``, ``utils``, ``testing_utils``, ``entrypoint``). If
  the real torch_memory_saver is installed too, the process says on stderr that it is shadowed.
  ``memsaver.compat.install_alias()`` does the same from code.

What torch_memory_saver's options become in memsaver (all of them are memsaver features):

================================================  ===========================================
torch_memory_saver                                memsaver
================================================  ===========================================
``region(tag)``                                   ``memsaver.region(tag)`` (backup ``discard``)
``enable_cpu_backup=True``                        backup ``cpu`` (pinned host memory)
``cpu_backup_backend="mmap"``, or                 backup ``mmap`` (pageable, returned to the OS
``TMS_INIT_CPU_BACKUP_BACKEND=mmap``              when released)
``enable_disk_backup=True``, ``set_disk_backup_   backup ``disk``, ``memsaver.set_disk_dir``
dir``, ``TMS_DISK_BACKUP_DIR``
``retain_cpu_backup``, ``TMS_RETAIN_CPU_BACKUP``  ``memsaver.set_retain_backups`` (this API
                                                  starts with it off, as torch_memory_saver)
``get_cpu_backup(x)``                             the host copy of ``x`` while a backup exists
``memory_margin_bytes``                           ``memsaver.set_memory_margin``
``TMS_INIT_ENABLE(_CPU_BACKUP)`` under preload    whole-process mode (``MEMSAVER_PROCESS_TAG``)
================================================  ===========================================

Differences, all on the side of keeping programs running:

* ``hook_mode``: left unset, memsaver uses whatever the process has (the preloaded library,
  else the in-process pluggable allocator, which torch_memory_saver calls ``"torch"``). Set to
  ``"preload"``, a process started without the preload raises ``MemsaverError`` saying how to
  start it.
* ``cuda_graph`` works in both hook modes (torch_memory_saver: preload only).
* ``disable()`` works outside regions too.
* ``pause(tag)``/``resume(tag)`` of a tag that never had a region do nothing, as in
  torch_memory_saver, but log a warning with the known tags (``memsaver.pause`` raises).
  ``pause()`` pauses every tensor tag and leaves ``nccl`` alone (torch_memory_saver knows no
  NCCL memory); an empty or malformed tag name raises ``InvalidArgumentError``.
"""

from __future__ import annotations

from ._alias import ALIAS_ENV, install_alias
from .entrypoint import TorchMemorySaver
from .hooks.mode_preload import configure_subprocess

__all__ = ["TorchMemorySaver", "torch_memory_saver", "configure_subprocess", "install_alias"]
__all__ += ["ALIAS_ENV"]

#: The instance to use in place of ``torch_memory_saver.torch_memory_saver``.
torch_memory_saver = TorchMemorySaver()
