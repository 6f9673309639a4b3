"""The command line: ``python -m fastattn {bench,info,demo}`` and the ``fastattn`` script.

This package imports the library and is never imported by it: ``import fastattn`` loads
no module of ``fastattn.cli`` (a test checks it), so the command line's dependencies and
start-up never reach library users.

- ``main``    the one argparse tree; each command module gives ``HELP``,
              ``add_arguments(parser)`` and ``run(args)``, which returns the exit status;
- ``common``  the exit statuses (listed in every ``--help``), the text table, units, and
              matplotlib for ``--plot``, checked before a command does any work;
- ``info``    what this installation runs on, and whether another folder hides it;
- ``demo``    the classic self-attention examples (the documentation's examples page is
              built from them);
- ``bench``   the benchmark; its package docstring maps its modules.
"""
