"""The README's tile program runs as written (with the inputs it describes), and is right."""
import re
from pathlib import Path

import numpy as np

README = Path(__file__).resolve().parent.parent / "README.md"


def test_the_readme_tile_program_runs_and_is_right(capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "the README shows a tile program"
    W, Ms, K, N = 4, 32, 64, 48
    rng = np.random.default_rng(0)
    shards = [rng.integers(-3, 4, (Ms, K)).astype(np.float16) for _ in range(W)]
    b = rng.integers(-3, 4, (K, N)).astype(np.float16)
    inputs = [{"a": s, "b": b, "c": np.full((W * Ms, N), np.nan, np.float16)} for s in shards]   # as it says
    ns = {"inputs": inputs}
    exec(compile(blocks[0], str(README), "exec"), ns)
    want = (np.concatenate(shards).astype(np.float32) @ b.astype(np.float32)).astype(np.float16)
    for r in range(W):
        np.testing.assert_array_equal(ns["result"][r]["c"], want)
    np.testing.assert_array_equal(ns["c0"], want)
    out = capsys.readouterr().out
    assert "kernel @allgather_gemm" in out and "rank 3" in out         # the IR and the timeline printed
