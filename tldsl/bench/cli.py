"""Benchmarks on the GPU, with the peers measured in the same run.

    python -m tldsl.bench gemm [--shapes 8192x8192x8192,...] [--tune] [--iters 30]   (see tldsl.bench.gemm)
    torchrun --nproc_per_node=2 -m tldsl.bench ag_gemm|gemm_rs  (see tldsl.bench.dist)
    python -m tldsl.bench compile                           (cold compile and cache hit; no GPU needed)
    python -m tldsl.bench probe NAME                         (see tldsl.bench.probes for NAME)
    torchrun --nproc_per_node=2 -m tldsl.bench host         (see tldsl.bench.host)
    python -m tldsl.bench sim [-W 8 -M 1024 -N 1024 -K 1024 --tile 64]  (the CPU simulator; see tldsl.bench.sim)
    python -m tldsl.bench general [--rounds 5 --iters 10]    (the general lowering vs torch; see tldsl.bench.general)
    python -m tldsl.bench attention [--seqs 4096,8192 ...]   (the attention kernel vs torch SDPA; see tldsl.bench.attention)
    python -m tldsl.bench moe [--layer ag|rs] [--repeat 4] [--processes 3]   (the MoE grouped GEMMs vs torch._grouped_mm; see tldsl.bench.moe)
    python -m tldsl.bench launch [--args 1,8,24]             (host µs per launch, cuda.bindings vs cuda.core; see tldsl.bench.launch)
    torchrun --nproc_per_node=2 -m tldsl.bench baselines ag_moe|moe_rs|sp_attention  (the sequential layers; see tldsl.bench.baselines)

This module only picks the subcommand; each parses its own flags.
"""
from __future__ import annotations

import argparse
import sys

from .. import env
from ..cli.gates import Unavailable, require_for_benchmark
from . import compile as compile_bench
from . import attention, baselines, dist, gemm, general, host, launch, moe, probes, sim


#: each subcommand's argument check (argparse: a bad flag exits with its usage line), run before
#: what the benchmark needs is: a typo says so on a machine without a GPU too
PARSERS = {
    "ag_gemm": lambda a: dist.parse_args("ag_gemm", a), "gemm_rs": lambda a: dist.parse_args("gemm_rs", a),
    "compile": compile_bench.parse_args, "probe": probes.parse_args, "host": host.parse_args,
    "sim": sim.parse_args, "general": general.parse_args, "launch": launch.parse_args,
    "baselines": baselines.parse_args, "attention": attention.parse_args, "moe": moe.parse_args,
}


#: the subcommands that run from their own modules (ag_gemm and gemm_rs: dist.main takes which)
MAINS = {"compile": compile_bench.main, "probe": probes.main, "host": host.main, "sim": sim.main,
         "general": general.main, "launch": launch.main, "baselines": baselines.main, "attention": attention.main,
         "moe": moe.main}


def check_arguments(argv: list[str]) -> None:
    """Parse ``bench ARGV``'s flags as its subcommand will (a bad one exits 2 with the usage line)."""
    if argv[:1] and argv[0] in PARSERS:
        PARSERS[argv[0]](argv[1:])
    else:                               # gemm, a name there is not, or none
        root_parser().parse_args(argv)


def root_parser() -> argparse.ArgumentParser:
    """The subcommands (``gemm`` parsed here; the others by their own modules)."""
    ap = argparse.ArgumentParser(prog="python -m tldsl.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    g = sub.add_parser("gemm", help="generated GEMM vs torch.matmul", description=gemm.__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    g.add_argument("--shapes", type=gemm.parse_shapes, default=gemm.DEFAULT_SHAPES, help="MxNxK,MxNxK,...")
    g.add_argument("--iters", type=int, default=30)
    g.add_argument("--tune", action="store_true", help="try every candidate schedule, keep the fastest")
    g.add_argument("--json", help="also write the rows as JSON here")
    g.add_argument("--weights", choices=gemm.WEIGHT_LAYOUTS, default="kn",
                   help="B stored [K, N] (kn) or [N, K] (nk: a torch Linear's weight, torch.matmul(a, w.t()) and "
                        "tldsl.ops.gemm.linear)")
    for name, what in (("ag_gemm", "fused AllGather+GEMM vs NCCL+cuBLAS and async-TP (torchrun, 2 GPUs)"),
                       ("gemm_rs", "fused GEMM+ReduceScatter, same peers (torchrun, 2 GPUs)"),
                       ("compile", "cold NVRTC compile and a cache hit (no GPU)"),
                       ("probe", "the measurements behind design choices: probe NAME"),
                       ("host", "a launch's host time beside its device phases (torchrun, 2 GPUs)"),
                       ("sim", "the CPU simulator's speed (no GPU)"),
                       ("general", "tile programs no recipe matches, through the general lowering, vs torch"),
                       ("attention", "the generated attention kernel vs torch SDPA (cuDNN) on one GPU"),
                       ("moe", "the MoE grouped GEMMs (AllGather+MoE's; --layer rs: MoE+ReduceScatter's and its combine) vs "
                        "torch._grouped_mm on one GPU"),
                       ("launch", "host time of one kernel launch: our cuda.bindings path vs cuda.core"),
                       ("baselines", "the sequential MoE and attention layers the fused ops are timed against "
                                     "(torchrun)")):
        sub.add_parser(name, help=what, add_help=False)     # parsed by their own modules (dispatched above)
    return ap


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    check_arguments(argv)
    try:            # where a benchmark cannot run (no GPU, no torchrun) it says so in one line
        require_for_benchmark(argv)
    except Unavailable as e:
        print(f"python -m tldsl.bench: {e}", file=sys.stderr)
        return 1
    if env.get("TLDSL_WAIT_TIMEOUT_NS"):
        print("python -m tldsl.bench: TLDSL_WAIT_TIMEOUT_NS is set (debugging a hang): the kernels built with a "
              "wait timeout also print a timed-out wait's slot, which slows them (a folded grouped GEMM by "
              "18 %): this run's times are not comparable with others'", file=sys.stderr)
    if argv and argv[0] in ("ag_gemm", "gemm_rs"):
        return dist.main(argv[0], argv[1:])
    if argv and argv[0] in MAINS:
        return MAINS[argv[0]](argv[1:])
    args = root_parser().parse_args(argv)
    if args.what == "gemm":
        gemm.bench_gemm(args.shapes, args.iters, args.tune, json_path=args.json, weights=args.weights)
    return 0
