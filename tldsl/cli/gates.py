"""What a benchmark or a check needs before it starts — a Hopper GPU, torchrun, the NVRTC
toolchain — checked up front, so that where it cannot run it says why in one line instead of
failing with a traceback halfway in."""
from __future__ import annotations

import os


class Unavailable(Exception):
    """The command cannot run on this machine; the message says why, in one line."""


#: Each benchmark of ``tldsl.bench`` and what it needs: "gpu" (one Hopper GPU), "torchrun" (two
#: GPUs, one process each), "nvrtc" (the compile toolchain, no GPU) or "" (nothing).
BENCHMARKS = {
    "gemm": "gpu", "compile": "nvrtc", "sim": "", "probe": "gpu", "general": "gpu", "launch": "gpu", "attention": "gpu",
    "moe": "gpu",
    "ag_gemm": "torchrun", "gemm_rs": "torchrun", "host": "torchrun", "baselines": "torchrun",
}
#: The probes that run on one GPU without torchrun (``tldsl/bench/probes.py``); the rest need it.
ONE_GPU_PROBES = ("copy_engine", "epilogue", "ag_group", "ag_gather", "moe_notifies", "moe_schedules",
                  "moe_row_copies", "moe_power", "moe_dram")
#: The probes that run on two GPUs under torchrun (``tldsl/bench/probes.py``: NAMES is both, one-GPU first).
TWO_GPU_PROBES = ("rs_reduce_in", "rs_early_sum", "ag_enqueue", "ag_staging", "ag_handshake", "ag_push", "ag_spares",
                  "ag_slices", "ag_skew", "rs_order")
#: The checks of ``tldsl.checks``, each a script run under torchrun on two GPUs.
CHECKS = ("dist_check", "build_check", "lifetime_check", "torch_ops_check", "graph_check")


def under_torchrun() -> bool:
    """torchrun (torch.distributed.run) gives every process these."""
    return all(k in os.environ for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))


def gpu_missing() -> str | None:
    """Why no kernel can be launched here, or None where a Hopper GPU is usable."""
    from ..runtime.gpu.device import GPUUnavailableError, require_gpu
    try:
        require_gpu()
    except GPUUnavailableError as ex:
        return str(ex).removeprefix("no GPU to run on: ")
    return None


def toolchain_missing() -> str | None:
    """Why nothing can be compiled here (the first line of it), or None where NVRTC and the headers are found."""
    from ..codegen.toolchain import toolchain_available
    ok, why = toolchain_available()
    return None if ok else why.strip().splitlines()[0]


def _require(what: str, need: str, launch: str) -> None:
    if need == "nvrtc":
        why = toolchain_missing()
        if why:
            raise Unavailable(f"{what} needs the NVRTC toolchain ({why}): pip install -e '.[cpu]'")
    elif need == "gpu":
        why = gpu_missing()
        if why:
            raise Unavailable(f"{what} needs a Hopper GPU (sm_90a): {why}")
    elif need == "torchrun":
        why = gpu_missing()
        if not under_torchrun():
            here = f" (here: {why})" if why else ""
            raise Unavailable(f"{what} runs on 2 GPUs under torchrun: torchrun --nproc_per_node=2 {launch}{here}")
        if why:
            raise Unavailable(f"{what} needs a Hopper GPU (sm_90a) on every rank: {why}")


def _asks_for_help(args: list[str]) -> bool:
    return any(a in ("-h", "--help") for a in args)


def probe_name(args: list[str]) -> str | None:
    """The probe ``bench probe ARGS`` names: its one positional argument, wherever it stands among the
    flags (every flag of the probes takes a value, as ``--iters 3`` or ``--iters=3``); None if none."""
    it = iter(args)
    for a in it:
        if a.startswith("-"):
            if "=" not in a:
                next(it, None)      # the flag's value
            continue
        return a
    return None


def require_for_benchmark(args: list[str]) -> None:
    """Raise :class:`Unavailable` unless ``python -m tldsl bench ARGS`` can run here."""
    if not args or _asks_for_help(args) or args[0] not in BENCHMARKS:
        return                      # usage and unknown names: the benchmarks' own parser answers
    name, need = args[0], BENCHMARKS[args[0]]
    probe = probe_name(args[1:]) if name == "probe" else None
    if name == "probe" and (probe is None or probe not in ONE_GPU_PROBES + TWO_GPU_PROBES):
        return                      # no probe named, or one there is not: its parser lists them
    if probe is not None and probe not in ONE_GPU_PROBES:
        need = "torchrun"
    what = " ".join(["bench"] + ([name, probe] if probe is not None else [name]))
    _require(what, need, " ".join(["-m tldsl bench"] + args))


def require_for_check(name: str, args: list[str]) -> None:
    """Raise :class:`Unavailable` unless ``python -m tldsl check NAME ARGS`` can run here."""
    if _asks_for_help(args) or (name == "dist_check" and args[:1] == ["explain"]):
        return                      # help, and decoding a log, need no GPU
    _require(f"check {name}", "torchrun", " ".join(["-m tldsl check", name] + args))
