"""Which frames are the compiler's own (skipped when an error points at the user's line), in both
layouts the package is installed in: a source checkout (editable) and a wheel, where ``ir/``,
``codegen/`` and ``runtime/`` are folders inside the ``tldsl`` package."""
from __future__ import annotations

import os

from tldsl.ir import location


def _touch(path):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    open(path, "w").close()


def test_a_source_checkout_skips_its_four_top_level_folders_but_the_op_library(tmp_path):
    for d in ("tldsl", "ir", "codegen", "runtime"):
        _touch(str(tmp_path / d / "__init__.py"))
    internal, ops = location.library_dirs(str(tmp_path / "ir"))
    assert internal == tuple(str(tmp_path / d) + os.sep for d in ("tldsl", "ir", "codegen", "runtime"))
    assert ops == str(tmp_path / "tldsl" / "ops") + os.sep


def test_an_installed_package_skips_all_of_itself_but_the_op_library(tmp_path):
    pkg = tmp_path / "site-packages" / "tldsl"
    for d in ("", "ir", "codegen", "runtime", "ops"):
        _touch(str(pkg / d / "__init__.py"))
    internal, ops = location.library_dirs(str(pkg / "ir"))
    assert internal == (str(pkg) + os.sep,)
    assert ops == str(pkg / "ops") + os.sep
    tracing = str(pkg / "tracing.py")          # tldsl's own modules: the compiler's frames there too
    assert any(tracing.startswith(d) for d in internal) and not tracing.startswith(ops)


def test_this_checkout_treats_the_tracer_as_internal_and_a_test_as_the_users():
    import tldsl.tracing
    assert location._is_internal(tldsl.tracing.__file__)
    assert not location._is_internal(__file__)
