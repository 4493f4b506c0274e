"""`python -m nanobatch` for the installed package: the CLI, as the `nanobatch` command.

This folder is the package `pip install` makes: __init__.py, kernels.py, tp.py and server.py are
links to the files at the repository's root (read those); only this file lives here."""

import sys

from nanobatch import main

sys.argv[0] = "python -m nanobatch"  # argparse's usage line, not __main__.py
main()
