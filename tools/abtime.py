"""The bench's harness, shapes and table formatter for tools/ab_*.py, from this repository.

The A/B tools time builds that may predate these modules (or differ in them), so they load
the files of this checkout by path, under names of their own, whatever ``fastattn`` is
imported: both builds are then timed by the same code.
"""
import importlib.util
import os
import sys

CLI_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                       "fastattn", "cli")


def load(relpath):
    """The module in ``fastattn/cli/<relpath>.py``, e.g. ``load("bench/harness")``."""
    name = "fastattn_ab_" + relpath.replace("/", "_")
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, os.path.join(CLI_DIR, relpath + ".py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module      # dataclasses look their module up while it runs
        spec.loader.exec_module(module)
    return sys.modules[name]
