"""Runtimes that execute tldsl IR: the multi-rank CPU simulator (:mod:`.sim`) today;
the GPU runtime (NVSHMEM symmetric memory, cuda-python launches) joins it later."""
