"""The parser and the dispatch of ``python -m tldsl``. Commands that have their own command
line (demo, bench, check, fuzz, mutants) get the rest of it untouched; nothing heavy is imported
before a command is chosen, so ``--help`` is quick."""
from __future__ import annotations

import argparse
import contextlib
import os
import runpy
import sys
from typing import Callable

from .gates import BENCHMARKS, CHECKS, Unavailable, require_for_benchmark, require_for_check

PROG = "python -m tldsl"

EPILOG = """\
examples:
  python -m tldsl doctor                                   # what is installed, what is missing
  python -m tldsl demo --world-size 8
  python -m tldsl bench compile                            # cold NVRTC compile and a cache hit
  torchrun --nproc_per_node=2 -m tldsl bench ag_gemm       # the fused AllGather+GEMM vs the peers
  torchrun --nproc_per_node=2 -m tldsl check dist_check ag_gemm
  python -m tldsl fuzz --programs 50 --seed 1               # random tile programs: simulate, lower, compile
  python -m tldsl cache clear

'bench', 'check', 'demo', 'fuzz' and 'mutants' take their own flags: python -m tldsl bench gemm --help.
"""


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message} (see --help)\n")


def _benchmarks() -> str:
    """The benchmarks by what they need, from :data:`.gates.BENCHMARKS`."""
    def named(*needs):
        return ", ".join(n + " NAME" * (n == "probe") for n, need in BENCHMARKS.items() if need in needs)
    return (f"benchmarks: {named('gpu')} on one GPU; {named('nvrtc', '')} without one; {named('torchrun')} "
            "(and the two-GPU probes) under torchrun on 2 GPUs")


def _parser() -> argparse.ArgumentParser:
    ap = _Parser(prog=PROG, description="tldsl: tile programs that overlap computation with communication across\n"
                 "GPUs — simulated on the CPU, compiled with NVRTC, run on H200s.", epilog=EPILOG,
                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.add_parser("demo", add_help=False,
                   help="AllGather+GEMM on 4 simulated ranks: the IR, the check against numpy, a timeline (no GPU)")
    sub.add_parser("bench", add_help=False, help=_benchmarks())
    sub.add_parser("check", add_help=False,
                   help=f"GPU correctness checks, under torchrun on 2 GPUs: {', '.join(CHECKS)}")
    sub.add_parser("mutants", add_help=False,
                   help="the mutation check: delete each synchronisation primitive of every op, the simulator must "
                        "catch it")
    sub.add_parser("fuzz", add_help=False,
                   help="the differential fuzzer: distinct random tile programs, each simulated, lowered and compiled "
                        "(--gpu: run on the GPU and compared with the simulator)")
    cache = sub.add_parser("cache", help="the compiled-kernel (NVRTC cubin) cache: cache info, cache clear")
    cache_sub = cache.add_subparsers(dest="action", metavar="ACTION", required=True, parser_class=_Parser)
    cache_sub.add_parser("info", help="where it is, how many entries, how many bytes")
    cache_sub.add_parser("clear", help="remove every entry, after saying what")
    sub.add_parser("version", help="tldsl's version")
    sub.add_parser("doctor", help="what is installed (numpy, torch, NVRTC, CUTLASS, NVSHMEM, GPU), what is missing "
                                  "and what that prevents")
    return ap


def _run_check(args: list[str]) -> int:
    if not args or args[0] in ("-h", "--help"):
        print(f"usage: [torchrun --nproc_per_node=2] {PROG} check {{{','.join(CHECKS)}}} [ARGS...]\n\n"
              "The GPU checks of tldsl.checks, each run under torchrun on 2 GPUs; "
              f"'{PROG} check NAME --help' shows its flags.")
        return 0 if args else 2
    name, rest = args[0], args[1:]
    if name not in CHECKS:
        print(f"{PROG} check: unknown check '{name}' (choose from {', '.join(CHECKS)})", file=sys.stderr)
        return 2
    require_for_check(name, rest)
    saved = sys.argv
    sys.argv = [f"tldsl.checks.{name}", *rest]
    try:
        runpy.run_module(f"tldsl.checks.{name}", run_name="__main__", alter_sys=True)   # as `-m` runs it
    except SystemExit as done:             # the scripts end with sys.exit(status)
        if done.code is None or isinstance(done.code, int):
            return done.code or 0
        print(done.code, file=sys.stderr)
        return 1
    finally:
        sys.argv = saved
    return 0


@contextlib.contextmanager
def _program_name(name: str):
    """argparse names a program after ``sys.argv[0]``: let usage lines say how it was called."""
    saved = sys.argv[0]
    sys.argv[0] = name
    try:
        yield
    finally:
        sys.argv[0] = saved


def _forwarded(command: str, args: list[str]) -> int:
    """The commands with a command line of their own."""
    with _program_name(f"{PROG} {command}"):
        return _forward(command, args)


def _forward(command: str, args: list[str]) -> int:
    if command == "demo":
        from ..demo import main as demo
        return demo(args)
    if command == "bench":
        from ..bench.cli import check_arguments
        check_arguments(args)           # a mistyped flag is a usage error, GPU or not
        require_for_benchmark(args)
        os.environ.setdefault("PYTHONUNBUFFERED", "1")     # as `-m tldsl.bench` sets it, for the processes it starts
        from ..bench.cli import main as bench
        return bench(args)
    if command == "check":
        return _run_check(args)
    if command == "fuzz":
        from ..testing.fuzz import main as fuzz
        return fuzz(args)
    from ..testing.mutants import main as mutants
    return mutants(args)


def answered(prog: str, run: Callable[[], int]) -> int:
    """``run()``'s exit status, where what the command was given cannot be (a shape, a schedule:
    a :class:`~tldsl.TldslError`) answered in one line on stderr, ``PROG: ErrorType: message``,
    and 2: no traceback, and no source line (the command line is the program). ``python -m tldsl
    COMMAND`` and ``python -m tldsl.bench`` both answer so."""
    from ..errors import TldslError
    try:
        return run()
    except TldslError as e:
        why = getattr(e, "raw_message", None) or str(e)
        print(f"{prog}: {type(e).__name__}: {why}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("demo", "bench", "check", "mutants", "fuzz"):
        try:
            return answered(f"{PROG} {argv[0]}", lambda: _forwarded(argv[0], argv[1:]))
        except Unavailable as why:
            print(f"{PROG} {why}", file=sys.stderr)
            return 1
    args = _parser().parse_args(argv)
    if args.command is None:
        _parser().print_help()
        return 2
    if args.command == "version":
        from .. import __version__
        print(f"tldsl {__version__}")
        return 0
    if args.command == "cache":
        from . import cache
        return cache.info() if args.action == "info" else cache.clear()
    from . import doctor
    return doctor.main()
