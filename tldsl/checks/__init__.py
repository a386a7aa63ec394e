"""Checks of the fused distributed ops on GPUs, each a script run under torchrun (the GPU tests
run them; ``tests/test_gpu_dist.py``):

    torchrun --nproc_per_node=2 -m tldsl.checks.dist_check ag_gemm|gemm_rs   # correctness and stress
    torchrun --nproc_per_node=2 -m tldsl.checks.torch_ops_check              # the torch ops beside async-TP's
    torchrun --nproc_per_node=2 -m tldsl.checks.build_check                  # ranks that build an op differently
    torchrun --nproc_per_node=2 -m tldsl.checks.lifetime_check               # symmetric memory's lifetimes

:mod:`.verdict` is their common end: the ranks agree on one verdict. Nothing is imported here,
so that ``-m`` runs each script as the one copy of its module.
"""
