"""``python -m duebox.cli``: the same as the ``duebox`` command."""

from .main import main

main()
