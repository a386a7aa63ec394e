"""The prepared launch's driver calls, against a stand-in driver (no GPU needed)."""
from types import SimpleNamespace

from tldsl.runtime.gpu import launch as launch_mod


class _Config(SimpleNamespace):
    pass


class _FakeDriver:
    """The few names of cuda.bindings.driver a launch touches; records each launch."""

    def __init__(self):
        self.calls, self.configs = [], 0
        self.CUresult = SimpleNamespace(CUDA_SUCCESS=0)
        self.CUlaunchAttributeID = SimpleNamespace(CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION=4)

    def CUlaunchConfig(self):
        self.configs += 1
        return _Config()

    def CUlaunchAttribute(self):
        return SimpleNamespace(id=None, value=SimpleNamespace(clusterDim=SimpleNamespace(x=0, y=0, z=0)))

    def cuLaunchKernel(self, fn, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        self.calls.append(("cuLaunchKernel", fn, (gx, gy, gz), (bx, by, bz), smem, stream))
        return (0,)

    def cuLaunchKernelEx(self, cfg, fn, params, extra):
        a = cfg.attrs[0].value.clusterDim
        self.calls.append(("cuLaunchKernelEx", fn, (cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ),
                           (a.x, a.y, a.z), cfg.sharedMemBytes, cfg.hStream))
        return (0,)


def test_cluster_launch_builds_its_configuration_once(monkeypatch):
    """A prepared cluster launch builds its ``CUlaunchConfig`` on its first launch (cuda-python
    took 7 µs a launch to build it) and sets only the stream after; a kernel whose dynamic shared
    memory changed gets a new one. Launches without clusters take ``cuLaunchKernel``."""
    drv = _FakeDriver()
    monkeypatch.setattr(launch_mod, "_DRIVER", [(drv, 0)])
    kernel = SimpleNamespace(function="fn", name="k", smem_bytes=1024)
    pack = launch_mod.ArgPack()
    pack.add("i32", 0)
    prepared = launch_mod.PreparedLaunch(kernel, (8, 1, 1), (384, 1, 1), pack, 0, cluster=(2, 1, 1))
    for L, stream in ((1, 11), (2, 22), (3, 11)):
        prepared.launch(stream, L)
    assert drv.configs == 1 and pack.holders[0].value == 3
    assert drv.calls == [("cuLaunchKernelEx", "fn", (8, 1, 1), (2, 1, 1), 1024, s) for s in (11, 22, 11)]
    kernel.smem_bytes = 2048
    prepared.launch(33, 4)
    assert drv.configs == 2 and drv.calls[-1] == ("cuLaunchKernelEx", "fn", (8, 1, 1), (2, 1, 1), 2048, 33)
    plain = launch_mod.PreparedLaunch(kernel, (8, 1, 1), (384, 1, 1), pack, None)
    plain.launch(44)
    assert drv.calls[-1] == ("cuLaunchKernel", "fn", (8, 1, 1), (384, 1, 1), 2048, 44) and drv.configs == 2


class _Tensor:
    """A stand-in for a CUDA tensor: an address."""

    def __init__(self, ptr):
        self.ptr = ptr

    def data_ptr(self):
        return self.ptr


def test_a_prepared_launch_holds_the_tensors_it_packed(monkeypatch):
    """A launch prepared once keeps every tensor whose address it packed (signals, tables) alive
    while it lives: a caller that drops its tensors cannot have the kernel write into memory the
    allocator has since given to others (a benchmark did, and read the corruption as a kernel's
    wrong result). ``hold=False`` (the ops' caches keyed by those addresses) keeps none."""
    import gc
    import weakref

    from tldsl.codegen.abi import KernelParam
    from tldsl.runtime.gpu import launcher as launcher_mod
    monkeypatch.setattr(launcher_mod, "signal_pointer", lambda entry, name, signals, slots=None: signals[name].data_ptr())

    class _Launcher(launcher_mod.Launcher):
        kernel, grid = SimpleNamespace(function="fn", name="k", smem_bytes=0), (1, 1, 1)
        lowered = SimpleNamespace(entry="k", tma=(), block=(32, 1, 1), cluster_dims=(1, 1, 1),
                                  params=[KernelParam("ready", "unsigned long long*", "ptr", "signal:ready"),
                                          KernelParam("table", "const int*", "ptr", "buffer:table")])

        def table_pointer(self, buffers, name):
            return buffers[name].data_ptr()

    sig, tab = _Tensor(4096), _Tensor(8192)
    refs = [weakref.ref(sig), weakref.ref(tab)]
    held = _Launcher().prepare({"table": tab}, {"ready": sig})
    assert [h.value for h in held.pack.holders] == [4096, 8192]
    del sig, tab
    gc.collect()
    assert all(r() is not None for r in refs)
    del held
    gc.collect()
    assert all(r() is None for r in refs)
    loose = _Launcher().prepare({"table": _Tensor(16)}, {"ready": _Tensor(32)}, hold=False)
    assert loose.pack.refs == [] and [h.value for h in loose.pack.holders] == [32, 16]
