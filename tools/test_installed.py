"""Run fastattn's test suite against the *installed* package (a wheel), not the source tree.

Usage: python tools/test_installed.py PROJECT_DIR [pytest args...]

The tests read repository files (README.md and the docs/ it links to, .ci/run,
tools/leakcheck.py, pyproject.toml's pytest settings), and some start subprocesses with the repository root on PYTHONPATH or as their
working directory.  Run from PROJECT_DIR/tests, those would import the uncompiled source
package.  So this copies the repository minus the package sources (fastattn/, src/, build
files) into a temporary directory and runs pytest there; it first checks that ``fastattn``
imported from that directory is the installed one.  Used by tools/check_wheel.sh and by
cibuildwheel's test-command (pyproject.toml); cross-platform.
"""
import os
import shutil
import subprocess
import sys
import tempfile

COPY = ["tests", "tools", "README.md", "pyproject.toml", "docs", ".ci"]


def main(argv):
    if not argv:
        sys.exit(__doc__)
    project, pytest_args = os.path.abspath(argv[0]), argv[1:]
    with tempfile.TemporaryDirectory(prefix="fastattn-tests-") as root:
        for name in COPY:
            src = os.path.join(project, name)
            if os.path.isdir(src):
                shutil.copytree(src, os.path.join(root, name),
                                ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
            elif os.path.exists(src):
                shutil.copy2(src, root)
        where = subprocess.run(
            [sys.executable, "-c",
             "import fastattn, fastattn._machine.isa as d, numpy; "
             "print(fastattn.__file__, d.ISA, 'numpy', numpy.__version__)"],
            cwd=root, capture_output=True, text=True,
        )
        if where.returncode:
            sys.exit(f"cannot import the installed fastattn:\n{where.stderr}")
        print(f"testing installed fastattn: {where.stdout.strip()}", flush=True)
        if os.path.abspath(where.stdout.split()[0]).startswith(project + os.sep):
            sys.exit(f"fastattn is imported from the source tree {project}, not installed")
        return subprocess.call(
            [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *pytest_args], cwd=root
        )


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
