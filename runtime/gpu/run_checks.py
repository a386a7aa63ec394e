"""What the simulator refuses while a program runs, checked by the GPU kernels too.

A wait's count computed at run time (a table entry, the rank) must be positive and no more than
its slot's notifies per launch; the simulator raises at the wait. The generated wait checks
the same (``signals.hpp``: ``tldsl::checked_count``): a failed check writes one 64-bit word of
host memory mapped into the kernel's module (``tldsl_run_checks``: ``(site + 1) << 32`` and the
count) and lets the wait pass, so nothing hangs. ``tl.run`` clears the word before each launch
and reads it after: a failed check is a :class:`~.run_errors.RunCheckError` naming the wait's
line (``site``: the wait's count value, :func:`~tldsl.codegen.ir_queries.wait_site`, which the
rewrites lowering makes keep)."""
from __future__ import annotations

import ctypes

from ...codegen.ir_queries import wait_at_site
from .device import check, current_context
from .run_errors import RunCheckError

#: the global each generated module that checks counts has: where its kernels record a failure
SYMBOL = b"tldsl_run_checks"
#: what the generated code calls where it checks (the lowered kernels to attach the word to)
CHECK_CALL = "tldsl::checked_count("

_WORDS: dict[int, "RunCheckWord"] = {}       # context -> its word (kept for the process)


class RunCheckWord:
    """One 64-bit word of pinned host memory the GPU can write (``cuMemHostAlloc``, mapped)."""

    def __init__(self):
        from cuda.bindings import driver as cu
        flags = cu.CU_MEMHOSTALLOC_DEVICEMAP | cu.CU_MEMHOSTALLOC_PORTABLE
        self.host = int(check(cu.cuMemHostAlloc(8, flags), "cuMemHostAlloc(8 bytes for the run-time checks)"))
        self.device = int(check(cu.cuMemHostGetDevicePointer(self.host, 0), "cuMemHostGetDevicePointer"))
        self._word = ctypes.c_uint64.from_address(self.host)
        self._pointer = ctypes.c_uint64(self.device)       # what the modules' global is set to
        self.clear()

    def attach(self, module, name: str) -> bool:
        """Point ``module``'s ``tldsl_run_checks`` here; False where the module has none."""
        from cuda.bindings import driver as cu
        err, address, size = cu.cuModuleGetGlobal(module, SYMBOL)
        if err == cu.CUresult.CUDA_ERROR_NOT_FOUND:
            return False
        check((err,), f"cuModuleGetGlobal(tldsl_run_checks) of {name}")
        assert int(size) == 8, size
        check(cu.cuMemcpyHtoD(address, ctypes.addressof(self._pointer), 8),
              f"setting tldsl_run_checks of {name}")
        return True

    def clear(self) -> None:
        self._word.value = 0

    def read(self) -> int:
        return int(self._word.value)


def word_for_context() -> RunCheckWord:
    """The current context's word (made on first use)."""
    ctx = current_context()
    key = int(ctx) if ctx is not None else 0
    if key not in _WORDS:
        _WORDS[key] = RunCheckWord()
    return _WORDS[key]


def checks_counts(lowered) -> bool:
    """Whether ``lowered``'s source checks a wait count at run time (its module needs the word)."""
    return CHECK_CALL in getattr(lowered, "source", "")


def decode(word: int) -> tuple[int, int] | None:
    """``(site, count)`` of a recorded failure, or None where nothing failed."""
    if not word:
        return None
    site = (word >> 32) - 1
    count = word & 0xFFFFFFFF
    return site, count - (1 << 32) if count >= 1 << 31 else count


def failure(ir, word: int, launch: int) -> RunCheckError | None:
    """The error a recorded failure is, at the wait's line (None where nothing failed)."""
    got = decode(word)
    if got is None:
        return None
    site, count = got
    op = wait_at_site(ir, site)
    if op is None:
        return RunCheckError(f"launch {launch}: a wait's count was {count} at run time (check site {site}, no wait "
                             f"of kernel {ir.name}): the outputs of this launch are not to be trusted")
    most = op.attrs.get("per_launch")
    need = "positive" + (f" and at most the slot's {most} notifies per launch (per_launch)" if most else "")
    return RunCheckError(f"launch {launch}: {op.name} at {op.loc.short() if op.loc else '?'}: its count was {count} "
                         f"at run time; a wait's count must be {need} — tl.simulate refuses it too. The wait did "
                         f"not wait: the outputs of this launch are not to be trusted (the GPU is fine).",
                         at=(op.loc,), count=count, op=op.name)
