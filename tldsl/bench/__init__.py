"""Benchmarks and probes on GPUs, each measured beside its peers in the same run.

    python -m tldsl.bench gemm --tune                       # generated GEMM vs torch.matmul (.gemm)
    python -m tldsl.bench compile                           # cold NVRTC compile and cache hit (.compile)
    torchrun --nproc_per_node=2 -m tldsl.bench ag_gemm      # the fused ops vs NCCL+cuBLAS and async-TP (.dist)
    torchrun --nproc_per_node=2 -m tldsl.bench gemm_rs
    torchrun --nproc_per_node=2 -m tldsl.bench host         # a launch's host time beside its phases (.host)
    python -m tldsl.bench probe NAME                        # the measurements behind design choices (.probes)
    python -m tldsl.bench sim                               # the CPU simulator's speed, no GPU (.sim)
    python -m tldsl.bench launch                            # host µs per launch, cuda.bindings vs cuda.core (.launch)
    torchrun --nproc_per_node=2 -m tldsl.bench baselines ag_moe   # the sequential MoE / attention layers (.baselines)

:mod:`.cli` picks the subcommand; :mod:`.timing` is the CUDA-event timing they share. Nothing
here imports torch: each benchmark imports it when it runs.
"""
from .cli import main

__all__ = ["main"]
