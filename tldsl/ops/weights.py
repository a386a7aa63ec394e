"""How an op's weight matrices are stored, and their tiles as the GEMMs multiply them.

``"kn"``: ``[K, N]`` (``[E, K, N]`` for experts), each matrix as the GEMM multiplies it (what
``torch.mm``'s and ``torch._grouped_mm``'s second operand is). ``"nk"``: ``[N, K]`` (``[E, N, K]``),
a torch ``Linear``'s weight (out x in) as it is kept — read as ``tl.trans`` of its tile, which the
GEMM recipes stage K-major, as A, with no transposed copy."""
from __future__ import annotations

import tldsl as tl
from tldsl.errors import InputError

WEIGHT_LAYOUTS = ("kn", "nk")


def weight_tile(w, r0, c0, rows: int, cols: int, weights: str = "kn", expert=None):
    """The ``[rows, cols]`` tile at ``(r0, c0)`` of the matrix the GEMM multiplies by (expert
    ``expert``'s of 3-d weights), out of bounds reading zero: stored ``"nk"``, the transpose of
    the ``[cols, rows]`` tile at ``(c0, r0)``."""
    lead = () if expert is None else (expert,)
    if weights == "nk":
        return tl.trans(tl.load(w, (*lead, c0, r0), (cols, rows)))
    return tl.load(w, (*lead, r0, c0), (rows, cols))


def matrix_dims(w, weights: str, what: str) -> tuple:
    """The weights' dims with the matrices' as the GEMM multiplies them (``(..., K, N)``), whichever
    way ``weights`` says ``w`` stores them; a bad ``weights`` or a ``w`` of fewer than two dims is a
    CompilationError naming ``what`` (the op), raised while it is traced."""
    tl.static_assert(isinstance(weights, str) and weights in WEIGHT_LAYOUTS,
                     f"{what}: weights must be one of {WEIGHT_LAYOUTS}, got {weights!r}")
    tl.static_assert(len(w.shape) >= 2, f"{what}: the weights '{w.name}' must hold matrices (at least 2-d), "
                                        f"got {list(w.shape)}")
    *lead, a, b = w.shape
    return (*lead, b, a) if weights == "nk" else (*lead, a, b)


def stored_form(weights: str, nk_shape: str) -> str:
    """``" (weights='nk': <nk_shape>)"`` for a message about weights stored ``"nk"``, else nothing
    (the default layout's messages stay as they were)."""
    return f" (weights={weights!r}: {nk_shape})" if weights == "nk" else ""


def check_weight_layout(who: str, weights) -> None:
    """An InputError naming ``who`` unless ``weights`` is one of :data:`WEIGHT_LAYOUTS` (a host
    wrapper's check, before anything is traced)."""
    if not isinstance(weights, str) or weights not in WEIGHT_LAYOUTS:
        raise InputError(f"{who}: weights must be one of {WEIGHT_LAYOUTS} ('kn': each matrix stored [..., K, N], as "
                         f"the GEMM multiplies it; 'nk': [..., N, K], as torch Linear weights), got {weights!r}")
