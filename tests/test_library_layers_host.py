"""The maintained libraries under the GPU runtime, on CPU: kernels loaded through cuda.core (a
stand-in cuda.core and driver), the NVSHMEM host library found and handed to nvshmem4py, and the
launch-overhead benchmark's parsing, refusal, timing loop and table."""
import ctypes
import subprocess
import sys
from types import SimpleNamespace

import pytest

from tldsl.bench import launch as bench_launch
from tldsl.runtime.dist import nvshmem as nvm
from tldsl.runtime.gpu import module as module_mod


def test_the_launch_benchmark_refuses_in_one_line_without_a_gpu():
    from tldsl.cli.gates import gpu_missing
    if gpu_missing() is None:
        pytest.skip("a GPU is here: the benchmark would run")
    proc = subprocess.run([sys.executable, "-m", "tldsl.bench", "launch", "--args", "1,8"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1 and proc.stdout == "" and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and "needs a Hopper GPU" in proc.stderr


def test_the_launch_benchmark_parses_its_flags():
    args = bench_launch.parser().parse_args(["--args", "2,16", "--launches", "50", "--rounds", "7"])
    assert (args.args, args.launches, args.rounds, args.loads) == ([2, 16], 50, 7, 20)
    assert bench_launch.parser().parse_args([]).args == [1, 8, 24]
    for bad in ("x", "0", "1,300", ""):
        with pytest.raises(SystemExit):
            bench_launch.parser().parse_args(["--args", bad])


def test_the_benchmark_kernel_counts_its_launches_and_takes_n_pointers():
    src = bench_launch.kernel_source(3)
    assert "tl_bench_launch_3(unsigned long long* p0, unsigned long long* p1, unsigned long long* p2)" in src
    assert "p0[0] += 1ull" in src
    with pytest.raises(ValueError):
        bench_launch.kernel_source(0)


def test_launches_are_timed_in_turns_and_synchronised_between_batches():
    log = []
    fns = {"a": lambda: log.append("a"), "b": lambda: log.append("b")}
    out = bench_launch.time_launches(fns, launches=3, rounds=4, sync=lambda: log.append("|"))
    assert set(out) == {"a", "b"} and all(v["p10_us"] <= v["median_us"] <= v["p90_us"] for v in out.values())
    batches = "".join(log).split("|")
    assert batches[0] == "a" * 10 + "b" * 10                       # the warm-up, then a synchronize
    assert batches[1:-1] == ["aaa", "bbb", "bbb", "aaa"] * 2        # one batch at a time, the order rotating
    row = {"args": 8, "stream": "torch stream", "variant": "core launch", "median_us": 2.345, "p10_us": 2.0,
           "p90_us": 3.0, "counted": True}
    table = bench_launch.format_table({"rows": [row, dict(row, counted=False)]})
    assert "| 8 | torch stream | core launch | 2.35 | 2.00 | 3.00 | yes |" in table and table.endswith("| NO |")


class _FakeCore:
    """cuda.core's ObjectCode, recording what it was given."""

    def __init__(self):
        self.loaded = []
        core = self

        class ObjectCode:
            @staticmethod
            def from_cubin(data, name=""):
                core.loaded.append((bytes(data), name))
                return SimpleNamespace(get_kernel=lambda n: SimpleNamespace(handle=("CUkernel", n)))
        self.ObjectCode = ObjectCode


class _FakeDriver:
    def __init__(self):
        self.CUresult = SimpleNamespace(CUDA_SUCCESS=0)

    def cuKernelGetFunction(self, kernel):
        return (0, ("CUfunction", kernel[1]))

    def cuFuncGetModule(self, fn):
        return (0, ("CUmodule", fn[1]))


def test_kernels_load_through_cuda_core_and_keep_the_drivers_handles(monkeypatch):
    """load_cubin: cuda.core's ObjectCode loads the cubin and finds the kernel; the launch layer
    and NVSHMEM get the driver's CUfunction and CUmodule of it (cuKernelGetFunction,
    cuFuncGetModule), and the ObjectCode stays referenced."""
    import cuda.bindings
    core, drv = _FakeCore(), _FakeDriver()
    monkeypatch.setattr(module_mod, "object_code_type", lambda: core.ObjectCode)
    monkeypatch.setattr(cuda.bindings, "driver", drv)
    monkeypatch.setitem(sys.modules, "cuda.bindings.driver", drv)
    monkeypatch.setattr(module_mod, "check", lambda res, what: res[1])
    k = module_mod.load_cubin(b"\x7fELFcubin", "tl_k")
    assert core.loaded == [(b"\x7fELFcubin", "tl_k")]
    assert (k.name, k.function, k.module, k.smem_bytes) == ("tl_k", ("CUfunction", "tl_k"), ("CUmodule", "tl_k"), 0)
    assert k._image is not None


def test_cuda_core_is_found_under_either_of_its_names():
    assert module_mod.object_code_type().__name__ == "ObjectCode"


def test_the_host_library_is_loaded_by_path_before_nvshmem4py_binds_it(monkeypatch, tmp_path):
    """host_library(): the file find_host_library names is loaded into the global scope first
    (nvshmem4py resolves its functions there), then nvshmem4py's bindings are returned; without
    nvshmem4py, an NvshmemError that says what to install."""
    lib = tmp_path / "libnvshmem_host.so.3"
    lib.write_bytes(b"")
    monkeypatch.setenv("TLDSL_NVSHMEM_HOSTLIB", str(lib))
    loaded = []
    monkeypatch.setattr(ctypes, "CDLL", lambda path, mode=0: loaded.append((path, mode)))
    fake = SimpleNamespace(malloc=lambda n: 0)
    monkeypatch.setitem(sys.modules, "nvshmem", SimpleNamespace(bindings=fake))
    monkeypatch.setitem(sys.modules, "nvshmem.bindings", fake)
    assert nvm.host_library() is fake and loaded == [(str(lib), ctypes.RTLD_GLOBAL)]
    monkeypatch.setitem(sys.modules, "nvshmem", None)
    monkeypatch.setitem(sys.modules, "nvshmem.bindings", None)
    with pytest.raises(nvm.NvshmemError, match="pip install nvshmem4py-cu13"):
        nvm.host_library()


def test_a_failed_nvshmem4py_call_names_the_c_function():
    def boom(*a):
        raise RuntimeError("Failed to dlopen libnvshmem")
    with pytest.raises(nvm.NvshmemError, match="nvshmem_malloc failed: RuntimeError: Failed to dlopen"):
        nvm.Nvshmem(SimpleNamespace(malloc=boom), 0, 1).malloc(64)
    with pytest.raises(nvm.NvshmemError, match="heap is too small"):
        nvm.Nvshmem(SimpleNamespace(malloc=lambda n: 0), 0, 1).malloc(64)


def test_the_nvshmem_library_check_reads_the_mapped_files(tmp_path):
    from tldsl.checks import nvshmem_library as check
    maps = tmp_path / "maps"
    maps.write_text("7f0000000000-7f0000100000 r-xp 00000000 08:01 1 /x/nvidia/nvshmem/lib/libnvshmem_host.so.3\n"
                    "7f0000100000-7f0000200000 r--p 00100000 08:01 1 /x/nvidia/nvshmem/lib/libnvshmem_host.so.3\n"
                    "7f0000300000-7f0000400000 r-xp 00000000 08:01 2 /usr/lib/libc.so.6\n"
                    "7ffd00000000-7ffd00001000 rw-p 00000000 00:00 0 [stack]\n")
    found = check.mapped(maps=str(maps))
    assert list(found.values()) == [[(0x7f0000000000, 0x7f0000100000), (0x7f0000100000, 0x7f0000200000)]]
    spans = next(iter(found.values()))
    assert check.outside({"a": 0x7f0000000010, "b": 0x7f0000300010, "c": 0}, spans) == ["b"]
