"""What this fastattn runs (fastattn._machine.config): ``fastattn.show_config()`` for the running
process, ``python -m fastattn info`` for a fresh one; their text and JSON, and the problems
they explain."""
import argparse
import importlib.machinery
import importlib.util
import io
import json
import os
import shutil
import subprocess
import sys
import warnings

import numpy as np
import pytest

import fastattn
from fastattn._machine import config as _config
from fastattn._machine.isa import kernel
from fastattn.cli import info

from conftest import run_cli, run_python


# ------------------------------------------------------------- text and JSON

def test_info_text():
    proc = run_cli("info")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for label in ("fastattn:", "Python:", "NumPy:", "compiler:", "OpenMP:", "threads:",
                  "SIMD variant:"):
        assert label in out
    assert fastattn.__version__ in out


def test_info_says_what_the_thread_pool_is():
    # The kernels run on fastattn's own pool of POSIX threads; OpenMP, when linked, gives
    # the default thread count and a team for the calls FASTATTN_POOL sends to it. "OpenMP:
    # yes" alone read as "runs on OpenMP".
    facts = {"version": "0", "python": "3", "python_implementation": "CPython", "numpy": "2",
             "platform": "p", "compiler": "c", "threads": 2, "isa": "avx2",
             "available_variants": ["avx2"], "openmp": True, "thread_pool": "pthreads"}
    lines = dict(line.split(":", 1) for line in _config.format_info(facts).splitlines())
    assert lines["thread pool"].strip() == "fastattn's own pool of POSIX threads"
    assert lines["OpenMP"].strip().startswith("yes: the default thread count")
    assert lines["OpenMP team runs"].strip() == "unknown"
    facts.update(pool_choice="auto", openmp_team="never")
    lines = dict(line.split(":", 1) for line in _config.format_info(facts).splitlines())
    assert lines["OpenMP team runs"].strip().startswith("none yet (FASTATTN_POOL=auto")
    facts.update(pool_choice="auto", openmp_team="in torch")
    lines = dict(line.split(":", 1) for line in _config.format_info(facts).splitlines())
    assert lines["OpenMP team runs"].strip() == ("the torch integrations' calls, on torch's "
                                                 "threads (FASTATTN_POOL=auto)")
    facts.update(openmp=False)
    lines = dict(line.split(":", 1) for line in _config.format_info(facts).splitlines())
    assert lines["OpenMP"].strip().startswith("no")


def test_info_json_matches_the_package():
    proc = run_cli("info", "--json")
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert info["version"] == fastattn.__version__
    assert info["numpy"] == np.__version__
    assert info["threads"] == fastattn.get_num_threads()
    from fastattn._machine import isa as _dispatch
    assert info["isa"] == _dispatch.ISA
    assert info["isa"] in info["available_variants"]
    assert isinstance(info["openmp"], bool)
    assert info["compiler"] != "unknown"


def test_info_says_what_float32_calls_multiply_in():
    proc = run_cli("info", "--json")
    facts = json.loads(proc.stdout)
    assert facts["float32_precision"] == "float32"
    assert facts["float32_products"] == "float32 (exact, the default)"
    off = run_python("-m", "fastattn", "info", env={"FASTATTN_BF16_DOT": "0"}).stdout
    assert rows(off)["bfloat16 products"].startswith("no (")
    assert "FASTATTN_BF16_DOT=0" in rows(off)["bfloat16 products"]


# --------------------------------------------------------------- show_config

def rows(text):
    """{label: value} of info's text."""
    return {k.strip(): v.strip() for k, v in
            (line.split(":", 1) for line in text.splitlines() if ":" in line)}


def test_show_config_prints_what_info_prints():
    printed = io.StringIO()
    fastattn.show_config(file=printed)
    mine, fresh = rows(printed.getvalue()), rows(run_cli("info").stdout)
    assert mine.keys() == fresh.keys()
    # The rows this test session does not change (it imports torch, which moves the
    # OpenMP team's row, and some tests change the thread count and put it back).
    for label in ("fastattn", "compiler", "threads", "SIMD variant", "variants this CPU runs",
                  "bfloat16 products", "float32 products", "kernel module"):
        assert mine[label] == fresh[label], label


def test_show_config_shows_this_processs_settings(capsys):
    with fastattn.num_threads(1):
        fastattn.show_config()
    assert rows(capsys.readouterr().out)["threads"] == "1"
    had_products = kernel.set_bf16_dot(False)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")   # the opt-in's warning: test_bf16_products.py
            with fastattn.float32_precision("bfloat16"):
                fastattn.show_config()
    finally:
        kernel.set_bf16_dot(had_products)
    shown = rows(capsys.readouterr().out)
    assert shown["bfloat16 products"].startswith("no (")
    assert shown["float32 products"].startswith("float32: 'bfloat16' is set, but ")
    if had_products:
        with fastattn.float32_precision("bfloat16"):
            fastattn.show_config()
        shown = rows(capsys.readouterr().out)
        assert shown["bfloat16 products"] == "yes (AVX512-BF16 vdpbf16ps)"
        assert shown["float32 products"].startswith("bfloat16 (")
    fastattn.show_config()
    assert rows(capsys.readouterr().out)["float32 products"] == "float32 (exact, the default)"


# ----------------------------------------------------------------- shadowing

def test_info_in_an_unbuilt_source_tree_says_so(tmp_path):
    # A copy of the package's Python files without the compiled kernel, in the current
    # directory, hides the working package that PYTHONPATH points to.  The child runs
    # without site (-S), with NumPy's directory on PYTHONPATH: an editable install's import
    # hook (a .pth file) would otherwise supply the kernel modules to the copy.
    shadow = tmp_path / "fastattn"
    package = os.path.dirname(os.path.abspath(fastattn.__file__))
    shutil.copytree(package, shadow, ignore=lambda folder, names: [
        n for n in names if not (n.endswith(".py") or os.path.isdir(os.path.join(folder, n)))
        or n == "__pycache__"])
    numpy_dir = os.path.dirname(os.path.dirname(os.path.abspath(np.__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(package), numpy_dir]))
    proc = subprocess.run([sys.executable, "-S", "-m", "fastattn", "info"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert f"fastattn in {shadow} has no compiled kernel" in proc.stderr
    assert "run from another directory" in proc.stderr
    assert "circular import" not in proc.stderr


def _fake_installed(root, version="9.9.9"):
    """A distribution 'fastattn' installed in ``root``, as pip leaves it (RECORD lists the
    package's files)."""
    dist = root / f"fastattn-{version}.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: fastattn\nVersion: {version}\n")
    (dist / "RECORD").write_text("fastattn/__init__.py,,\n"
                                 f"fastattn-{version}.dist-info/METADATA,,\n")
    (root / "fastattn").mkdir()
    (root / "fastattn" / "__init__.py").write_text("")
    return str(root / "fastattn")


def test_info_names_the_folder_that_hides_the_installed_package(tmp_path, monkeypatch):
    installed = _fake_installed(tmp_path / "site")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))    # found first by importlib.metadata
    assert _config._installed_dir() == ("9.9.9", installed)
    here = os.path.dirname(os.path.abspath(fastattn.__file__))
    facts = _config.collect()
    (problem,) = facts["problems"]
    assert here in problem and installed in problem and "9.9.9" in problem
    text = _config.format_info(facts)
    assert text.splitlines()[-1].startswith("         ")      # wrapped under "problem: "
    assert "problem: fastattn is imported from" in text
    assert info.run(argparse.Namespace(json=False), stdout=io.StringIO()) == 3


def test_info_without_an_installed_copy_has_no_problem(monkeypatch):
    monkeypatch.setattr(_config, "_installed_dir", lambda: None)
    assert _config.shadowing_problems(fastattn) == []
    assert "problems" not in _config.collect()


def test_info_explains_a_namespace_folder(tmp_path):
    # `import fastattn` resolving to a folder without __init__.py: a namespace package with
    # no version, no threads and no kernel.
    folder = tmp_path / "fastattn"
    folder.mkdir()
    spec = importlib.machinery.ModuleSpec("fastattn", None, is_package=True)
    spec.submodule_search_locations = [str(folder)]
    namespace = importlib.util.module_from_spec(spec)
    facts = _config.collect(namespace)
    assert facts["version"] == "unknown" and facts["threads"] == "unknown"
    (problem,) = facts["problems"]
    assert str(folder) in problem and "no __init__.py" in problem
    assert "problem: 'import fastattn' found the folder" in _config.format_info(facts)


def test_info_from_beside_a_folder_named_fastattn(tmp_path):
    # A checkout cloned into ./fastattn (no __init__.py at its top) next to an editable
    # install: Python's path finder takes the folder as a namespace package before the
    # editable install's finder is asked, yet `python -m fastattn info` still runs,
    # because that finder supplies the submodules. Simulated with the same kind of finder.
    package = os.path.dirname(os.path.abspath(fastattn.__file__))
    probe = subprocess.run([sys.executable, "-c", "import sys; print(sys.path)"],
                           cwd=tmp_path, capture_output=True, text=True)
    if repr(os.path.dirname(package)) in probe.stdout:
        pytest.skip("fastattn is installed on sys.path, where it wins over a namespace folder")
    (tmp_path / "fastattn").mkdir()
    code = f"""
import importlib.machinery, runpy, sys
class EditableFinder:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name.startswith("fastattn."):
            return importlib.machinery.PathFinder.find_spec(name, [{package!r}])
sys.meta_path.append(EditableFinder)
sys.argv = ["fastattn", "info"]
runpy.run_module("fastattn", run_name="__main__", alter_sys=True)
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr
    out = proc.stdout
    assert "fastattn:               unknown" in out and "threads:                unknown" in out
    problem = " ".join(out.split("problem:", 1)[1].split())    # unwrapped
    assert problem.startswith(f"'import fastattn' found the folder {tmp_path / 'fastattn'},")
