"""Shared pytest configuration."""


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "nvrtc: compiles CUDA with NVRTC from the pip wheels (no GPU needed); skipped, with the reason, "
        "only where those wheels are missing")
