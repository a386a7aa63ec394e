"""``python -m tldsl``: every command, and the one-line answers where one cannot run here.

Most tests call :func:`tldsl.cli.main.main` in this process; the entry point itself, and the
refusals on a machine without a GPU, run as subprocesses (``CUDA_VISIBLE_DEVICES=""`` hides any
GPU, so they say the same on a GPU host)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import numpy as np
import pytest

from tldsl.cli import gates
from tldsl.cli.main import main
from tldsl.codegen.toolchain import KernelCache, Toolchain, ToolchainError
from tldsl.codegen.toolchain import nvshmem_match

ROOT = Path(__file__).resolve().parent.parent
COMMANDS = ("demo", "bench", "check", "mutants", "fuzz", "cache", "version", "doctor")


def _run(*args: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    return subprocess.run([sys.executable, "-m", "tldsl", *args], capture_output=True, text=True, timeout=300,
                          env={**clean, **env})


def _one_line_refusal(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and proc.stdout == "", (proc.stdout, proc.stderr)
    return lines[0]


def test_help_lists_every_command_benchmark_check_and_cache_action():
    proc = _run("--help")
    assert proc.returncode == 0, proc.stderr
    for name in (*COMMANDS, *gates.BENCHMARKS, *gates.CHECKS, "cache info", "cache clear"):
        assert name in proc.stdout, name


def test_the_readme_lists_every_command():
    """README's "lists every command" sentence names what --help lists (it once left out fuzz)."""
    import argparse
    from tldsl.cli.main import _parser
    sub = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    sentence = re.search(r"lists every command: (.*?); where one", (ROOT / "README.md").read_text(), re.S).group(1)
    listed = {name.split()[0] for name in re.findall(r"`([^`]+)`", sentence)}
    assert listed == set(sub.choices), (listed, set(sub.choices))


def test_the_tables_name_every_benchmark_and_check_there_is():
    from tldsl.bench import cli as bench_cli
    benchmarks = {name for names in re.findall(r"-m tldsl\.bench ([\w|]+)", bench_cli.__doc__)
                  for name in names.split("|")}
    assert benchmarks == set(gates.BENCHMARKS)
    checks = {p.stem for p in (ROOT / "tldsl" / "checks").glob("*_check.py")}
    assert checks == set(gates.CHECKS)


def test_unknown_command_is_one_line():
    proc = _run("frobnicate")
    assert proc.returncode == 2
    assert "frobnicate" in _one_line_refusal(proc)


def test_version(capsys):
    import tldsl
    assert main(["version"]) == 0
    assert capsys.readouterr().out.strip() == f"tldsl {tldsl.__version__}"


def test_demo_and_mutants_are_forwarded(capsys):
    assert main(["demo", "--world-size", "2", "--rows-per-rank", "12"]) == 0
    assert "PASS" in capsys.readouterr().out
    assert main(["mutants", "--op", "allgather_gemm", "--seeds", "1"]) == 0
    assert "caught" in capsys.readouterr().out


def test_cache_info_and_clear(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TLDSL_CACHE_DIR", str(tmp_path))
    assert main(["cache", "info"]) == 0
    out = capsys.readouterr().out
    assert str(tmp_path) in out and "TLDSL_CACHE_DIR" in out and "nothing" in out
    KernelCache(tmp_path).put("ab" * 32, b"\0" * 1000, {"kernel": "k"})
    KernelCache(tmp_path).put("cd" * 32, b"\0" * 3000, {"kernel": "k2"})
    (tmp_path / "autotune").mkdir()
    (tmp_path / "autotune" / f"{'ef' * 32}.json").write_text("{}")
    assert main(["cache", "info"]) == 0
    out = capsys.readouterr().out
    assert "2 compiled kernels, 1 autotuned schedule (5 files, " in out and "KiB" in out
    assert main(["cache", "clear"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"removing 2 compiled kernels, 1 autotuned schedule (5 files, ") and str(tmp_path) in out
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]
    assert main(["cache", "clear"]) == 0
    assert "nothing to remove" in capsys.readouterr().out


def test_cache_lists_and_clears_only_its_own_files(tmp_path, monkeypatch, capsys):
    """Found by an explorer's round: with TLDSL_CACHE_DIR naming a project folder, `cache clear`
    deleted every *.json one folder down (.vscode/settings.json, data/results.json) and `cache info`
    counted them. Only <2 hex>/<64 hex>.cubin|json, autotune/<64 hex>.json and a writer's .tmp-*
    there are the cache's."""
    monkeypatch.setenv("TLDSL_CACHE_DIR", str(tmp_path))
    foreign = {".vscode/settings.json": "{}", "data/results.json": "{}", "data/notes.txt": "kept",
               "ab/notes.json": "{}", f"ab/{'cd' * 32}.json": "{}", "autotune/winner.json": "{}",
               f"cd/{'cd' * 31}c.cubin": "", "data/.tmp-abc123": "", "ab/sub/x.json": "{}"}
    for rel, text in foreign.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert main(["cache", "info"]) == 0
    assert "holds: nothing" in capsys.readouterr().out
    assert main(["cache", "clear"]) == 0
    assert "nothing to remove" in capsys.readouterr().out
    KernelCache(tmp_path).put("ab" * 32, b"\0" * 10, {"kernel": "k"})
    (tmp_path / "ab" / ".tmp-x1y2z3_q").write_bytes(b"")
    (tmp_path / "autotune" / f"{'ef' * 32}.json").write_text("{}")
    assert main(["cache", "info"]) == 0
    assert "1 compiled kernel, 1 autotuned schedule (4 files, " in capsys.readouterr().out
    assert KernelCache(tmp_path).clear() == 4
    left = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert left == sorted(foreign), left


def test_cache_info_says_when_the_cache_is_a_file(tmp_path, monkeypatch, capsys):
    """Found by a user's round: TLDSL_CACHE_DIR naming a file was reported as an empty cache."""
    not_a_folder = tmp_path / "cache.txt"
    not_a_folder.write_text("x")
    monkeypatch.setenv("TLDSL_CACHE_DIR", str(not_a_folder))
    assert main(["cache", "info"]) == 1
    assert f"{not_a_folder} is not a folder" in capsys.readouterr().out


def test_doctor_reports_every_piece_one_line_each():
    proc = _run("doctor")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    labels = [line.split()[0] for line in proc.stdout.splitlines()]
    assert labels == ["tldsl", "python", "numpy", "torch", "cuda-python", "NVRTC", "SASS", "NVSHMEM", "GPU",
                      "torchrun"]


def test_doctor_and_compiling_refuse_a_torch_whose_nvshmem_differs_from_the_headers(tmp_path, monkeypatch, capsys):
    include = tmp_path / "nvshmem" / "include"
    (include / "non_abi").mkdir(parents=True)
    (include / "nvshmem.h").write_text("")
    (include / "non_abi" / "nvshmem_version.h").write_text(
        "#define NVSHMEM_VENDOR_MAJOR_VERSION 3\n#define NVSHMEM_VENDOR_MINOR_VERSION 4\n"
        "#define NVSHMEM_VENDOR_PATCH_VERSION 5\n")
    monkeypatch.setattr(nvshmem_match, "torch_nvshmem", lambda: ("2.14.0", "nvidia-nvshmem-cu13", "3.7.1"))
    why = nvshmem_match.mismatch(include)
    assert "torch 2.14.0 links NVSHMEM 3.7.1" in why and "are 3.4.5" in why and "Choose one" in why
    toolchain = Toolchain(tmp_path, tmp_path, tmp_path, "4.2.0.0", "13.0.85", "13.0.88", None,
                          nvshmem_include=include, nvshmem_version="3.4.5")
    with pytest.raises(ToolchainError, match="links NVSHMEM 3.7.1"):
        toolchain.require_nvshmem()

    from tldsl.cli import doctor
    monkeypatch.setattr(doctor, "findings", lambda: [doctor.nvshmem()])
    monkeypatch.setattr("tldsl.codegen.toolchain.find_toolchain", lambda: toolchain)
    assert doctor.main() == 1
    out, err = capsys.readouterr()
    assert out.startswith("NVSHMEM  MISMATCH: torch 2.14.0 links NVSHMEM 3.7.1") and "1 problem" in err

    monkeypatch.setattr(nvshmem_match, "torch_nvshmem", lambda: ("2.11.0", "nvidia-nvshmem-cu13", "3.4.5"))
    assert nvshmem_match.mismatch(include) is None
    toolchain.require_nvshmem()


def test_torchs_nvshmem_is_read_from_its_metadata(tmp_path, monkeypatch):
    meta = tmp_path / "torch-2.14.0.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.14.0\n"
                                   "Requires-Dist: filelock\n"
                                   'Requires-Dist: nvidia-nvshmem-cu13==3.7.1; platform_system == "Linux"\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        installed = metadata.version("nvidia-nvshmem-cu13")      # the library torch would load
    except metadata.PackageNotFoundError:
        installed = "3.7.1"                                      # else the version torch names
    assert nvshmem_match.torch_nvshmem() == ("2.14.0", "nvidia-nvshmem-cu13", installed)


@pytest.mark.parametrize("args, says", [
    (["bench", "gemm"], "bench gemm needs a Hopper GPU (sm_90a): no CUDA device here"),
    (["bench", "probe", "epilogue"], "bench probe epilogue needs a Hopper GPU"),
    (["bench", "ag_gemm", "--iters", "3"],
     "bench ag_gemm runs on 2 GPUs under torchrun: torchrun --nproc_per_node=2 -m tldsl bench ag_gemm --iters 3"),
    (["bench", "probe", "rs_order"], "torchrun --nproc_per_node=2 -m tldsl bench probe rs_order"),
    (["bench", "probe", "--iters", "3", "ag_group"], "bench probe ag_group needs a Hopper GPU"),
    (["bench", "probe", "--iters=3", "moe_dram"], "bench probe moe_dram needs a Hopper GPU"),
    (["bench", "probe", "--iters", "3", "rs_order"],
     "bench probe rs_order runs on 2 GPUs under torchrun: torchrun --nproc_per_node=2 -m tldsl bench probe --iters 3 "
     "rs_order"),
    (["check", "dist_check", "ag_gemm"], "torchrun --nproc_per_node=2 -m tldsl check dist_check ag_gemm"),
    (["check", "torch_ops_check"], "check torch_ops_check runs on 2 GPUs under torchrun"),
])
def test_what_cannot_run_here_says_why_in_one_line(args, says, monkeypatch, capsys):
    monkeypatch.setattr(gates, "gpu_missing", lambda: "no CUDA device here")
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    assert main(args) == 1
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and says in err, err


def test_the_bench_module_finds_the_probe_among_its_flags(monkeypatch, capsys):
    """``python -m tldsl.bench probe --iters 3 ag_group``: the probe named after a flag is the one
    gated (one GPU), not the flag."""
    from tldsl.bench import cli as bench_cli
    monkeypatch.setattr(gates, "gpu_missing", lambda: "no CUDA device here")
    assert bench_cli.main(["probe", "--iters", "3", "ag_group"]) == 1
    err = capsys.readouterr().err
    assert err.strip() == "python -m tldsl.bench: bench probe ag_group needs a Hopper GPU (sm_90a): no CUDA device here"
    assert gates.probe_name(["--rows", "a:1:random", "--iters=2", "moe_power", "--seconds", "1"]) == "moe_power"
    assert gates.probe_name(["--iters", "3"]) is None


def test_under_torchrun_without_a_gpu_and_without_nvrtc(monkeypatch, capsys):
    monkeypatch.setattr(gates, "gpu_missing", lambda: "no CUDA device here")
    monkeypatch.setattr(gates, "toolchain_missing", lambda: "CUDA toolchain incomplete: no NVRTC")
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(k, v)
    assert main(["check", "build_check"]) == 1
    assert "needs a Hopper GPU (sm_90a) on every rank: no CUDA device here" in capsys.readouterr().err
    assert main(["bench", "compile"]) == 1
    assert "bench compile needs the NVRTC toolchain (CUDA toolchain incomplete: no NVRTC)" in capsys.readouterr().err


def test_unknown_check_and_bare_check(capsys):
    assert main(["check", "nope"]) == 2
    assert "unknown check 'nope'" in capsys.readouterr().err
    assert main(["check"]) == 2
    usage = capsys.readouterr().out
    assert all(name in usage for name in gates.CHECKS)


def test_a_check_runs_as_its_module_where_it_needs_no_gpu(tmp_path, capsys, monkeypatch):
    import sys
    monkeypatch.delitem(sys.modules, "tldsl.checks.dist_check", raising=False)   # as in a fresh process
    log = tmp_path / "rank0.log"
    log.write_text("nothing stuck\n")
    assert main(["check", "dist_check", "explain", str(log)]) == 0
    assert "no stuck-wait" in capsys.readouterr().out


def test_help_of_a_forwarded_command_needs_no_gpu(capsys):
    with pytest.raises(SystemExit) as done:
        main(["bench", "gemm", "--help"])
    assert done.value.code == 0 and "--shapes" in capsys.readouterr().out


@pytest.mark.parametrize("check", gates.CHECKS)
def test_every_check_answers_help_without_a_gpu_or_running(check, capsys, monkeypatch):
    """``python -m tldsl check NAME --help`` shows the check's usage (as the bare ``check`` says it does)."""
    import sys
    monkeypatch.delitem(sys.modules, f"tldsl.checks.{check}", raising=False)
    assert main(["check", check, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: ") and check in out.splitlines()[0]


@pytest.mark.parametrize("args", [("bench", "gemm"), ("check", "lifetime_check")])
def test_without_a_gpu_the_entry_point_refuses_in_one_line(args):
    line = _one_line_refusal(_run(*args, CUDA_VISIBLE_DEVICES=""))
    assert line.startswith(f"python -m tldsl {' '.join(args)} ") and ("GPU" in line or "torchrun" in line)


def test_the_benchmark_module_itself_refuses_in_one_line_and_lists_every_benchmark():
    import subprocess
    import sys
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        env.pop(k, None)
    r = subprocess.run([sys.executable, "-m", "tldsl.bench", "ag_gemm"], capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.strip().count("\n") == 0 and "torchrun --nproc_per_node=2" in r.stderr
    h = subprocess.run([sys.executable, "-m", "tldsl.bench", "--help"], capture_output=True, text=True, timeout=120)
    assert h.returncode == 0
    for name in ("gemm", "ag_gemm", "gemm_rs", "compile", "probe", "host", "sim"):
        assert name in h.stdout.split("\n\n")[0], name


def test_compile_progress_takes_true_and_refuses_what_it_cannot_call(capsys):
    """progress=True (documented: lines on stderr) was handed on as the reporter itself and failed
    at the first report; a non-callable failed there too."""
    from tldsl.codegen.toolchain.compiler import ProgressEvent, print_progress, resolve_progress
    from tldsl.errors import InputError
    assert resolve_progress(True) is print_progress and resolve_progress(print) is print
    resolve_progress(False)(None)                                   # a reporter that says nothing
    with pytest.raises(InputError, match="progress=42: None, True, False or a function"):
        resolve_progress(42)
    assert ProgressEvent is not None


@pytest.mark.parametrize("argv, says", [(["copy_engine", "--iters", "3"], "copy_engine takes no --iters"),
                                        (["moe_power", "--iters", "3"], "moe_power takes no --iters"),
                                        (["moe_dram", "--iters", "0"], "--iters must be positive, got 0")])
def test_a_probe_refuses_an_iters_it_would_ignore(argv, says, capsys):
    from tldsl.bench import probes
    with pytest.raises(SystemExit) as done:
        probes.main(argv)
    assert done.value.code == 2 and says in capsys.readouterr().err


def test_the_compile_benchmark_makes_its_cache_dir_or_says_why_not(tmp_path):
    from tldsl.bench import compile as compile_bench
    taken = tmp_path / "a-file"
    taken.write_text("not a directory")
    with pytest.raises(SystemExit, match=f"--cache-dir {taken}: cannot create it"):
        compile_bench.main(["--cache-dir", str(taken)])
    full = tmp_path / "full"
    (full / "x").mkdir(parents=True)
    with pytest.raises(SystemExit, match="is not empty: a cold compile needs an empty cache"):
        compile_bench.main(["--cache-dir", str(full)])


@pytest.mark.parametrize("argv, says", [
    (["mutants", "--seeds", "0"], "argument --seeds: must be a positive int, got 0"),
    (["mutants", "--op", "nosuch"], "--op: no op 'nosuch' (choose from allgather_gemm,"),
    (["demo", "--world-size", "0"], "argument --world-size: must be a positive int, got 0"),
    (["demo", "--seed", "-5"], "argument --seed: must be an int of 0 or more, got -5"),
    (["demo", "-k", "x"], "argument -k: must be an int, got 'x'"),
    (["bench", "sim", "-W", "0"], "argument -W/--world-size: must be a positive int, got 0"),
    (["bench", "sim", "--repeats", "0"], "argument --repeats: must be a positive int, got 0"),
    (["bench", "compile", "--shape", "8x8"], "argument --shape: MxNxK of three positive ints, got '8x8'"),
    (["bench", "probe", "nosuch"], "argument what: invalid choice: 'nosuch'"),
    # a mistyped flag is a usage error on a machine without a GPU too (it was "needs a Hopper GPU")
    (["bench", "moe", "--bogus"], "unrecognized arguments: --bogus"),
    (["bench", "gemm", "--bogus"], "unrecognized arguments: --bogus"),
    (["bench", "attention", "--tile", "1,2"], "--tile: three integers BM,BN,BK"),
    (["bench", "probe", "--iters", "3", "copy_engine"], "copy_engine takes no --iters"),
    (["fuzz", "--only", "-1"], "argument --only: must be an int of 0 or more, got -1"),
])
def test_a_number_a_command_cannot_take_is_a_usage_error_in_one_line(argv, says, capsys):
    """Found by a user's round of the commands: each of these was a traceback from deep inside (an
    IndexError, a ZeroDivisionError, numpy's ValueError), or a misleading answer (no such op
    caught 0/0 mutants; an unknown probe was sent to torchrun)."""
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err, err


@pytest.mark.parametrize("argv, says", [
    (["--world-size", "99999999999999999999"], "argument --world-size: must be at most 64, got 9999"),
    (["--world-size", "1000"], "argument --world-size: must be at most 64, got 1000"),
    (["-n", "5000"], "argument -n: must be at most 1024, got 5000"),
    (["--world-size", "64", "--rows-per-rank", "1024"], "the demo allows at most 2**24 = 16777216"),
])
def test_the_demo_refuses_sizes_past_its_bounds_before_it_allocates(argv, says, capsys, monkeypatch):
    """A huge --world-size spun forever building W shards, and 1000 ran out of memory after a
    minute: the demo's sizes are bounded, a usage error before any array is made."""
    def allocates(*a, **k):
        raise AssertionError("the demo started making its arrays")
    monkeypatch.setattr(np.random, "default_rng", allocates)
    with pytest.raises(SystemExit) as done:
        main(["demo", *argv])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err, err


def test_what_a_command_is_given_and_tldsl_refuses_is_one_line_without_a_source_line(capsys):
    """A schedule or shape the command passes on and tldsl refuses: its typed error's message, once
    (the command line is the user's program: no tldsl or runpy source line)."""
    assert main(["bench", "sim", "--tile", "48", "-M", "64", "-N", "64", "-K", "64"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["python -m tldsl bench: ScheduleError: compute tile (48, 48, 48): need three powers of two "
                   "between 8 and 256 (BM, BN, BK)"]


def test_the_benchmark_module_answers_what_tldsl_refuses_in_one_line_too():
    """Found by an explorer's round: `python -m tldsl.bench sim --tile 7` (the form README shows)
    printed a traceback whose ScheduleError pointed at runpy, where `python -m tldsl bench sim
    --tile 7` answers in one line; both answer with the one handler now."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    proc = subprocess.run([sys.executable, "-m", "tldsl.bench", "sim", "-W", "2", "-M", "16", "-N", "16", "-K", "16",
                           "--repeats", "1", "--tile", "7"], capture_output=True, text=True, timeout=300,
                          env={**env, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 2
    assert _one_line_refusal(proc) == ("python -m tldsl.bench: ScheduleError: compute tile (7, 7, 7): need three "
                                       "powers of two between 8 and 256 (BM, BN, BK)")
