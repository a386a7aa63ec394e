"""Running a benchmark in several fresh processes and collecting each one's rows.

Some peers run faster or slower from one process to the next (``torch._grouped_mm`` on the
small-expert MoE rows: BENCHMARKS.md, thirtieth and thirty-first sessions), which repeats inside
one process cannot show. A benchmark that writes its rows with ``--json PATH`` can be run here P
times, each child a new interpreter (a new CUDA context, new allocations, library heuristics
chosen anew), and the parent summarizes the rows across them.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile


def child_argv(argv, drop: tuple[str, ...] = ("--processes", "--json")) -> list[str]:
    """``argv`` without the options in ``drop`` (each with its value, as ``--opt V`` or ``--opt=V``)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        name = a.split("=", 1)[0]
        if name in drop:
            skip = "=" not in a
            continue
        out.append(a)
    return out


def rows_per_process(bench: str, argv, processes: int, run=None, log=None) -> list[list[dict] | str]:
    """Run ``python -m tldsl.bench BENCH *argv --json TMP`` ``processes`` times, one after the
    other; per process its JSON ``rows``, or a one-line reason where it wrote none (it crashed:
    the last line of its stderr). The children's own tables go to ``log``, so the runs can be
    read one by one too (``run``, ``log``: :func:`subprocess.run` and stderr unless given)."""
    if processes < 1:
        raise ValueError(f"processes: a positive number, got {processes}")
    run = run or subprocess.run
    log = log or sys.stderr
    results: list[list[dict] | str] = []
    with tempfile.TemporaryDirectory(prefix="tldsl-bench-") as tmp:
        for i in range(processes):
            path = os.path.join(tmp, f"process{i}.json")
            cmd = [sys.executable, "-m", "tldsl.bench", bench, *argv, "--json", path]
            done = run(cmd, capture_output=True, text=True)
            print(f"# process {i + 1} of {processes}: {' '.join(cmd[1:-2])} (exit {done.returncode})", file=log)
            if done.stdout:
                print(done.stdout.rstrip(), file=log, flush=True)
            try:
                with open(path) as f:
                    results.append(json.load(f)["rows"])
            except (OSError, ValueError, KeyError):
                tail = (done.stderr or "").strip().splitlines()
                results.append(f"process {i + 1} wrote no rows (exit {done.returncode}): "
                               f"{tail[-1] if tail else 'no output'}")
    return results
