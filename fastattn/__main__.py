"""``python -m fastattn``: the command line of :mod:`fastattn.cli`."""

import sys

from .cli.main import main

if __name__ == "__main__":
    sys.exit(main())
