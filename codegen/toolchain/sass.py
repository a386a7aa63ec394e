"""Look inside a cubin without a GPU: ``cuobjdump --dump-sass`` / ``--dump-resource-usage``.

What the checks care about, per kernel:

* instruction mnemonics — ``HGMMA`` (WGMMA ran as tensor-core code, not a trap), ``HMMA``
  (``mma.sync``; :func:`tensor_core_problems` checks both against a lowering's dots), ``UTMALDG`` /
  ``UTMASTG`` (TMA loads / stores), ``SYNCS.*`` (mbarrier ops), ``BPT.TRAP`` (a trap compiled in:
  e.g. GMMA built for ``sm_90`` instead of ``sm_90a``, or a CUTLASS barrier without support),
  ``LDL`` / ``STL`` (local memory: spills or a stack array);
* resources — registers, shared memory, local memory (spill) bytes, stack.

:func:`parse_ptxas_log` reads the same resources from the ``ptxas -v`` lines in an NVRTC log
(no cuobjdump needed).
"""
from __future__ import annotations

import os
import re
import subprocess
import tempfile
from collections import Counter
from dataclasses import dataclass, field

from ...ir.display import clipped, html_card, one_line
from .locate import ToolchainError, find_toolchain


@dataclass
class KernelSass:
    name: str
    instructions: list[str] = field(default_factory=list)   # full opcodes with modifiers, in order
    lines: list[str] = field(default_factory=list)          # ... the whole instructions, operands included
    registers: int | None = None
    shared_bytes: int | None = None       # static shared memory (dynamic smem is set at launch)
    local_bytes: int | None = None        # per-thread local memory (spills, stack arrays)
    stack_bytes: int | None = None
    constant_bytes: int | None = None

    @property
    def opcodes(self) -> Counter:
        """Count per full opcode, e.g. ``HGMMA.64x128x16.F32`` or ``SYNCS.ARRIVE.TRANS64.A1T0``."""
        return Counter(self.instructions)

    @property
    def mnemonics(self) -> Counter:
        """Count per base mnemonic (the text before the first dot), except ``SYNCS``/``BPT``,
        which keep their first modifier (``SYNCS.ARRIVE``, ``BPT.TRAP``)."""
        c: Counter = Counter()
        for ins in self.instructions:
            parts = ins.split(".")
            base = parts[0]
            if base in ("SYNCS", "BPT", "BAR", "UTMACCTL") and len(parts) > 1:
                base = f"{parts[0]}.{parts[1]}"
            c[base] += 1
        return c

    def count(self, prefix: str) -> int:
        """Instructions whose opcode starts with ``prefix`` (``"HGMMA"``, ``"SYNCS"``, ``"BPT.TRAP"``)."""
        return sum(1 for ins in self.instructions if ins == prefix or ins.startswith(prefix + "."))

    @property
    def spill_instructions(self) -> int:
        return self.count("LDL") + self.count("STL")

    def __repr__(self) -> str:
        """One line (``instructions``: the whole listing)."""
        return one_line(f"<KernelSass {self.name}: {len(self.instructions)} instructions, {self.registers} registers, "
                        f"{self.count('HGMMA')} HGMMA, {self.spill_instructions} spill instructions>")

    def summary(self) -> dict:
        return {"registers": self.registers, "shared_bytes": self.shared_bytes, "local_bytes": self.local_bytes,
                "stack_bytes": self.stack_bytes, "HGMMA": self.count("HGMMA"), "UTMALDG": self.count("UTMALDG"),
                "UTMASTG": self.count("UTMASTG"), "SYNCS": self.count("SYNCS"), "BPT.TRAP": self.count("BPT.TRAP"),
                "LDL/STL": self.spill_instructions, "instructions": len(self.instructions)}


@dataclass
class SassReport:
    kernels: dict[str, KernelSass]
    sass_text: str = ""

    def __getitem__(self, name: str) -> KernelSass:
        return self.kernels[name]

    def __repr__(self) -> str:
        """One line (``sass_text``: cuobjdump's listing)."""
        return one_line(f"<SassReport of {len(self.kernels)} kernel(s): {', '.join(self.kernels)}>")

    def _repr_html_(self) -> str:
        facts = [(name, ", ".join(f"{k} {v}" for k, v in k.summary().items())) for name, k in self.kernels.items()]
        listing = clipped(self.sass_text, where="the whole listing: .sass_text")
        return html_card("SASS (cuobjdump)", facts, [("listing", listing)] if self.sass_text else [])

    def only(self) -> KernelSass:
        """The one kernel of a single-kernel cubin."""
        if len(self.kernels) != 1:
            raise KeyError(f"cubin has {len(self.kernels)} kernels: {sorted(self.kernels)}")
        return next(iter(self.kernels.values()))


def tensor_core_problems(sass: KernelSass, wgmma: int, mma_sync: int) -> list[str]:
    """What is wrong with a kernel's tensor-core code, given how many of its ``dot`` s the lowering
    put on WGMMA and on ``mma.sync`` (empty: nothing): each WGMMA dot shows up as ``HGMMA``, each
    ``mma.sync`` dot as ``HMMA`` (never a scalar FMA loop), and neither appears without such a
    dot. One dot may be several instructions (unrolled tiles), so these are lower bounds."""
    out = []
    for name, want in (("HGMMA", wgmma), ("HMMA", mma_sync)):
        got = sass.count(name)
        if got < want or (want == 0 and got):
            out.append(f"{sass.name}: {got} {name} instruction(s) for {want} dot(s) lowered onto them")
    return out


_FUNC_RE = re.compile(r"^\s*Function\s*:\s*(\S+)")
_INS_RE = re.compile(r"^\s*/\*[0-9a-fA-F]{4,}\*/\s+(?P<body>[^;]*);")
_RES_FUNC_RE = re.compile(r"^\s*Function\s+(\S+?):\s*$")
_RES_KV_RE = re.compile(r"(REG|STACK|SHARED|LOCAL|CONSTANT\[0\]):(\d+)")


def parse_sass_lines(text: str) -> dict[str, list[str]]:
    """``Function : name`` sections of ``cuobjdump --dump-sass`` -> whole instructions, in order
    (predicate guard and operands kept, e.g. ``@P0 LDGSTS.E.BYPASS.128 [R35+0x800], desc[UR30][R6.64]``)."""
    out: dict[str, list[str]] = {}
    cur = None
    for line in text.splitlines():
        m = _FUNC_RE.match(line)
        if m:
            cur = m.group(1)
            out.setdefault(cur, [])
            continue
        if cur is None:
            continue
        m = _INS_RE.match(line)
        if m and m.group("body").strip():
            out[cur].append(" ".join(m.group("body").split()))
    return out


def opcode_of(line: str) -> str | None:
    """The full opcode of one instruction of :func:`parse_sass_lines` (its predicate guard skipped)."""
    toks = line.split()
    if toks and toks[0].startswith("@"):     # predicate guard: @P0, @!PT, @UP1 ...
        toks = toks[1:]
    return toks[0] if toks else None


def opcodes_of(lines: list[str]) -> list[str]:
    """The full opcodes of :func:`parse_sass_lines`' instructions, in order."""
    return [op for op in map(opcode_of, lines) if op]


def parse_sass(text: str) -> dict[str, list[str]]:
    """``Function : name`` sections of ``cuobjdump --dump-sass`` -> opcode lists."""
    return {name: opcodes_of(lines) for name, lines in parse_sass_lines(text).items()}


def parse_resource_usage(text: str) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    cur = None
    for line in text.splitlines():
        m = _RES_FUNC_RE.match(line)
        if m:
            cur = m.group(1)
            continue
        if cur and "REG:" in line:
            out[cur] = {k: int(v) for k, v in _RES_KV_RE.findall(line)}
            cur = None
    return out


def _run(exe: str, args: list[str]) -> str:
    r = subprocess.run([exe, *args], capture_output=True)
    if r.returncode != 0:
        raise ToolchainError(f"{os.path.basename(exe)} {' '.join(args[:-1])} failed ({r.returncode}): "
                             + r.stderr.decode(errors="replace")[-2000:])
    return r.stdout.decode(errors="replace")


def analyze_cubin(cubin: bytes, cuobjdump: str | None = None) -> SassReport:
    """Disassemble ``cubin`` and collect per-kernel opcodes and resource usage."""
    exe = cuobjdump or (str(find_toolchain().cuobjdump) if find_toolchain().cuobjdump else None)
    if not exe:
        raise ToolchainError("cuobjdump not found: pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm "
                             "(or set TLDSL_CUOBJDUMP)")
    fd, path = tempfile.mkstemp(suffix=".cubin", prefix="tldsl-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(cubin)
        sass = _run(exe, ["--dump-sass", path])
        res = _run(exe, ["--dump-resource-usage", path])
    finally:
        os.unlink(path)
    kernels: dict[str, KernelSass] = {}
    for name, lines in parse_sass_lines(sass).items():
        kernels[name] = KernelSass(name, opcodes_of(lines), lines)
    for name, r in parse_resource_usage(res).items():
        k = kernels.setdefault(name, KernelSass(name))
        k.registers, k.shared_bytes = r.get("REG"), r.get("SHARED")
        k.local_bytes, k.stack_bytes, k.constant_bytes = r.get("LOCAL"), r.get("STACK"), r.get("CONSTANT[0]")
    return SassReport(kernels, sass)


_PTXAS_FUNC = re.compile(r"Compiling entry function '([^']+)'|Function properties for (\S+)")
_PTXAS_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_REGS = re.compile(r"Used (\d+) registers")


def parse_ptxas_log(log: str) -> dict[str, dict[str, int]]:
    """``{function: {registers, stack_bytes, spill_store_bytes, spill_load_bytes}}`` from ``ptxas -v``."""
    out: dict[str, dict[str, int]] = {}
    cur = None
    for line in log.splitlines():
        m = _PTXAS_FUNC.search(line)
        if m:
            cur = m.group(1) or m.group(2)
            out.setdefault(cur, {})
            continue
        if cur is None:
            continue
        m = _PTXAS_SPILL.search(line)
        if m:
            out[cur].update(stack_bytes=int(m.group(1)), spill_store_bytes=int(m.group(2)),
                            spill_load_bytes=int(m.group(3)))
        m = _PTXAS_REGS.search(line)
        if m:
            out[cur]["registers"] = int(m.group(1))
    return out
