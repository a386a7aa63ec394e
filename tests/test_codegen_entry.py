"""``lower(..., entry=NAME)``: the kernel's extern "C" name is checked before anything is rendered
— a name NVRTC's C++ front end would refuse (a keyword, a namespace the source uses, a reserved
name, no identifier at all) is a LoweringError saying why, not a compile log."""
from __future__ import annotations

import re

import pytest

import tldsl as tl
from tldsl.codegen import lower
from tldsl.codegen.errors import LoweringError

F8 = tl.TensorSpec((8,), tl.float32)


@tl.kernel
def scale(x, y):
    @tl.compute_part(grid=(1,))
    def p(t):
        tl.store(y, (0,), tl.load(x, (0,), (8,)) * 2.0)


@pytest.mark.parametrize("entry,why", [
    ("int", "a C++ keyword"), ("class", "a C++ keyword"), ("xor", "a C++ keyword"),
    ("tldsl", "a name the generated source already uses"), ("threadIdx", "a name the generated source already uses"),
    ("main", "a name the generated source already uses"), ("printf", "a CUDA or C name"), ("min", "a CUDA or C name"),
    ("dim3", "a CUDA or C name"), ("NULL", "a CUDA or C name"), ("TLDSL_DEV", "a macro prefix"),
    ("__kernel", "reserved to the compiler"), ("_Entry", "reserved to the compiler"),
    ("9x", "must be a C identifier"), ("a b", "must be a C identifier"), (3, "must be a C identifier"),
])
def test_an_entry_nvrtc_would_refuse_is_refused_first(entry, why):
    with pytest.raises(LoweringError, match=re.escape(why)):
        lower(scale.trace(1, F8, F8), "p", entry=entry)


@pytest.mark.parametrize("entry", ["my_kernel", "_private", "Int", "integer"])
def test_any_other_identifier_names_the_kernel(entry):
    lk = lower(scale.trace(1, F8, F8), "p", entry=entry)
    assert lk.entry == entry and entry in lk.source
    pytest.importorskip("cuda.bindings")
    assert lk.compile().cubin
