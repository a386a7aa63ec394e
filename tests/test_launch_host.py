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
