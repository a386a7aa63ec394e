"""Runtimes that execute tldsl IR: the multi-rank CPU simulator (:mod:`.sim`, the
specification the generated code is tested against); on GPUs, loading the generated cubins and
launching them on torch streams (:mod:`.gpu`); and the fused ops across GPUs on torch.distributed
with symmetric memory — torch's, or NVSHMEM's for ``transport='nvshmem'`` kernels (:mod:`.dist`).

Nothing here imports torch or cuda-python until it runs on a GPU."""
