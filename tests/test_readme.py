"""Every code block of the README runs exactly as printed: the blocks are cut out of README.md
and run unchanged, never a corrected copy.

* ``python`` blocks run in order in one namespace, as pasted into one session; the tile program's
  block builds its own inputs, checks its result, and prints the IR and the timeline.
* ``sh`` blocks: each command runs as printed (``python`` is this venv's interpreter) with no
  GPU visible (``CUDA_VISIBLE_DEVICES=``, so a GPU host runs the same check, not the benchmarks:
  those are timed on purpose, BENCHMARKS.md) and must succeed, except commands that need a GPU:
  those must refuse in one line that says so, with no traceback through tldsl's code. ``make`` targets run
  as ``make -n`` (the suite would run itself; the demo is ``python -m tldsl demo``, tested in
  test_cli), ``pip install`` lines are checked against pyproject's extras (an install per test
  run would take minutes and the network).
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import tomllib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
BLOCKS = re.findall(r"^```(\w*)\n(.*?)^```", README.read_text(), flags=re.S | re.M)
#: the refusal of a command that cannot run on this machine (tldsl/cli: one line, no traceback)
REFUSAL = re.compile(r"^python -m tldsl[\w.]*: .*(GPU|torchrun)", re.M)


def blocks(language: str) -> list[str]:
    return [body for info, body in BLOCKS if info == language]


def test_every_block_is_python_or_sh():
    assert BLOCKS, "the README shows code"
    assert {info for info, _ in BLOCKS} <= {"python", "sh"}, [info for info, _ in BLOCKS]


def test_the_python_blocks_run_as_printed(capsys):
    ns: dict = {}
    for body in blocks("python"):
        exec(compile(body, str(README), "exec"), ns)
    out = capsys.readouterr().out
    assert "kernel @allgather_gemm" in out and "rank 3" in out         # the IR and the timeline printed
    inputs, b = ns["inputs"], ns["b"]
    assert all(np.isnan(inp["c"]).all() for inp in inputs), "the block's inputs are its own, untouched"
    want = (np.concatenate([inp["a"] for inp in inputs]).astype(np.float32) @ b.astype(np.float32)).astype(np.float16)
    for r in range(ns["W"]):
        np.testing.assert_array_equal(ns["result"][r]["c"], want)


def commands() -> list[str]:
    """The sh blocks' commands, comments and blank lines dropped."""
    out = []
    for body in blocks("sh"):
        for line in body.splitlines():
            line = line.split("#", 1)[0].strip()
            if line:
                out.append(line)
    return out


def _extras() -> set[str]:
    return set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])


def _run(command: str) -> tuple[str, int, str]:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="",
               PATH=os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]))
    words = shlex.split(command)
    if words[0] == "make":
        words = ["make", "-n", *words[1:]]
    p = subprocess.run(words, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    return command, p.returncode, p.stdout + p.stderr


def test_the_sh_blocks_run_as_printed():
    runnable = []
    for command in commands():
        words = shlex.split(command)
        if words[:2] == ["pip", "install"]:
            extras = {e for w in words[2:] for e in re.findall(r"\[([\w,]+)\]", w) for e in e.split(",")}
            assert extras and extras <= _extras(), f"{command!r}: pyproject.toml's extras are {sorted(_extras())}"
        else:
            assert words[0] in ("make", "python", "torchrun"), f"no rule to run {command!r}"
            runnable.append(command)
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(_run, runnable))
    for command, rc, out in results:
        if rc == 0:
            continue
        assert REFUSAL.search(out), f"{command!r} failed (rc {rc}) without saying why in one line:\n{out[-3000:]}"
        tldsl_frames = [line for line in out.splitlines()
                        if re.match(rf'\s*File "{re.escape(str(ROOT))}/(tldsl|ir|codegen|runtime)/', line)]
        assert not tldsl_frames, f"{command!r} refused with a traceback:\n{out[-3000:]}"


def test_the_readme_names_every_probe():
    """``python -m tldsl.bench probe NAME``: the README's list of probes is every name the command
    takes (a probe added without it was missing there)."""
    from tldsl.bench.probes import NAMES
    text = " ".join(README.read_text().split())
    missing = [n for n in NAMES if re.search(rf"\b{n}\b", text) is None]
    assert not missing, f"README.md does not name the probes {missing}"
