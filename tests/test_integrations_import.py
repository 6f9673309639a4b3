"""Importing fastattn and its integrations imports none of the frameworks they plug into.

fastattn's runtime dependency is NumPy alone: torch, transformers and tabpfn are imported
only when an integration's ``register()`` runs, dask only when its ``attention`` runs.
Checked in a fresh interpreter, since this test process may have imported torch already.
"""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


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
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]", res.stdout
