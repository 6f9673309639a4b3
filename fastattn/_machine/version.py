"""fastattn's version, from the installed distribution's metadata.

A module of its own so that the package's parts (the thread pool's threadpoolctl entry,
``show_config``) read it without importing the package that imports them.
"""
from importlib import metadata as _metadata

try:
    __version__ = _metadata.version("fastattn")
except _metadata.PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.1.0+unknown"
