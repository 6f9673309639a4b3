"""The shipped type stubs match the runtime (mypy.stubtest) and type user code usefully.

fastattn's compiled modules (one per ISA, fastattn/_kernel_<isa>.pyi) and its public API
(fastattn/__init__.pyi) are typed by stubs; without this check they drift silently when an
argument is renamed or a public name is added.  Skipped when mypy is not installed (it is in
the ``test`` extra).  Runs stubtest in a subprocess: it imports every module it checks, and
a kernel variant this CPU cannot execute must never be imported.
"""
import os
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("mypy")

import fastattn
from fastattn import _kernel_base

PKG = Path(fastattn.__file__).parent
ISAS = ("base", "avx2", "avx512")

# stubtest recurses into packages and imports every submodule it finds; we list the modules
# ourselves instead (non-recursive), so only variants this CPU runs are imported.
STUBTEST = textwrap.dedent("""
    import sys
    import mypy.stubtest as st
    _build = st.build_stubs
    st.build_stubs = lambda modules, options, find_submodules=False: _build(modules, options, False)
    sys.exit(st.main())
""")

# Cython gives every module a ``__test__`` dict (doctest hook); it is not API.
ALLOWLIST = r"fastattn\._kernel_\w+\.__test__" + "\n"


def _runnable_variants():
    found = []
    for isa in ISAS:
        if isa != "base" and not _kernel_base.cpu_supports(isa):
            continue
        if list(PKG.glob(f"_kernel_{isa}.*")) and any(
            p.suffix in (".so", ".pyd") for p in PKG.glob(f"_kernel_{isa}.*")
        ):
            found.append(isa)
    return found


@pytest.fixture(scope="module")
def mypy_env(tmp_path_factory):
    """Config, environment and working dir for running mypy on the imported fastattn."""
    tmp = tmp_path_factory.mktemp("mypy")
    # Only the stubs are under test: the untyped implementation modules that mypy follows
    # from them (reference.py, ...) and optional imports (torch, matplotlib) are not.
    plain = sorted(
        f"fastattn.{p.stem}" for p in PKG.glob("*.py")
        if p.stem != "__init__" and not (PKG / f"{p.stem}.pyi").exists()
    )
    cfg = tmp / "mypy.ini"
    cfg.write_text(
        f"[mypy]\ncache_dir = {tmp / 'cache'}\nignore_missing_imports = True\n"
        f"[mypy-{','.join(plain)}]\nignore_errors = True\n"
    )
    env = dict(os.environ)
    root = PKG.parent
    site_dirs = {sysconfig.get_paths()[k] for k in ("purelib", "platlib")}
    if str(root) not in site_dirs:
        # Source tree or editable install: tell mypy (and the subprocess) where it is.
        # An installed package is found by both through site-packages (PEP 561 py.typed).
        for var in ("MYPYPATH", "PYTHONPATH"):
            env[var] = os.pathsep.join(filter(None, [str(root), env.get(var)]))
    return cfg, env, tmp


def test_stub_files_are_shipped():
    assert (PKG / "py.typed").is_file()
    assert (PKG / "__init__.pyi").is_file()
    for isa in ISAS:
        assert (PKG / f"_kernel_{isa}.pyi").is_file()


def test_stubtest(mypy_env):
    cfg, env, tmp = mypy_env
    allow = tmp / "allowlist.txt"
    allow.write_text(ALLOWLIST)
    modules = ["fastattn"] + [f"fastattn._kernel_{isa}" for isa in _runnable_variants()]
    res = subprocess.run(
        [sys.executable, "-c", STUBTEST, "--mypy-config-file", str(cfg),
         "--allowlist", str(allow), *modules],
        cwd=tmp, env=env, capture_output=True, text=True, timeout=300,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    # A run that found nothing to compare would also exit 0.
    assert f"no issues found in {len(modules)} modules" in res.stdout, res.stdout


def _public(module):
    """{name: signature of a function, names of a class's attributes, or type of a
    constant} of the module's public names."""
    import inspect

    def described(obj):
        if isinstance(obj, type):
            return sorted(name for name in vars(obj) if not name.startswith("__"))
        return str(inspect.signature(obj)) if callable(obj) else type(obj)

    return {name: described(obj) for name, obj in vars(module).items()
            if not name.startswith("_")}


def test_every_variant_has_the_base_signatures():
    # _kernel_avx2.pyi and _kernel_avx512.pyi import every name of _kernel_base.pyi, and
    # stubtest checks imported names one way only (none missing from the stub).  The
    # variants must then have exactly the base module's names and signatures, which
    # test_stubtest compares with the stub both ways.
    import importlib

    base = _public(_kernel_base)
    assert "forward_kvcache" in base and "bf16_dot_takes" in base
    for isa in _runnable_variants():
        assert _public(importlib.import_module(f"fastattn._kernel_{isa}")) == base, isa


def test_user_code_types(mypy_env):
    """The overloads give user code precise types (return_lse, cache)."""
    cfg, env, tmp = mypy_env
    snippet = tmp / "user_code.py"
    snippet.write_text(textwrap.dedent("""
        import numpy as np
        import fastattn
        x = np.zeros((2, 4, 8), np.float32)
        reveal_type(fastattn.attention(x, x, x))
        reveal_type(fastattn.attention(x, x, x, return_lse=True))
        mha = fastattn.MultiHeadAttention(8, 2)
        reveal_type(mha(x, cache=fastattn.KVCache()))
        with fastattn.num_threads(1) as n:
            reveal_type(n)
        fastattn.attention(x, x, x, causal="top-right")  # E: not a causal mode
    """))
    res = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(cfg), "--no-error-summary",
         "--hide-error-context", str(snippet)],
        cwd=tmp, env=env, capture_output=True, text=True, timeout=300,
    )
    out = res.stdout
    notes = [l.split("Revealed type is ", 1)[1].strip('"') for l in out.splitlines()
             if ": note: Revealed type is " in l]
    assert len(notes) == 4, out + res.stderr
    assert notes[0].startswith("numpy.ndarray["), notes[0]
    assert notes[1].startswith("tuple[numpy.ndarray[") and notes[1].count("ndarray") == 2, notes[1]
    assert notes[2].startswith("tuple[numpy.ndarray[") and notes[2].endswith("fastattn.KVCache]")
    assert notes[3] in ("int", "builtins.int"), notes[3]
    errors = [l for l in out.splitlines() if ": error:" in l]
    assert len(errors) == 1 and "user_code.py:11:" in errors[0], out
