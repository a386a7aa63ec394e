"""What pyproject.toml promises: a wheel that carries every module, the C++ headers, py.typed
and the license, built without setuptools warnings; extras whose pins agree with the versions
the toolchain checks; and the README's and the Makefile's install lines using those extras."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from tldsl.cli.doctor import CUTLASS_SERIES
from tldsl.codegen.toolchain import CCCL_TESTED, REQUIREMENTS
from tldsl.codegen.toolchain.locate import NVRTC_REQUIRED
from tldsl.codegen.toolchain.nvshmem_match import NVSHMEM_PINNED

ROOT = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
EXTRAS = PROJECT["project"]["optional-dependencies"]
SETUP = PROJECT["tool"]["setuptools"]


def _pins(extra: str) -> dict[str, str]:
    return dict(re.match(r"([\w.-]+)==(\S+)$", r).groups() for r in EXTRAS[extra] if "==" in r)


def _package_dirs() -> dict[str, Path]:
    dirs: dict[str, Path] = {}
    for pkg in sorted(SETUP["packages"], key=lambda p: p.count(".")):
        parent, _, leaf = pkg.rpartition(".")
        dirs[pkg] = ROOT / SETUP["package-dir"][pkg] if pkg in SETUP["package-dir"] else dirs[parent] / leaf
    return dirs


def test_the_license_is_the_apache_2_0_text_pyproject_names():
    assert PROJECT["project"]["license"] == "Apache-2.0"
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License\n                           Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text and len(text.splitlines()) > 200


def test_every_folder_with_modules_is_a_listed_package():
    listed = {d.resolve() for d in _package_dirs().values()}
    for folder in ("tldsl", "ir", "codegen", "runtime"):
        for init in (ROOT / folder).rglob("__init__.py"):
            assert init.parent.resolve() in listed, f"{init.parent} is not in pyproject's packages"


def test_the_wheel_carries_modules_headers_py_typed_and_license_without_warnings(tmp_path):
    pytest.importorskip("setuptools")
    src = tmp_path / "src"
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, src / name)
    for folder in ("tldsl", "ir", "codegen", "runtime"):
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    build = subprocess.run([sys.executable, "-W", "always", "-c",
                            "import sys; from setuptools import build_meta; print(build_meta.build_wheel(sys.argv[1]))",
                            str(tmp_path / "dist")], cwd=src, capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-3000:]
    assert "Warning" not in build.stderr and "would be ignored" not in build.stderr, build.stderr[-3000:]
    names = set(zipfile.ZipFile(tmp_path / "dist" / build.stdout.strip().splitlines()[-1]).namelist())
    assert "tldsl/py.typed" in names and "tldsl/__main__.py" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    headers = {f"tldsl/codegen/include/tldsl/{p.name}" for p in (ROOT / "codegen/include/tldsl").glob("*.hpp")}
    assert headers and headers <= names
    for pkg, folder in _package_dirs().items():
        for module in folder.glob("*.py"):
            assert f"{pkg.replace('.', '/')}/{module.name}" in names


def test_the_extras_pin_what_the_toolchain_checks():
    nvrtc = _pins("nvrtc")
    assert nvrtc["nvidia-cuda-nvrtc"].startswith("{}.{}.".format(*NVRTC_REQUIRED))
    assert nvrtc["nvidia-cuda-cccl"] in CCCL_TESTED
    assert nvrtc["nvidia-cutlass"].startswith(CUTLASS_SERIES)
    assert f"nvidia-cutlass=={nvrtc['nvidia-cutlass']}" in " ".join(REQUIREMENTS)
    assert _pins("cpu") == {"nvidia-nvshmem-cu13": NVSHMEM_PINNED}
    for machine in ("cpu", "gpu"):
        assert "tldsl[nvrtc]" in EXTRAS[machine]
    assert not any(r.startswith("nvidia-nvshmem") for r in EXTRAS["gpu"] + EXTRAS["nvrtc"])   # a GPU host takes torch's own


def test_readme_and_makefile_install_with_these_extras():
    readme = (ROOT / "README.md").read_text()
    assert "pip install -e '.[cpu]'" in readme and "pip install -e '.[gpu]'" in readme
    assert "--no-deps" not in readme
    makefile = (ROOT / "Makefile").read_text()
    assert "pip install -e '.[test,cpu]'" in makefile and "-m pip check" in makefile
