"""``manage.py duebox ...``: duebox's command line with the project's settings.

Every ``duebox`` command works, e.g. ``manage.py duebox worker --concurrency 4``
or ``manage.py duebox status``; ``--app`` defaults to ``settings.DUEBOX_APP``.
"""

from __future__ import annotations

import os
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand


class Command(BaseCommand):
    help = "duebox's command line (relay, worker, db upgrade, status ...) with these settings"

    def run_from_argv(self, argv: list[str]) -> None:
        # duebox's own (click) parser reads the arguments, --help included.
        from duebox.cli.main import cli

        os.environ.setdefault("DUEBOX_APP", settings.DUEBOX_APP)
        cli.main(args=argv[2:], prog_name=f"{os.path.basename(argv[0])} duebox")

    def handle(self, *args: Any, **options: Any) -> None:  # pragma: no cover - see above
        raise NotImplementedError
