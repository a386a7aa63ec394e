"""Every notebook in tutorials/ runs top to bottom without a cell error, exactly as committed,
and every plot cell draws an image.

Notebooks are executed with nbclient on the ``python3`` kernel, in ``tutorials/``. The kernel
is ipykernel's own ``python3`` spec, which runs this interpreter (``sys.executable``), where
tldsl is installed (editable) in CI; a ``python3`` kernelspec installed elsewhere on the
machine (pointing at another Python) is not consulted. The kernel's ``PYTHONPATH`` also gets
the repository root, so a plain checkout run as ``PYTHONPATH=. pytest`` works too (a relative
``.`` would point into ``tutorials/`` once the kernel runs there).

A notebook that compiles CUDA declares it in its metadata, ``"tldsl": {"requires": ["nvrtc",
"cuobjdump"]}``; where those wheels are missing it is skipped with the reason, like the NVRTC
tests (CI installs them: ``make install``).

A plot cell is a code cell that calls one of tldsl's plot functions or matplotlib; it must leave
an ``image/png`` output (a figure made under a non-interactive backend and ``plt.show()`` would
leave none). Code shown in a markdown cell would not be run, so markdown holds none: code goes
in code cells.
"""
from __future__ import annotations

import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="the test extra (nbformat, nbclient, ipykernel) runs the tutorials")
from nbclient import NotebookClient  # noqa: E402
from nbclient.exceptions import CellExecutionError  # noqa: E402
from jupyter_client.kernelspec import KernelSpecManager  # noqa: E402
from jupyter_client.manager import KernelManager  # noqa: E402

import tldsl

ROOT = Path(__file__).resolve().parent.parent
TUTORIALS = ROOT / "tutorials"
NOTEBOOKS = sorted(TUTORIALS.glob("*.ipynb"))
PLOTTING = re.compile(r"\bplot_timeline\(|\bplot_phases\(|matplotlib")
#: the tutorials that draw figures (each has at least one plot cell)
WITH_PLOTS = {"01_allgather_gemm", "03_fused_allgather_gemm_on_gpus", "04_your_own_tile_program"}


def _kernel_env() -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(ROOT)] + [os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    env.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")
    return env


def test_there_are_tutorials():
    names = {p.name for p in NOTEBOOKS}
    assert {"01_allgather_gemm.ipynb", "02_from_tile_program_to_cuda.ipynb",
            "03_fused_allgather_gemm_on_gpus.ipynb"} <= names, NOTEBOOKS


def plot_cells(nb) -> list[int]:
    return [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and PLOTTING.search(c.source)]


def test_the_tutorials_with_figures_have_plot_cells():
    for path in NOTEBOOKS:
        if path.stem in WITH_PLOTS:
            assert plot_cells(nbformat.read(path, as_version=4)), f"{path.name} has no plot cell"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_markdown_shows_no_code_that_does_not_run(path: Path):
    nb = nbformat.read(path, as_version=4)
    fenced = [i for i, c in enumerate(nb.cells) if c.cell_type == "markdown"
              and any(info != "text" for info in re.findall(r"^```(\w*)", c.source, flags=re.M)[::2])]
    assert not fenced, (f"{path.name}: markdown cells {fenced} show code in a fence (only ```text is not run); "
                        "put it in a code cell")


def _shown_programs(path: Path) -> list[tuple[str, str]]:
    """Each code cell of a notebook that calls its ``show_program`` helper, with what it prints:
    the helper cell and the calling cell run here, without a kernel (they only read source)."""
    import contextlib
    import io
    nb = nbformat.read(path, as_version=4)
    [helper] = [c.source for c in nb.cells if c.cell_type == "code" and "def show_program(" in c.source]
    ns: dict = {}
    exec("import inspect, os\nfrom pathlib import Path\nimport tldsl as tl\n" + helper, ns)
    out = []
    for c in nb.cells:
        if c.cell_type == "code" and "show_program(" in c.source and "def show_program(" not in c.source:
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed):
                exec(c.source, ns)
            out.append((c.source, printed.getvalue()))
    return out


def test_the_program_excerpts_of_tutorial_02_show_what_the_prose_and_the_generated_code_cite():
    """Section 4 printed lines 33-45 of gemm_reduce_scatter (its static_asserts) once the op had
    grown: neither the compute part nor the rs.store_tile call the prose and the generated
    TileNotifies' markers (gemm_reduce_scatter.py:46-52) talk about. Each excerpt now shows every
    line of its op's file that the traced IR cites (the lines generated code marks)."""
    import tldsl as tl
    from tldsl.ops.allgather_gemm import allgather_gemm
    from tldsl.ops.gemm import gemm
    from tldsl.ops.gemm_reduce_scatter import gemm_reduce_scatter
    S, bf16, W = tl.TensorSpec, tl.bfloat16, 2
    compute = tl.ComputeSchedule(tile=(128, 256, 64))
    traced = {
        "gemm": gemm.trace(1, S((512, 256), bf16), S((256, 512), bf16), S((512, 512), bf16), compute=compute),
        "allgather_gemm": allgather_gemm.trace(W, S((256, 256), bf16), S((256, 512), bf16), S((512, 512), bf16),
                                               compute=compute, comm=tl.CommSchedule(tile_m=128, mode="pull")),
        "gemm_reduce_scatter": gemm_reduce_scatter.trace(
            W, S((512, 128), bf16), S((128, 512), bf16), S((256, 512), bf16), compute=compute,
            comm=tl.CommSchedule(tile_m=128, mode="push", order="ring", sms=8)),
    }
    shown = _shown_programs(TUTORIALS / "02_from_tile_program_to_cuda.ipynb")
    names = [re.search(r"show_program\((\w+)", call).group(1) for call, _ in shown]
    assert sorted(names) == sorted(traced), names
    for name, (call, printed) in zip(names, shown):
        lines = {int(m.group(1)): m.group(2) for m in re.finditer(r"^ *(\d+) \| (.*)$", printed, flags=re.M)}
        cited = {op.loc.lineno for _, op in traced[name].walk()
                 if op.loc is not None and op.loc.filename.endswith(f"{name}.py")}
        assert cited and cited <= set(lines), (name, sorted(cited - set(lines)), printed)
        if name == "gemm_reduce_scatter":       # what section 4's prose names
            text = "\n".join(lines.values())
            assert "rs.store_tile(acc, r0, c0)" in text and "rs = reduce_scatter(" in text and "@tl.compute_part" in text


def _missing_requirement(nb) -> str | None:
    """Why a notebook's declared requirements (``metadata.tldsl.requires``) are not met here."""
    requires = set(nb.metadata.get("tldsl", {}).get("requires", []))
    unknown = requires - {"nvrtc", "cuobjdump"}
    assert not unknown, f"unknown notebook requirement(s) {sorted(unknown)}"
    if not requires:
        return None
    from tldsl.codegen import toolchain
    ok, why = toolchain.toolchain_available()
    if not ok:
        return f"CUDA wheels missing: {why}"
    if "cuobjdump" in requires and toolchain.find_toolchain().cuobjdump is None:
        return "cuobjdump missing: pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm"
    return None


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path: Path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    # tutorials are committed clean: outputs come from running them, not from the file
    stale = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and (c.outputs or c.execution_count)]
    assert not stale, f"{path.name}: clear the outputs of code cells {stale} before committing"
    why = _missing_requirement(nb)
    if why:
        pytest.skip(f"{path.name}: {why}")

    # one extra cell, in memory only: which interpreter and which tldsl the kernel used
    nb.cells.append(nbformat.v4.new_code_cell("import sys, tldsl; print(sys.executable); print(tldsl.__file__)"))
    # the kernel's channels on IPC sockets in a directory of its own: over TCP, jupyter_client
    # picks free ports and binds them later, and a notebook starting on another pytest worker
    # meanwhile can take one ("Address already in use", kernel dead). Socket paths stay short.
    sockets = tempfile.mkdtemp(prefix="tlnb")
    km = KernelManager(kernel_name="python3", kernel_spec_manager=KernelSpecManager(kernel_dirs=[]),
                       transport="ipc", ip=os.path.join(sockets, "k"))
    client = NotebookClient(nb, km=km, kernel_name="python3", timeout=120,
                            resources={"metadata": {"path": str(TUTORIALS)}})
    try:
        client.execute(env=_kernel_env())
    except CellExecutionError as e:
        pytest.fail(f"{path.name} failed:\n{e}", pytrace=False)
    finally:
        shutil.rmtree(sockets, ignore_errors=True)

    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.execution_count for c in code)
    errors = [o for c in code for o in c.outputs if o.output_type == "error"]
    assert not errors, errors
    executable, package = "".join(o.get("text", "") for o in code[-1].outputs).split()
    assert os.path.realpath(executable) == os.path.realpath(sys.executable)
    assert package == tldsl.__file__
    blank = [i for i in plot_cells(nb) if not any("image/png" in o.get("data", {}) for o in nb.cells[i].outputs)]
    assert not blank, f"{path.name}: plot cells {blank} drew no image"
