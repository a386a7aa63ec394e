"""Every ``TLDSL_*`` environment variable, in one table.

Why one table: a variable read in one module and mentioned nowhere else is a setting nobody can
find. Library code reads them through :func:`get`, which refuses a name the table lacks (or through a
checked reader of one variable, :data:`CHECKED_READERS`, which refuses a malformed value); the
README's "Environment variables" section is :func:`markdown_table`'s output, and
``tests/test_env_vars.py`` fails when a file reads or sets a ``TLDSL_*`` variable that is not
here, when an entry's readers no longer read it, or when the README's section is stale
(regenerate it with :func:`markdown_table`).

An empty value counts as unset, as it always has for every one of these variables.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from .errors import InputError


@dataclass(frozen=True)
class EnvVar:
    """One variable: its name, what unset means, what it changes, and the files that read it."""
    name: str
    default: str                  # what happens when it is unset, in words
    effect: str
    readers: tuple[str, ...]      # repository-relative paths of the files that read (or set) it


VARIABLES: tuple[EnvVar, ...] = (
    EnvVar("TLDSL_CACHE_DIR", "platformdirs' user cache folder + `tldsl` (`$XDG_CACHE_HOME/tldsl` or "
           "`~/.cache/tldsl` on Linux)",
           "Where compiled kernels (cubins) and the autotuner's winners are kept; `python -m tldsl cache "
           "info` shows it, `cache clear` removes its entries (compiled kernels, the autotuner's winners) and nothing "
           "else it finds there; a path that is not a folder is refused.",
           ("codegen/toolchain/cache.py", "tldsl/cli/cache.py", "tldsl/bench/compile.py")),
    EnvVar("TLDSL_QUIET", "compile progress and a long simulation's progress are printed to stderr",
           "Any value but `0`: no per-kernel compile progress lines and no long simulation's progress lines on "
           "stderr (a `progress=` argument or `SimOptions(progress=...)` still wins).",
           ("codegen/toolchain/compiler.py", "runtime/sim/simulate.py")),
    EnvVar("TLDSL_COMPILE_WORKERS", "one per CPU core",
           "How many processes compile kernels with NVRTC in parallel (a positive int).",
           ("codegen/toolchain/compiler.py",)),
    EnvVar("TLDSL_CUTLASS_INCLUDE", "found by `cuda.pathfinder` (the `nvidia-cutlass` wheel)",
           "A folder holding CUTLASS's `cute/` and `cutlass/` headers, used instead of the wheel's.",
           ("codegen/toolchain/locate.py",)),
    EnvVar("TLDSL_CUDA_INCLUDE", "found by `cuda.pathfinder` (the `nvidia-cuda-runtime` wheel)",
           "A CUDA 13 `include/` folder (with `cuda_runtime_api.h`, `cccl/`, `crt/`), used instead of the wheels'.",
           ("codegen/toolchain/locate.py",)),
    EnvVar("TLDSL_NVSHMEM_INCLUDE", "found by `cuda.pathfinder` (the `nvidia-nvshmem-cu13` wheel)",
           "NVSHMEM's `include/` folder, for kernels with `transport='nvshmem'`.",
           ("codegen/toolchain/locate.py",)),
    EnvVar("TLDSL_CUOBJDUMP", "found by `cuda.pathfinder` (the `nvidia-cuda-cuobjdump` wheel), else `PATH`",
           "The `cuobjdump` executable the SASS checks run.",
           ("codegen/toolchain/locate.py",)),
    EnvVar("TLDSL_NVSHMEM_HOSTLIB", "`libnvshmem_host.so.3` of the installed `nvidia-nvshmem-cu13`",
           "The NVSHMEM host library `transport='nvshmem'` ops load (it must be the one torch loads).",
           ("runtime/dist/nvshmem.py",)),
    EnvVar("TLDSL_SYMM_BACKEND", "`CUDA`",
           "`NVSHMEM` switches torch's process-wide symmetric-memory backend (torch's own async-TP ops "
           "then fail in the same process).",
           ("runtime/dist/group.py",)),
    EnvVar("TLDSL_SPARE_OUTPUTS", "by size: outputs up to 256 MiB are kept",
           "`0` or `1`: whether every GPU op not told by `spare_outputs=` keeps the next call's outputs "
           "allocated (the torch ops too).",
           ("runtime/dist/spare_outputs.py",)),
    EnvVar("TLDSL_WAIT_TIMEOUT_NS", "the GPU ops' waits spin without a limit; `tl.run`'s kernels trap after its "
           "`timeout_s` without saying where",
           "Debugging a hang: the GPU ops compile every wait with this timeout, and the schedules on the "
           "fused-op runtime give up waiting on the host after as long; every kernel compiled while it is set "
           "(`tl.run`'s too, with their own timeout) prints a timed-out wait's slot, the value it held and the "
           "one it needed before it traps. That report slows a kernel (a folded grouped GEMM by 18 %), so "
           "only debug builds carry it (`python -m tldsl.checks.dist_check --debug-timeout-ns` sets it), and "
           "`python -m tldsl.bench` warns while it is set that its times are not comparable.",
           ("runtime/dist/ag_gemm.py", "runtime/dist/gemm_rs.py", "runtime/dist/program_engine.py",
            "tldsl/checks/dist_check.py", "codegen/abi.py", "tldsl/bench/cli.py")),
    EnvVar("TLDSL_DEBUG", "off",
           "Any value: the AllGather+GEMM and GEMM+ReduceScatter ops synchronise after every call and print each "
           "rank's signal counters (slow; for hunting a hang or a wrong count).",
           ("runtime/dist/ag_gemm.py", "runtime/dist/gemm_rs.py")),
    EnvVar("TLDSL_RESERVE_SMS", "0 (1 with the barrier-kernel handshake)",
           "SMs the AllGather+GEMM pull's persistent GEMM leaves free (never fewer than its handshake needs).",
           ("runtime/dist/ag_pull.py",)),
    EnvVar("TLDSL_STRICT_SKIPS", "skips pass",
           "`1` (`make test` sets it): any skip outside the GPU tests fails — a missing wheel is a broken "
           "install, not a green run.",
           ("tests/conftest.py", "Makefile")),
    EnvVar("TLDSL_FUZZ_SEED", "today's date (`YYYYMMDD`): a new seed every day",
           "The seed of the test suite's 50 fresh fuzzer programs (`tests/test_fuzz_programs.py`): set it to "
           "replay the seed a failing run reports.",
           ("tests/test_fuzz_programs.py",)),
    EnvVar("TLDSL_REQUIRE_GPU", "GPU tests skip without a GPU",
           "`1` (`make gpu-test` sets it): no GPU, torch or cuda-python is an error instead of skipped GPU tests.",
           ("tests/conftest.py", "Makefile")),
    EnvVar("TLDSL_EXAMPLES", "20",
           "Hypothesis examples per op in `tests/test_properties.py`.",
           ("tests/test_properties.py",)),
)

BY_NAME: dict[str, EnvVar] = {v.name: v for v in VARIABLES}


def get(name: str, default: str | None = None) -> str | None:
    """The value of ``name`` (``default`` when unset or empty). A name missing from
    :data:`VARIABLES` is a programming error, refused so that the table stays complete."""
    if name not in BY_NAME:
        raise KeyError(f"{name} is not in tldsl.env.VARIABLES: add it there (the README's table is generated "
                       "from it)")
    return os.environ.get(name) or default


#: the checked readers of one variable each: function -> the variable it reads (tests/test_env_vars.py
#: counts a call of one, ``env.wait_timeout_ns()``, as a read of its variable)
CHECKED_READERS: dict[str, str] = {"wait_timeout_ns": "TLDSL_WAIT_TIMEOUT_NS"}

#: a wait's timeout is an unsigned 64-bit count of nanoseconds in the kernels (``-D...ull``): a
#: larger literal wraps (NVRTC makes 2**64 a 0, and then every wait that spins at all traps)
MAX_WAIT_TIMEOUT_NS = 2 ** 64


def wait_timeout_ns() -> int | None:
    """``TLDSL_WAIT_TIMEOUT_NS`` as an int of nanoseconds, None when unset: the one reader of it,
    so that a mistyped value is an InputError naming the variable (not int()'s ValueError, or a
    timeout that wrapped to 0 in the kernels) before anything is compiled."""
    text = get("TLDSL_WAIT_TIMEOUT_NS")
    if text is None:
        return None
    try:
        ns = int(text.strip())
    except ValueError:
        ns = 0
    if not 1 <= ns < MAX_WAIT_TIMEOUT_NS:
        raise InputError(f"TLDSL_WAIT_TIMEOUT_NS={text!r}: a positive int of nanoseconds below 2**64 (how long a "
                         "wait spins before it traps; unset: no timeout)")
    return ns


def markdown_table() -> str:
    """The README's table: one row per variable."""
    rows = ["| Variable | Unset | What it does | Read by |", "|---|---|---|---|"]
    for v in VARIABLES:
        readers = ", ".join(f"`{r}`" for r in v.readers)
        rows.append(f"| `{v.name}` | {v.default} | {v.effect} | {readers} |")
    return "\n".join(rows) + "\n"
