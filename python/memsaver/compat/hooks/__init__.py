"""torch_memory_saver's ``hooks`` package: only ``mode_preload.configure_subprocess`` is public."""
