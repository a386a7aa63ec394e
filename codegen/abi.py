"""The kernel ABI every recipe produces and the GPU launcher reads: the flat ``extern "C"``
parameter list, the TMA descriptors the host encodes for it, the names generated code gives
kernel tensors and signals, and what every lowered kernel shares (compile, launch shape).

A recipe describes its kernel with these types only; ``tldsl.runtime.gpu`` binds arguments
by :attr:`KernelParam.source` and encodes :class:`TmaDescriptorSpec` s, so a new recipe needs
no launcher code."""
from __future__ import annotations

import numbers
import re
from dataclasses import dataclass

from .. import env
from ..ir import core
from ..ir.names import c_identifier
from ..ir.display import html_card, one_line
from ..errors import InputError
from .errors import LoweringError
from .toolchain.compiler import CompileJob, compile_cuda


# -- names in generated code ----------------------------------------------------------------------

def cident(s: str) -> str:
    """A C identifier made from an IR name (for tensors and signals: :func:`cname`)."""
    return c_identifier(s)


def cname(obj: core.Buffer | core.Signal) -> str:
    """How generated code spells a tensor or signal: the C name the tracer gave it, unique among
    the kernel's tensors (signals) even where two IR names differ only in characters a C
    identifier cannot hold (``"x-y"``, ``"x_y"``: :mod:`..ir.names`); else made from its name."""
    return obj.cname or c_identifier(obj.name)


def marker(loc) -> str:
    """The trailing comment that maps a generated line back to the tile program."""
    return f"  // tldsl: {loc.filename}:{loc.lineno}" if loc is not None else ""


def signal_param(sig: core.Signal) -> str:
    """Kernel parameter holding this rank's copy of a signal."""
    return f"sig_{cname(sig)}"


def peer_signal_param(sig: core.Signal) -> str:
    """Kernel parameter holding the table of every rank's copy of a signal."""
    return f"sig_{cname(sig)}_peers"


def signal_slot(sig: core.Signal, channel: str, rank: str | None = None) -> str:
    """C++ address of ``channel`` of a signal: this rank's copy, or ``rank`` 's through the
    table of every rank's copies."""
    if rank is None:
        return f"{signal_param(sig)} + {channel}"
    return f"{peer_signal_param(sig)}[{rank}] + {channel}"


def buffer_param(buf: core.Buffer) -> str:
    """Kernel parameter holding this rank's pointer to a tensor."""
    return f"buf_{cname(buf)}"


def peer_buffer_param(buf: core.Buffer) -> str:
    """Kernel parameter holding the table of every rank's pointer to a symmetric tensor."""
    return f"buf_{cname(buf)}_peers"


def table_param(buf: core.Buffer) -> str:
    """Kernel parameter holding an i32 table that index code reads (``load_scalar``)."""
    return f"tbl_{cname(buf)}"


def pointer_param(buf: core.Buffer) -> str:
    """Kernel parameter holding the base pointer of a tensor a template reads by pointer (a
    gathered A, per-row operands, the combine's gathered tensor)."""
    return f"ptr_{cname(buf)}"


def output_param(buf: core.Buffer) -> str:
    """Kernel parameter holding the base pointer of a tensor a template stores by pointer."""
    return f"out_{cname(buf)}"


#: the TMA descriptor parameters the recipes name by role (``tma_<role>``), not by a tensor
FIXED_TMA = frozenset({"a", "b", "c", "q", "k", "v", "o", "a_own", "a_copy", "a_slot"})


def tma_param(buf: core.Buffer) -> str:
    """Kernel parameter holding the TMA descriptor of a tensor named by its C name (a generated
    epilogue's stores; the fixed operands are ``tma_a``, ``tma_b``, ...: a tensor whose C name is
    one of those roles, an output called ``a`` say, gets ``tma_<name>_tensor``)."""
    name = cname(buf)
    if name in FIXED_TMA or re.fullmatch(r"push_\d+", name):
        name += "_tensor"
    return f"tma_{name}"


def entry_name(kernel: core.Kernel, part: core.Part, entry: str | None = None) -> str:
    """The ``extern "C"`` symbol of a part's kernel: ``entry`` when given, else
    ``tldsl_<kernel>_<part>``."""
    if entry is None:
        return cident(f"tldsl_{kernel.name}_{part.name}")
    if not isinstance(entry, str) or not re.fullmatch(r"[A-Za-z_]\w*", entry):
        raise LoweringError(f"entry={entry!r}: the kernel's extern \"C\" name must be a C identifier (a str), "
                            "or None for tldsl_<kernel>_<part>")
    if entry in CXX_KEYWORDS or entry in TAKEN_NAMES or entry.startswith(("__", "TLDSL_")) or re.match(r"_[A-Z]", entry):
        why = ("a C++ keyword" if entry in CXX_KEYWORDS else
               "a name the generated source already uses (a namespace, a CUDA or C name)" if entry in TAKEN_NAMES else
               "a macro prefix of the generated source" if entry.startswith("TLDSL_") else
               "reserved to the compiler (a name starting with __ or _ and a capital)")
        raise LoweringError(f"entry={entry!r}: the kernel's extern \"C\" name is {why}; NVRTC would refuse the "
                            f"source — choose another name, or None for tldsl_<kernel>_<part>")
    return entry


#: C++20's keywords and alternative tokens, which NVRTC's C++ front end refuses as a function's name
CXX_KEYWORDS = frozenset("""
    alignas alignof and and_eq asm auto bitand bitor bool break case catch char char8_t char16_t char32_t class
    compl concept const consteval constexpr constinit const_cast continue co_await co_return co_yield decltype
    default delete do double dynamic_cast else enum explicit export extern false float for friend goto if inline
    int long mutable namespace new noexcept not not_eq nullptr operator or or_eq private protected public
    register reinterpret_cast requires return short signed sizeof static static_assert static_cast struct switch
    template this thread_local throw true try typedef typeid typename union unsigned using virtual void volatile
    wchar_t while xor xor_eq""".split())

#: global names of the headers the kernels include: their namespaces, CUDA's built-in variables and
#: types, C's functions and macros (names NVRTC refuses for a kernel: "main" cannot be __global__,
#: the others are declared already or overloaded with "C" linkage)
TAKEN_NAMES = frozenset("""
    tldsl cute cutlass std cuda threadIdx blockIdx blockDim gridDim warpSize clusterIdx clusterDim main dim3 half
    half2 nv_bfloat16 nv_bfloat162 NULL printf malloc free memcpy memset assert abs fabs min max fmin fmax exp exp2
    exp10 expm1 log log2 log10 log1p sqrt rsqrt cbrt pow sin cos tan asin acos atan atan2 sinh cosh tanh erf erfc
    floor ceil round rint trunc fma fmod remainder isnan isinf signbit lround llround""".split())


def is_this_rank(v: core.Value | None) -> bool:
    """Whether a primitive's rank operand is absent or ``tl.rank()`` itself (this rank's copy)."""
    return v is None or (isinstance(v.owner, core.Op) and v.owner.name == "rank")


# -- host-side description ----------------------------------------------------------------------

@dataclass(frozen=True)
class TmaDescriptorSpec:
    """Arguments of ``cuTensorMapEncodeTiled`` for one kernel parameter (dims innermost first,
    strides in bytes for dims 1..rank-1, as the driver API takes them)."""
    param: str                      # kernel parameter, e.g. "tma_a"
    buffer: str                     # IR buffer it describes
    role: str                       # "A" | "B" | "C" | ...
    dtype: str                      # IR dtype name
    data_type: str                  # CUtensorMapDataType enumerator name
    global_dims: tuple[int, ...]
    global_strides: tuple[int, ...]
    box_dims: tuple[int, ...]
    element_strides: tuple[int, ...]
    swizzle: str
    interleave: str = "CU_TENSOR_MAP_INTERLEAVE_NONE"
    l2_promotion: str = "CU_TENSOR_MAP_L2_PROMOTION_L2_128B"
    oob_fill: str = "CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE"   # out-of-bounds elements read as zero

    def __post_init__(self):
        # cuTensorMapEncodeTiled takes no zero (or negative) extent: a recipe whose plan would
        # describe such a tensor refuses it here, at plan time (the part falls back to the general
        # lowering, which needs no descriptor), rather than at the launch
        if any(int(d) <= 0 for d in self.global_dims):
            raise LoweringError(f"TMA cannot describe tensor '{self.buffer}' (descriptor {self.param}): it has a zero "
                                f"extent, shape {list(reversed(self.global_dims))}")

    @property
    def rank(self) -> int:
        return len(self.global_dims)

    def encode(self, address: int) -> bytes:
        """The 128-byte ``CUtensorMap`` for a tensor at device ``address`` (needs the CUDA driver)."""
        import ctypes

        from cuda.bindings import driver as cu
        err, tmap = cu.cuTensorMapEncodeTiled(
            getattr(cu.CUtensorMapDataType, self.data_type), self.rank, address,
            [cu.cuuint64_t(x) for x in self.global_dims], [cu.cuuint64_t(x) for x in self.global_strides],
            [cu.cuuint32_t(x) for x in self.box_dims], [cu.cuuint32_t(x) for x in self.element_strides],
            getattr(cu.CUtensorMapInterleave, self.interleave), getattr(cu.CUtensorMapSwizzle, self.swizzle),
            getattr(cu.CUtensorMapL2promotion, self.l2_promotion), getattr(cu.CUtensorMapFloatOOBfill, self.oob_fill))
        if err != cu.CUresult.CUDA_SUCCESS:
            raise InputError(f"the TMA descriptor {self.param} of tensor '{self.buffer}' cannot be built: "
                             f"cuTensorMapEncodeTiled refused it ({getattr(err, 'name', err)}): shape "
                             f"{list(reversed(self.global_dims))} ({self.dtype}), byte strides "
                             f"{list(reversed(self.global_strides))}, box {list(reversed(self.box_dims))}, address "
                             f"{address:#x}{'' if address % 16 == 0 else ' (not 16-byte aligned)'}")
        return ctypes.string_at(tmap.getPtr(), 128)


#: what the runtime passes for a parameter, by the kind of its ``source`` ("<kind>:<name>" or
#: "<kind>"): every launcher binds arguments by this table, so a recipe needs no launcher code
SOURCES = {
    "tma": "the encoded TMA descriptor of the kernel's TmaDescriptorSpec <name>",
    "signal": "the address of this rank's counters of signal <name> (int64)",
    "peer_signals": "the address of a table of every rank's addresses of signal <name>",
    "peers": "the address of a table of every rank's addresses of symmetric tensor <name>",
    "buffer": "the address of tensor <name> (an i32 table, or a tensor read by pointer)",
    "data": "the address of tensor <name>, read element by element while peers write it",
    "scalar": "an int the caller passes by name with the tensors",
    "rank": "this rank", "launch": "the 1-based launch index (epoch)",
    "scratch": "the address of the kernel's global-memory scratch for tiles that do not fit in shared memory: "
               "its scratch_bytes_per_cta for every CTA of the launch, poisoned, private to the kernel and rank",
    "M": "a size fixed by the trace", "N": "a size fixed by the trace", "K": "a size fixed by the trace",
}
_NAMED = {"tma", "signal", "peer_signals", "peers", "buffer", "data", "scalar"}


@dataclass(frozen=True)
class KernelParam:
    """One entry of the flat ``extern "C"`` parameter list, in order."""
    name: str
    ctype: str          # C++ spelling
    kind: str           # "tma" | "i32" | "u64" | "ptr"
    source: str         # what the runtime passes (:data:`SOURCES`): "tma:<param>", "signal:<name>", "rank", ...
    value: int | None = None   # the value fixed by the trace (M, N, K), else None

    def __post_init__(self):
        kind, name = self.origin
        if kind not in SOURCES or (kind in _NAMED) != bool(name):
            raise ValueError(f"internal: kernel parameter {self.name} has source {self.source!r}; sources are "
                             + ", ".join(f"'{k}:<name>'" if k in _NAMED else f"'{k}'" for k in SOURCES))

    @property
    def origin(self) -> tuple[str, str | None]:
        """The source as (kind, name): ``("signal", "ready")``, ``("launch", None)``."""
        kind, sep, name = self.source.partition(":")
        return kind, (name if sep else None)


#: the parameters every generated kernel takes: this rank, and the launch index its waits count in
RANK_PARAM = KernelParam("rank", "int", "i32", "rank")
LAUNCH_PARAM = KernelParam("launch", "unsigned long long", "u64", "launch")
#: the general lowering's global-memory scratch (its spilled slots; CTA b's share starts at
#: ``b * scratch_bytes_per_cta``)
SCRATCH_PARAM = KernelParam("scratch", "unsigned char*", "ptr", "scratch")


def wait_timeout_options(wait_timeout_ns: int | None) -> tuple[str, ...]:
    """The NVRTC options of a build whose waits trap after ``wait_timeout_ns`` (``signals.hpp``);
    none without a timeout. While ``TLDSL_WAIT_TIMEOUT_NS`` is set (debugging a hang) the waits
    also print their slot before they trap; otherwise they only trap, because the printf alone
    costs a kernel speed (18 % on a folded grouped GEMM, BENCHMARKS.md, thirty-third session)."""
    if wait_timeout_ns is None:
        return ()
    if (not isinstance(wait_timeout_ns, numbers.Integral) or isinstance(wait_timeout_ns, bool)
            or not 1 <= wait_timeout_ns < env.MAX_WAIT_TIMEOUT_NS):
        # (past 2**64 - 1 the -D literal wraps: NVRTC made 2**64 a timeout of 0, trapping every wait that spins)
        raise InputError(f"wait_timeout_ns={wait_timeout_ns!r}: a positive int of nanoseconds below 2**64, the "
                         "kernels' unsigned 64-bit count (None: waits never time out)")
    return (f"-DTLDSL_WAIT_TIMEOUT_NS={int(wait_timeout_ns)}ull",) + wait_report_options()


#: the NVRTC option of a debug build whose timed-out waits print their slot before they trap
WAIT_REPORT_OPTION = "-DTLDSL_WAIT_TIMEOUT_REPORT"


def wait_report_options() -> tuple[str, ...]:
    """:data:`WAIT_REPORT_OPTION` while ``TLDSL_WAIT_TIMEOUT_NS`` is set: a timed-out wait prints
    its slot, the value it held and the one it needed before it traps."""
    return (WAIT_REPORT_OPTION,) if env.wait_timeout_ns() is not None else ()


def kernel_entry(entry: str, threads: int, params, body: list[str]) -> list[str]:
    """The ``extern "C"`` entry of a generated kernel: launch bounds (one CTA per SM), the flat
    parameter list in the recipe's order, and ``body`` (already indented)."""
    plist = ",\n    ".join(f"{p.ctype} {p.name}" for p in params)
    return [f'extern "C" __global__ void __launch_bounds__({threads}, 1)', f"{entry}(", f"    {plist}) {{",
            *body, "}", ""]


class LoweredKernel:
    """Mixin for lowered kernels: ``compile()`` plus a persistent kernel's launch shape.

    Expects ``source``, ``entry``, ``options``, and for the defaults below ``num_tiles`` and a
    ``config`` with ``threads`` and ``smem_bytes``."""

    def __init_subclass__(cls, **kw):
        # The recipes' lowered kernels are dataclasses, whose generated __repr__ would print the
        # whole CUDA source; a __repr__ already in the class body is one @dataclass leaves alone.
        super().__init_subclass__(**kw)
        if "__repr__" not in cls.__dict__:
            cls.__repr__ = LoweredKernel.__repr__

    def __repr__(self) -> str:
        """One line: which part, which entry, how big (``describe()`` and ``source``: the rest)."""
        lines = self.source.count("\n") + 1
        waits, notifies = getattr(self, "waits", 0), getattr(self, "notifies", 0)
        return one_line(f"<{type(self).__name__} {self.kernel_name}.{self.part} -> {self.entry}: "
                        f"W={self._world()}, {len(self.params)} params, {waits} waits, {notifies} notifies, "
                        f"{lines} lines of CUDA>")

    def _world(self):
        """The world size the kernel was lowered for (a recipe's field, else its program's)."""
        world = getattr(self, "world_size", None)
        if world is None and self.program is not None:
            world = self.program[0].world_size
        return "?" if world is None else world

    def _repr_html_(self) -> str:
        facts = [("part", f"{self.kernel_name}.{self.part}"), ("entry", self.entry),
                 ("world size", self._world()), ("NVRTC options", " ".join(self.options) or "none"),
                 ("parameters", ", ".join(p.name for p in self.params)),
                 *((f"{name} recipe refused", reason) for name, reason in self.declined)]
        return html_card(f"{type(self).__name__} (compile() builds the cubin)", facts,
                         [("describe()", self.describe()), (f"CUDA source ({self.source.count(chr(10)) + 1} lines)",
                                                            self.source)], open_first=True)

    #: the tile program it was lowered from, ``(kernel, part)``, set by the pipeline: the program
    #: a host protocol test runs in the simulator's rules (``runtime/sim/bound_launch.py``) in
    #: place of the kernel, rather than a model of it
    program = None
    #: ``(recipe, reason)`` of each recipe whose planner refused the part before this one took it
    #: (set by the pipeline; empty when the recipe made for the part lowered it)
    declined: tuple = ()

    def job(self):
        """This kernel as a :class:`.toolchain.compiler.CompileJob` (for ``compile_many``)."""
        return CompileJob(self.source, self.entry, tuple(self.options))

    def compile(self, **kw):
        """Compile with NVRTC (cached). Keyword arguments go to ``compile_cuda``: ``progress``
        (True, False, or a callable such as ``print`` in notebooks), ``cache``, ``heartbeat``
        (seconds between progress lines of a long compile)."""
        opts = tuple(self.options) + tuple(kw.pop("options", ()))
        return compile_cuda(self.source, self.entry, options=opts, **kw)

    @property
    def block(self) -> tuple[int, int, int]:
        return (self.config.threads, 1, 1)

    @property
    def smem_bytes(self) -> int:
        return self.config.smem_bytes

    @property
    def cluster_dims(self) -> tuple[int, int, int]:
        return (1, 1, 1)

    def grid(self, sm_count: int) -> tuple[int, int, int]:
        """Persistent launch: at most one CTA per SM (``sm_count`` may be lowered to leave SMs
        to communication kernels), never more CTAs than tiles."""
        return (max(1, min(self.num_tiles, sm_count)), 1, 1)

    def describe_tma(self) -> list[str]:
        """``describe()`` 's lines for the kernel's TMA descriptors (``tma``), one each."""
        return [f"  {t.param}: {t.buffer} dims={list(t.global_dims)} strides={list(t.global_strides)} "
                f"box={list(t.box_dims)} {t.swizzle}" for t in self.tma]
