"""The differential fuzzer: generate distinct random tile programs, simulate each, lower and
compile every part, and (with --gpu, where a GPU and ``tl.run`` exist) run it on the GPU and
compare with the simulator, each output element within its own tolerance (a bound on the
GPU's legitimate error there: :mod:`.program_tolerance`).

    python -m tldsl.testing.fuzz [--programs N] [--seed S] [--family F] [--gpu [--sms N] [--hang-seconds S]]
                                 [--sass | --no-compile] [--show-source] [--only I]

One line per program: simulated, parts lowered (and why the others are not), kernels compiled,
compared. A summary gives the counts and the distribution (how many contain a dot, a tl.range
loop, parts linked by signals, communication over W >= 2 ranks). Exit status 1 when a program
fails in the simulator, its lowering crashes, a lowered kernel fails to compile, a general-lowering
kernel spills registers, ``--sass`` finds a problem or a GPU result differs (3 when a GPU run
hangs: the hung program is printed; 2 when ``--gpu`` finds no GPU to compare on); parts that do
not lower yet are counted, not failed.
``--only I`` reruns program I of the seed alone (of the same ``--family``; a failing program's
report prints that command). ``--family F`` (repeatable)
draws only programs of that family: ``single``, ``pipeline``, ``comm``, or one recipe's shape —
``combine`` (row-gather combines, the MoE top-k combine's; about two in a hundred programs of the
default mix), ``grouped_gemm`` (expert GEMMs over run-time tile tables) or ``attention`` (flash
attention), each alone or reading a producer's output. ``--sms N`` runs every program on N of the
GPU's SMs (``tl.run(sms=N)``): its parts' persistent CTAs then walk several tiles each, in the
compute schedule's order, where on a whole GPU the small generated grids give every tile a CTA
of its own; a program whose kernels need more SMs at once runs on all of them (counted).
Even-numbered programs take float inputs that are multiples of 1/64, odd-numbered ones any value
in [-1, 1]: on the former every product and short sum is exact, so a kernel rounding otherwise
than the simulator (an FMA where it rounds twice) agrees; on the latter it shows.
``--sass`` (needs cuobjdump) also disassembles
every kernel of the general lowering with a ``dot`` and fails the program where a dot is not on
the tensor cores (HGMMA for each the lowering put on WGMMA, HMMA for each on ``mma.sync``) or
where the kernel can trap — except a kernel with waits under ``--gpu``, whose waits are compiled
to trap after a timeout. (Parts a recipe lowers — GEMM, grouped GEMM, attention — have their
SASS checked by the recipes' own tests.)
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

from .program_case import Features, FuzzCase, features
from .program_tolerance import FP32_DOT_RUNS_AS_TF32, SAFETY, TOLERANCES
from .program_families import FAMILIES, FOCUSED, generate, generate_distinct
from .program_gen import RandomChooser
from ..cli.arg_types import nonnegative_int

FEATURE_NAMES = {"dot": "a dot", "range_loop": "a tl.range loop", "linked_parts": "parts linked by signals",
                 "communicates": "communication over W>=2", "ragged": "shapes not multiples of the tile",
                 "ordered_waits": "waiting compute tiles out of row order",
                 "waits_back": "parts waiting on each other"}


@dataclass
class Report:
    """What happened to one program."""
    index: int
    case: FuzzCase
    features: Features | None = None
    sim_error: str | None = None
    lowered: dict = field(default_factory=dict)          # part -> lowered kernel
    not_lowered: dict = field(default_factory=dict)      # part -> first line of the refusal
    compiled: list = field(default_factory=list)         # parts compiled
    nothing_to_compile: list = field(default_factory=list)   # lowered to a host-side plan (copy engine)
    compile_errors: dict = field(default_factory=dict)   # part -> error
    lowering_crashes: dict = field(default_factory=dict)  # part -> an exception other than LoweringError
    sass_checked: list = field(default_factory=list)     # parts with a dot whose SASS was checked (--sass)
    sass_problems: dict = field(default_factory=dict)    # part -> what its SASS shows wrong
    spills: dict = field(default_factory=dict)           # part -> the registers its general kernel spills
    spills_unchecked: list = field(default_factory=list)  # general kernels whose NVRTC log had no ptxas report
    compared: str = "not run"                            # "agrees" | "MISMATCH: ..." | why not run
    sms: int | None = None                               # the SMs its GPU run was planned on (None: all)
    multi_task_ctas: bool = False                        # a kernel of its GPU run got fewer CTAs than it takes
    reference: object = None
    context_lost: bool = False                           # its GPU fault left the CUDA context unusable

    @property
    def failed(self) -> bool:
        return bool(self.sim_error or self.compile_errors or self.lowering_crashes or self.sass_problems
                    or self.spills or self.compared.startswith("MISMATCH"))

    def line(self) -> str:
        f = self.features
        tags = [t for t, on in (("dot", f.dot), ("range", f.range_loop), ("linked", f.linked_parts),
                                ("comm", f.communicates)) if on] if f else []
        parts = len(self.lowered) + len(self.not_lowered) + len(self.lowering_crashes)
        head = f"#{self.index:04d} W={self.case.world_size} parts={parts} [{' '.join(tags)}]"
        if self.sim_error:
            return f"{head} SIMULATION FAILED: {self.sim_error}"
        bits = ["simulated ok", f"lowered {len(self.lowered)}/{parts}"]
        if self.not_lowered:
            bits[-1] += " (" + "; ".join(f"{p}: {why}" for p, why in self.not_lowered.items()) + ")"
        n_kernels = len(self.compiled) + len(self.compile_errors)
        if n_kernels or self.nothing_to_compile:
            bits.append(f"compiled {len(self.compiled)}/{n_kernels}"
                        + (f" + {len(self.nothing_to_compile)} copy-engine plan(s)" if self.nothing_to_compile else ""))
        for p, e in self.lowering_crashes.items():
            bits.append(f"LOWERING CRASHED {p}: {e}")
        for p, e in self.compile_errors.items():
            bits.append(f"COMPILE FAILED {p}: {e}")
        if self.sass_checked:
            bits.append(f"SASS of {len(self.sass_checked)} kernel(s) with dots "
                        + ("ok" if not self.sass_problems else "WRONG"))
        for p, e in self.sass_problems.items():
            bits.append(f"SASS {p}: {e}")
        for p, e in self.spills.items():
            bits.append(f"SPILLS {p}: {e}")
        if self.spills_unchecked:
            bits.append(f"spills not checked (no ptxas report): {', '.join(self.spills_unchecked)}")
        where = (f" on {self.sms} SMs" if self.sms else "") + (", CTAs walking several tiles" if self.multi_task_ctas
                                                                else "")
        bits.append(f"gpu{where}: {self.compared}")
        return f"{head} " + " | ".join(bits)


def simulate(report: Report) -> None:
    try:
        report.features = features(report.case.trace())
        report.reference = report.case.simulate()
    except Exception as e:              # anything the simulator refuses is a failure of the generator or the simulator
        report.sim_error = f"{type(e).__name__}: {_first_line(e)}"


#: seconds a GPU run's waits spin before they trap (``tl.run(timeout_s=...)``); the kernels are
#: lowered so from the start, so those compiled up front are the ones tl.run loads (cache hits)
GPU_TIMEOUT_S = 60.0


def lower_parts(report: Report, gpu: bool = False) -> None:
    """Every part lowered, each refusal recorded by part — with ``gpu``, as ``tl.run`` lowers
    them (waits that trap after :data:`GPU_TIMEOUT_S`; a copy-engine part takes no options)."""
    from ..codegen import LoweringError, lower
    kernel = report.case.trace()
    for part in kernel.parts:
        opts = {"wait_timeout_ns": int(GPU_TIMEOUT_S * 1e9)} if gpu and part.engine != "copy_engine" else {}
        try:
            report.lowered[part.name] = lower(kernel, part.name, **opts)
        except LoweringError as e:
            report.not_lowered[part.name] = _reason(e)
        except Exception as e:          # lower() refuses with a LoweringError; anything else is its bug
            report.lowering_crashes[part.name] = f"{type(e).__name__}: {_first_line(e)}"


def compile_all(reports: list[Report], sass: bool = False, traps_allowed: bool = False) -> None:
    """Every lowered kernel of every program, compiled together (NVRTC's process pool; cached).
    Where one fails, each is compiled again alone (the others are cache hits) to say which. With
    ``sass``, each compiled general-lowering kernel with a dot is checked in its SASS
    (:func:`check_sass`); ``traps_allowed``: its waits were compiled to trap after a timeout.
    Every general-lowering kernel is checked for spilled registers (ptxas's report: issue 18
    asks for none at the default tiles)."""
    from ..codegen.toolchain.compiler import CompileJob, CudaCompileError, compile_many
    jobs, owners = [], []
    for rep in reports:
        for part, lk in rep.lowered.items():
            if hasattr(lk, "source") and hasattr(lk, "entry"):
                jobs.append(CompileJob(lk.source, lk.entry, tuple(lk.options)))
                owners.append((rep, part))
            else:
                rep.nothing_to_compile.append(part)
    failed, compiled = {}, {}
    try:
        compiled = dict(enumerate(compile_many(jobs, progress=False)))
    except CudaCompileError:
        for i, job in enumerate(jobs):
            try:
                [compiled[i]] = compile_many([job], progress=False)
            except CudaCompileError as e:
                failed[i] = _first_line(e)
    for i, (rep, part) in enumerate(owners):
        if i in failed:
            rep.compile_errors[part] = failed[i]
            continue
        rep.compiled.append(part)
        lk = rep.lowered[part]
        try:
            spilled = general_spills(lk, compiled[i])
        except NoPtxasReport:
            rep.spills_unchecked.append(part)
            spilled = None
        if spilled:
            rep.spills[part] = spilled
        if sass and getattr(lk, "dots", 0):
            rep.sass_checked.append(part)
            problems = check_sass(lk, compiled[i], traps_allowed and getattr(lk, "waits", 0) > 0)
            if problems:
                rep.sass_problems[part] = "; ".join(problems)


class NoPtxasReport(Exception):
    """The NVRTC log holds no ``ptxas -v`` report of a kernel, so its spills cannot be read there.
    (Seen on a GPU host whose NVRTC, compiling one kernel after another in one process, left
    every report out of its logs: BENCHMARKS.md, forty-seventh session.)"""

    def __init__(self, name: str, log: str):
        super().__init__(f"ptxas -v reported nothing for {name} in the NVRTC log ({len(log)} characters)")
        self.name, self.log = name, log


def general_spills(lowered, compiled) -> str | None:
    """What a general-lowering kernel spills to local memory, as ptxas reports it (None: nothing,
    or not a general-lowering kernel); :class:`NoPtxasReport` where the log holds no report."""
    from ..codegen.recipes.general import LoweredGeneral
    if not isinstance(lowered, LoweredGeneral):
        return None
    info = compiled.ptxas_info().get(compiled.name)
    if info is None:
        raise NoPtxasReport(compiled.name, compiled.log)
    stores, loads = info.get("spill_store_bytes", 0), info.get("spill_load_bytes", 0)
    return f"{stores} B spill stores, {loads} B spill loads" if stores or loads else None


def check_sass(lowered, compiled, traps_allowed: bool = False) -> list[str]:
    """What the SASS of a kernel with dots shows wrong: a dot not on the tensor cores (issue 18:
    WGMMA dots as HGMMA, ``mma.sync`` dots as HMMA, never a scalar loop) or a trap the kernel
    was not compiled to take (waits with a timeout trap by design)."""
    from ..codegen.toolchain.sass import tensor_core_problems
    k = compiled.sass()[compiled.name]
    wgmma = getattr(lowered, "wgmma_dots", 0)
    out = tensor_core_problems(k, wgmma, lowered.dots - wgmma)
    if not traps_allowed and k.count("BPT.TRAP"):
        out.append(f"{k.count('BPT.TRAP')} BPT.TRAP")
    return out


def _loses_the_context(e: BaseException) -> bool:
    """A fault on the GPU leaves this process's CUDA context unusable (sticky errors): every
    later comparison would fail for that reason alone."""
    from ..runtime.gpu.run_errors import GpuRunError
    return isinstance(e, GpuRunError) or any(code in str(e) for code in ("ILLEGAL_ADDRESS", "LAUNCH_FAILED"))


def gpu_unavailable() -> str | None:
    """Why the GPU comparison cannot run here, or None."""
    import tldsl as tl
    if not hasattr(tl, "run"):
        return "tl.run does not exist yet"
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device"
    return None


def compare_on_gpu(report: Report, hang_seconds: float = 120.0, out=None, sms: int | None = None) -> None:
    """Run the program with ``tl.run`` (on ``sms`` SMs where its kernels fit on them, else on all)
    and compare. A GPU kernel cannot be cancelled: a run still going after ``hang_seconds`` is
    reported as a hang, with the program, and the process ends."""
    import tldsl as tl
    from ..runtime.gpu.run_errors import ResidencyError
    case = report.case
    out = out or sys.stdout

    def hang():
        print(f"#{report.index:04d} HANG: tl.run did not return in {hang_seconds:.0f} s\n{case.source}", file=out,
              flush=True)
        os._exit(3)
    watchdog = threading.Timer(hang_seconds, hang)
    watchdog.daemon = True
    watchdog.start()
    try:
        try:
            result = tl.run(case.trace(), case.world_size, case.inputs, timeout_s=GPU_TIMEOUT_S, sms=sms)
            report.sms = sms
        except ResidencyError:
            if sms is None:
                raise
            result = tl.run(case.trace(), case.world_size, case.inputs, timeout_s=GPU_TIMEOUT_S)
        plan = getattr(result, "plan", None)     # (a stand-in for tl.run may return the simulator's result)
        report.multi_task_ctas = plan is not None and any(k.ctas < _unlimited_ctas(k.lowered)
                                                          for k in plan.kernels)
    except Exception as e:
        report.compared = f"MISMATCH: tl.run raised {type(e).__name__}: {_first_line(e)}"
        report.context_lost = _loses_the_context(e)
        return
    finally:
        watchdog.cancel()
    bad = case.mismatches(report.reference.outputs, result.outputs if hasattr(result, "outputs") else result)
    report.compared = "agrees" if not bad else "MISMATCH: " + "; ".join(bad[:3])


def replay_command(seed: int, index: int, families=None, gpu: bool = False, sms: int | None = None,
                   sass: bool = False) -> str:
    """The command that runs program ``index`` of ``seed`` again, alone, as this run ran it."""
    return (f"python -m tldsl.testing.fuzz --seed {seed}" + "".join(f" --family {f}" for f in families or ())
            + f" --only {index}" + (" --gpu" if gpu else "") + (f" --sms {sms}" if gpu and sms else "")
            + (" --sass" if sass else ""))


def _unlimited_ctas(lowered) -> int:
    """CTAs a lowered kernel would launch on a GPU without a limit on SMs (one a tile, a pair or a
    cluster's tile; a communication kernel's lanes): given fewer, some CTA walks several of them."""
    g = lowered.grid(1 << 30)
    return g[0] * g[1] * g[2]


def summary(reports: list[Report], seconds: float, compiled_kernels: bool = True, sass: bool = False,
            sms: int | None = None) -> list[str]:
    n = len(reports)
    ok = [r for r in reports if r.features is not None and not r.sim_error]
    parts = sum(len(r.lowered) + len(r.not_lowered) + len(r.lowering_crashes) for r in reports)
    crashes = sum(len(r.lowering_crashes) for r in reports)
    lowered = sum(len(r.lowered) for r in reports)
    kernels = sum(len(r.compiled) + len(r.compile_errors) for r in reports)
    compiled = sum(len(r.compiled) for r in reports)
    sass_checked = sum(len(r.sass_checked) for r in reports)
    sass_wrong = sum(len(r.sass_problems) for r in reports)
    spilling = sum(len(r.spills) for r in reports)
    unchecked = sum(len(r.spills_unchecked) for r in reports)
    compared = [r for r in reports if r.compared == "agrees" or r.compared.startswith("MISMATCH")]
    mismatched = sum(r.compared.startswith("MISMATCH") for r in reports)
    lines = [f"{n} programs: {len(ok)} simulated ok, {n - len(ok)} failed in the simulator; "
             f"{parts} parts: {lowered} lowered, {parts - lowered - crashes} not lowered yet"
             + (f", {crashes} crashed the lowering" if crashes else "") + "; "
             + (f"{compiled}/{kernels} kernels compiled, {spilling} general-lowering kernel(s) spilling registers"
                + (f" ({unchecked} not checked: no ptxas report in their NVRTC log)" if unchecked else "") + "; "
                if compiled_kernels else "not compiled (--no-compile); ")
             + (f"{sass_checked} with dots checked in SASS, {sass_wrong} wrong; " if sass else "")
             + (f"{len(compared)} compared on the GPU, {mismatched} mismatches" if compared else "not compared on a GPU")
             + f" ({seconds:.1f} s)"]
    if sms is not None and compared:
        on = sum(r.sms == sms for r in compared)
        walked = sum(r.multi_task_ctas for r in compared)
        lines.append(f"on {sms} SMs: {on} of the {len(compared)} compared programs (the others' kernels need more at "
                     f"once: run on every SM); {walked} with CTAs walking several tiles")
    lost = [r for r in reports if r.context_lost]
    if lost:
        skipped = sum(r.compared.startswith("not compared: the CUDA context was lost") for r in reports)
        lines.append(f"GPU comparisons stopped at program #{lost[0].index:04d}: its fault left the CUDA context "
                     f"unusable, so {skipped} later program(s) were not compared (run them with a fresh process)")
    by_recipe = Counter(_recipe_name(lk) for r in reports for lk in r.lowered.values())
    if by_recipe:
        lines.append("parts lowered by recipe: " + ", ".join(f"{name} {k}" for name, k in by_recipe.most_common()))
    reasons = Counter(re.sub(r"\d+", "N", why)[:100] for r in reports for why in r.not_lowered.values())
    if reasons:
        lines.append("not lowered, by reason: " + "; ".join(f"{n}x {why}" for why, n in reasons.most_common(6)))
    if ok:
        pct = {k: 100.0 * sum(getattr(r.features, k) for r in ok) / len(ok) for k in FEATURE_NAMES}
        dtypes = {d: 100.0 * sum(d in r.features.dtypes for r in ok) / len(ok) for d in ("f16", "bf16", "f32", "i32")}
        lines.append("distribution: " + ", ".join(f"{pct[k]:.0f}% {label}" for k, label in FEATURE_NAMES.items())
                     + "; dtypes " + ", ".join(f"{d} {v:.0f}%" for d, v in dtypes.items()))
    if lowered:
        reached = {what: sum(any(how(lk) for lk in r.lowered.values()) for r in ok) for what, how in LOWERING_PATHS}
        lines.append("general lowering paths: " + ", ".join(f"{n} programs {what}" for what, n in reached.items()))
    return lines


#: what the summary counts of the general lowering's kernels (which of its paths the programs
#: reach, so a run says what it exercised)
LOWERING_PATHS = (
    ("with tiles in registers", lambda lk: bool(getattr(lk, "held", ()))),
    ("fetching the next task's tiles early", lambda lk: "auto fetch" in getattr(lk, "source", "")),
    ("with a pipelined dot loop", lambda lk: "pipelined dot loop" in getattr(lk, "source", "")),
    ("with task groups", lambda lk: getattr(lk, "groups", 1) > 1),
    ("with one-element values in every thread's registers", lambda lk: bool(getattr(lk, "replicated", ()))),
)


def run(n: int, seed: int, gpu: bool = False, show_source: bool = False, only: int | None = None,
        compile_kernels: bool = True, out=None, hang_seconds: float = 120.0, sass: bool = False,
        sms: int | None = None, families=None) -> list[Report]:
    out = out or sys.stdout
    t0 = time.perf_counter()
    of = f" (families {', '.join(families)})" if families else ""
    print(f"seed {seed}{of}", file=out)
    if only is not None:
        programs = [(only, generate(RandomChooser(f"{seed}:{only}"), families))]
    else:
        programs = generate_distinct(n, seed, families=families)
    # odd-numbered programs take inputs of any value, even ones multiples of 1/64 (make_inputs'
    # exact): a backend rounding differently from the simulator shows only on the former
    reports = [Report(i, FuzzCase(p, f"fuzz seed {seed}{of} program {i}", exact_inputs=i % 2 == 0))
               for i, p in programs]
    why_no_gpu = gpu_unavailable() if gpu else None
    lost_at = None                          # the program whose fault lost the CUDA context
    for rep in reports:
        simulate(rep)
        if not rep.sim_error:
            lower_parts(rep, gpu and why_no_gpu is None)
    if compile_kernels:
        kernels = sum(len(r.lowered) for r in reports)
        print(f"simulated and lowered {len(reports)} programs in {time.perf_counter() - t0:.1f} s; compiling up to "
              f"{kernels} kernels with NVRTC ...", file=sys.stderr, flush=True)
        compile_all(reports, sass=sass, traps_allowed=gpu and why_no_gpu is None)
    for rep in reports:
        if rep.sim_error:
            pass
        elif not gpu:
            rep.compared = "not asked"
        elif lost_at is not None:
            rep.compared = f"not compared: the CUDA context was lost at program #{lost_at:04d}"
        elif why_no_gpu is None:
            compare_on_gpu(rep, hang_seconds, out, sms)
            if rep.context_lost:
                lost_at = rep.index
        else:
            rep.compared = f"not compared: {why_no_gpu}"
        print(rep.line(), file=out)
        if rep.failed:
            print("replay: " + replay_command(seed, rep.index, families, gpu, sms, sass), file=out)
        if show_source or rep.failed:
            print(rep.case.source, file=out)
    for line in summary(reports, time.perf_counter() - t0, compile_kernels, sass and compile_kernels, sms):
        print(line, file=out)
    return reports


def main(argv=None) -> int:
    called = sys.argv[0] if sys.argv[0].startswith("python -m") else "python -m tldsl.testing.fuzz"
    ap = argparse.ArgumentParser(prog=called, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=f"tolerances: per output element, {SAFETY:g} x a bound on the GPU's legitimate "
                                        "error carried through the program (tldsl.testing.program_tolerance); "
                                        "ulp per dtype: " + ", ".join(f"{k} {v.ulp:.3g}" for k, v in TOLERANCES.items()
                                                                      if k != "i1")
                                        + f"; fp32 dot runs as TF32 on the GPU: {FP32_DOT_RUNS_AS_TF32}")
    ap.add_argument("--programs", type=int, default=50, help="how many distinct programs (default 50)")
    ap.add_argument("--seed", type=int, default=None, help="the generator's seed (default: a fresh one, printed)")
    ap.add_argument("--gpu", action="store_true", help="also run each program on the GPU and compare")
    ap.add_argument("--show-source", action="store_true", help="print every program's source (failing ones always)")
    ap.add_argument("--only", type=nonnegative_int, default=None, metavar="I", help="only program I of this seed")
    ap.add_argument("--family", action="append", default=None, choices=sorted({**FAMILIES, **FOCUSED}),
                    help="only programs of this family (repeatable; default: the usual mix of single, pipeline "
                         "and comm)")
    ap.add_argument("--no-compile", action="store_true", help="lower but do not compile")
    ap.add_argument("--sass", action="store_true",
                    help="check the SASS of every general-lowering kernel with a dot: each dot on the tensor "
                         "cores, no trap (needs cuobjdump)")
    ap.add_argument("--sms", type=int, default=None, metavar="N",
                    help="with --gpu: run each program on N of the GPU's SMs (CTAs walking several tiles); "
                         "one whose kernels need more at once runs on all")
    ap.add_argument("--hang-seconds", type=float, default=120.0,
                    help="with --gpu: a program still running after this long is a hang (exit status 3)")
    args = ap.parse_args(argv)
    if args.programs < 1:
        ap.error("--programs must be positive")
    seed = args.seed if args.seed is not None else int(time.time()) % 1_000_000
    if args.gpu and gpu_unavailable() is not None:
        ap.exit(2, f"{called}: --gpu compares on a GPU, but {gpu_unavailable()} here (drop --gpu to simulate, "
                   f"lower and compile only)\n")
    if args.gpu:
        # every rank's parts run at once on their own streams: up to W x parts of them, more than
        # CUDA's default 8 hardware queues (tl.run refuses a launch whose streams would share one).
        # The queues are fixed when CUDA starts, so set them first (a value the caller set stays);
        # where CUDA has started already, setting it would only make tl.run believe in queues
        # that do not exist
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():
            if "CUDA_DEVICE_MAX_CONNECTIONS" not in os.environ:
                print("fuzz: CUDA started before the fuzzer, with 8 hardware queues: programs whose ranks need "
                      "more are refused (set CUDA_DEVICE_MAX_CONNECTIONS=32 before CUDA starts)", file=sys.stderr)
        else:
            os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")
    if args.sms is not None and (args.sms < 1 or not args.gpu):
        ap.error("--sms N: a positive number of SMs, with --gpu")
    if args.sass and args.no_compile:
        ap.error("--sass checks compiled kernels: drop --no-compile")
    if args.sass:
        from ..codegen import toolchain
        if toolchain.find_toolchain().cuobjdump is None:
            ap.error("--sass needs cuobjdump: pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm")
    reports = run(args.programs, seed, args.gpu, args.show_source, args.only, not args.no_compile,
                  hang_seconds=args.hang_seconds, sass=args.sass, sms=args.sms, families=args.family)
    return 1 if any(r.failed for r in reports) else 0


def _recipe_name(lowered) -> str:
    """``LoweredGeneral`` -> ``general``: the recipe a part was lowered by, as the summary names it."""
    name = type(lowered).__name__
    name = name[len("Lowered"):] if name.startswith("Lowered") else name
    return re.sub(r"(?<!^)([A-Z])", r"_\1", name).lower()


def _reason(e: BaseException) -> str:
    """A lowering refusal in one line: its message without the location; where it is only a
    heading ("no lowering recognises ...:"), the reason of the recipe meant for any part (the
    general one), else the first reason."""
    lines = [ln.strip() for ln in str(getattr(e, "raw_message", e)).strip().splitlines() if ln.strip()]
    if not lines:
        return type(e).__name__
    text = lines[0]
    if len(lines) > 1 and text.endswith(":"):     # the general recipe's reason, else the first
        text = next((ln for ln in lines[1:] if ln.startswith("general:")), lines[1])
    return text if len(text) <= 160 else text[:157] + "..."


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


if __name__ == "__main__":
    raise SystemExit(main())
