"""tldsl/env.py's table is every TLDSL_* environment variable there is, and the README shows it.

The scan reads the repository's Python files (as syntax trees, so C macros named TLDSL_* in
generated source are not taken for variables), the Makefile and the CI script."""
import ast
import re
from pathlib import Path

import pytest

from tldsl import env

ROOT = Path(__file__).resolve().parent.parent
PY_DIRS = ("tldsl", "ir", "codegen", "runtime", "tests")
SHELL_FILES = ("Makefile", ".ci/run")
LIBRARY_DIRS = ("tldsl", "ir", "codegen", "runtime")
NAME = re.compile(r"^TLDSL_[A-Z0-9_]+$")

#: library files still reading os.environ directly, and why they are not converted yet
DIRECT_READS_LEFT: dict[str, str] = {}


def _text(node) -> str:
    return ast.unparse(node)


def _env_name(node) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and NAME.match(node.value):
        return node.value
    return None


def uses_in_python(tree) -> list[tuple[str, str]]:
    """(name, how) for every read or write of a TLDSL_* variable: ``direct`` (os.environ / getenv
    read), ``env`` (tldsl.env.get), ``write`` (assignment, setenv, delenv)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args and (name := _env_name(node.args[0])):
            func = node.func
            owner = _text(func.value) if isinstance(func, ast.Attribute) else ""
            attr = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if attr in ("setenv", "delenv") or attr in ("setdefault", "pop") and owner.endswith("environ"):
                found.append((name, "write"))
            elif attr == "get" and owner.endswith("environ") or attr == "getenv":
                found.append((name, "direct"))
            elif attr == "get" and owner == "env":
                found.append((name, "env"))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and _text(node.func.value) == "env" \
                and node.func.attr in env.CHECKED_READERS:         # a checked reader of one variable
            found.append((env.CHECKED_READERS[node.func.attr], "env"))
        elif isinstance(node, ast.Subscript) and _text(node.value).endswith("environ") and (
                name := _env_name(node.slice)):
            found.append((name, "write" if isinstance(node.ctx, (ast.Store, ast.Del)) else "direct"))
        elif isinstance(node, ast.Compare) and (name := _env_name(node.left)) and any(
                isinstance(op, (ast.In, ast.NotIn)) for op in node.ops) and any(
                _text(c).endswith("environ") for c in node.comparators):
            found.append((name, "direct"))
    return sorted(found)


def scan() -> dict[str, list[tuple[str, str]]]:
    """Repository-relative path -> the TLDSL_* uses in it."""
    uses = {}
    for d in PY_DIRS:
        for path in sorted((ROOT / d).rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            rel = path.relative_to(ROOT).as_posix()
            if rel in ("tldsl/env.py", "tests/test_env_vars.py"):      # the table, and this file's samples
                continue
            found = uses_in_python(ast.parse(path.read_text(), rel))
            if found:
                uses[rel] = found
    for rel in SHELL_FILES:
        path = ROOT / rel
        if path.exists():
            found = [(m, "write") for m in re.findall(r"\b(TLDSL_[A-Z0-9_]+)=", path.read_text())]
            if found:
                uses[rel] = found
    return uses


def test_the_scan_sees_every_kind_of_use():
    """The detector itself: each form of read and write is found, C macros in strings are not."""
    src = '''
import os
a = os.environ.get("TLDSL_A")
b = os.getenv("TLDSL_B", "1")
c = os.environ["TLDSL_C"]
d = "TLDSL_D" in os.environ
env.get("TLDSL_E")
env.wait_timeout_ns()
os.environ["TLDSL_F"] = "1"
monkeypatch.setenv("TLDSL_G", "1")
source = "#define TLDSL_HOST_EMULATION 1"
opts = ("-DTLDSL_WAIT_TIMEOUT_NS=1ull",)
ok = "TLDSL_NVSHMEM_VERSION" in " ".join(opts)
'''
    assert uses_in_python(ast.parse(src)) == [
        ("TLDSL_A", "direct"), ("TLDSL_B", "direct"), ("TLDSL_C", "direct"), ("TLDSL_D", "direct"),
        ("TLDSL_E", "env"), ("TLDSL_F", "write"), ("TLDSL_G", "write"), ("TLDSL_WAIT_TIMEOUT_NS", "env")]


def test_every_variable_used_anywhere_is_in_the_table():
    unlisted = {f"{rel}: {name}" for rel, found in scan().items() for name, _ in found if name not in env.BY_NAME}
    assert not unlisted, f"TLDSL_* variables missing from tldsl/env.py's VARIABLES: {sorted(unlisted)}"


def test_every_table_entry_is_used_by_the_readers_it_names():
    uses = scan()
    for var in env.VARIABLES:
        assert var.readers, var.name
        for rel in var.readers:
            assert var.name in {name for name, _ in uses.get(rel, ())}, \
                f"tldsl/env.py says {rel} reads {var.name}; it does not (fix the table)"
        # a file outside the table's list may only set it, and only in the tests (monkeypatch)
        elsewhere = sorted(rel for rel, found in uses.items() if rel not in var.readers and any(
            name == var.name and (how != "write" or not rel.startswith("tests/")) for name, how in found))
        assert not elsewhere, f"{var.name} is also used by {elsewhere}: list them in tldsl/env.py"


def test_library_code_reads_through_tldsl_env():
    direct = sorted({rel for rel, found in scan().items()
                     if rel.startswith(tuple(d + "/" for d in LIBRARY_DIRS)) and rel not in DIRECT_READS_LEFT
                     and any(how == "direct" for _, how in found)})
    assert not direct, f"read these through tldsl.env.get: {direct}"


def test_unknown_names_are_refused(monkeypatch):
    monkeypatch.setenv("TLDSL_CACHE_DIR", "")
    assert env.get("TLDSL_CACHE_DIR", "fallback") == "fallback"      # empty counts as unset
    monkeypatch.setenv("TLDSL_CACHE_DIR", "/x")
    assert env.get("TLDSL_CACHE_DIR") == "/x"
    with pytest.raises(KeyError, match="TLDSL_NOT_A_SETTING is not in tldsl.env.VARIABLES"):
        env.get("TLDSL_NOT_A_SETTING")


@pytest.mark.parametrize("var, value, says", [
    ("TLDSL_COMPILE_WORKERS", "abc", "TLDSL_COMPILE_WORKERS='abc': a positive int"),
    ("TLDSL_COMPILE_WORKERS", "0", "TLDSL_COMPILE_WORKERS='0': a positive int"),
    ("TLDSL_CACHE_DIR", "{file}", "TLDSL_CACHE_DIR='{file}' is not a folder"),
    ("TLDSL_CACHE_DIR", "{file}/sub", "TLDSL_CACHE_DIR='{file}/sub': cannot create it"),
])
def test_a_bad_value_is_an_input_error_naming_the_variable_before_compiling(monkeypatch, tmp_path, var, value, says):
    """Found by an explorer's round: TLDSL_CACHE_DIR naming a file (or a folder that cannot be made)
    failed with NotADirectoryError / FileNotFoundError from the cache's put after NVRTC had
    compiled, and TLDSL_COMPILE_WORKERS=abc with int()'s ValueError. Now an InputError that names
    the variable, before the toolchain is even looked up."""
    from tldsl.codegen.toolchain import compiler
    from tldsl.errors import InputError
    file = tmp_path / "a-file"
    file.write_text("not a folder")
    monkeypatch.setenv(var, value.format(file=file))

    def no_compile():
        raise AssertionError("compiled although the environment is invalid")
    monkeypatch.setattr(compiler, "find_toolchain", no_compile)
    with pytest.raises(InputError, match=re.escape(says.format(file=file))):
        compiler.compile_cuda("__global__ void k() {}", "k")
    assert file.read_text() == "not a folder"


@pytest.mark.parametrize("value", ["abc", "0", "-5", "1.5e9", str(2 ** 64), str(2 ** 70)])
def test_a_bad_wait_timeout_is_an_input_error_naming_the_variable(monkeypatch, value):
    """Its readers (the GPU ops, the fused-op engine, the lowering's debug report) each used a bare
    int(): a mistyped value was int()'s ValueError, and 2**64 or more wrapped to a timeout of 0 in
    the kernels (every wait that spins trapped at once). One checked reader now refuses it."""
    from tldsl.codegen.abi import wait_report_options
    from tldsl.errors import InputError
    from tldsl.runtime.dist.program_engine import wait_timeout_s
    monkeypatch.setenv("TLDSL_WAIT_TIMEOUT_NS", value)
    for read in (env.wait_timeout_ns, wait_timeout_s, wait_report_options):
        with pytest.raises(InputError, match=re.escape(f"TLDSL_WAIT_TIMEOUT_NS={value!r}: a positive int of "
                                                       "nanoseconds below 2**64")):
            read()


def test_a_good_wait_timeout_is_read_as_nanoseconds(monkeypatch):
    from tldsl.runtime.dist.program_engine import wait_timeout_s
    monkeypatch.setenv("TLDSL_WAIT_TIMEOUT_NS", " 2000000000 ")
    assert env.wait_timeout_ns() == 2 * 10 ** 9 and wait_timeout_s() == 2.0
    monkeypatch.setenv("TLDSL_WAIT_TIMEOUT_NS", str(2 ** 64 - 1))
    assert env.wait_timeout_ns() == 2 ** 64 - 1
    monkeypatch.delenv("TLDSL_WAIT_TIMEOUT_NS")
    assert env.wait_timeout_ns() is None and wait_timeout_s() is None


BEGIN = "<!-- env-table: generated by tldsl.env.markdown_table(); tests/test_env_vars.py checks it -->"
END = "<!-- /env-table -->"


def test_readme_table_is_the_generated_one():
    readme = (ROOT / "README.md").read_text()
    assert BEGIN in readme and END in readme, "README.md lost its environment-variable section markers"
    shown = readme.split(BEGIN, 1)[1].split(END, 1)[0].strip("\n") + "\n"
    assert shown == env.markdown_table(), (
        "README.md's environment-variable table is stale: replace it with the output of\n"
        "  python -c 'import tldsl.env as e; print(e.markdown_table(), end=\"\")'")
