"""The benchmark's ``--bind``: cpulists parsed as the kernel writes them, and the GPU's local
cores found in a sysfs tree and intersected with the cores this process may use."""
import os

from tldsl import cpu_binding


def test_parse_cpulist():
    assert cpu_binding.parse_cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert cpu_binding.parse_cpulist("5") == {5}
    assert cpu_binding.parse_cpulist("") == set()


def test_gpu_local_cpus_reads_sysfs(tmp_path, monkeypatch):
    allowed = sorted(os.sched_getaffinity(0))
    dev = tmp_path / "0000:18:00.0"
    dev.mkdir()
    (dev / "local_cpulist").write_text(f"{allowed[0]}-{allowed[0]},100000-100003\n")
    monkeypatch.setattr(cpu_binding, "gpu_pci_address", lambda d: "0000:18:00.0")
    # only the local cores this process may run on
    assert cpu_binding.gpu_local_cpus(0, sysfs=str(tmp_path)) == {allowed[0]}
    monkeypatch.setattr(cpu_binding, "gpu_pci_address", lambda d: "0000:99:00.0")     # no such device
    assert cpu_binding.gpu_local_cpus(0, sysfs=str(tmp_path)) == set()
    monkeypatch.setattr(cpu_binding, "gpu_local_cpus", lambda d: set())
    assert "not bound" in cpu_binding.bind_to_gpu(0)
    before = os.sched_getaffinity(0)
    try:
        monkeypatch.setattr(cpu_binding, "gpu_local_cpus", lambda d: {allowed[0]})
        assert cpu_binding.bind_to_gpu(0) == f"GPU 0: bound to its 1 local core(s) {allowed[0]}-{allowed[0]}"
        assert os.sched_getaffinity(0) == {allowed[0]}
    finally:
        os.sched_setaffinity(0, before)
