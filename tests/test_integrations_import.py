"""Importing fastattn and its integrations imports none of the frameworks they plug into.

fastattn's runtime dependency is NumPy alone: torch, transformers and tabpfn are imported
only when an integration's ``register()`` runs, dask only when its ``attention`` runs.
Checked in a fresh interpreter, since this test process may have imported torch already.
"""
from conftest import ROOT, run_python


def test_integrations_import_no_framework():
    code = (
        "import sys\n"
        "import fastattn, fastattn.integrations\n"
        "from fastattn.integrations import dask, tabpfn, transformers\n"
        "from fastattn.integrations import *\n"
        "assert callable(transformers.register) and callable(tabpfn.register)\n"
        "assert callable(dask.attention)\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'tabpfn', 'dask', 'distributed')\n"
        "               if m in sys.modules)\n"
        "print(heavy)\n"
    )
    res = run_python("-c", code, cwd=ROOT, timeout=120)  # asserts exit status 0
    assert res.stdout.strip() == "[]", res.stdout
