"""``python -m duebox``: the ``duebox`` command (the same as ``python -m duebox.cli``).

Only run as a program, never imported by ``import duebox``: the package's
core does not depend on its CLI.
"""

from duebox.cli.main import main

main()
