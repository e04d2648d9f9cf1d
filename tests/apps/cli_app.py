"""A tiny app for the CLI tests: ``--app tests.apps.cli_app:app``."""

import os

import duebox

app = duebox.Duebox(database_url=os.environ.get("DUEBOX_DATABASE_URL", "sqlite:///cli.db"))


@app.task("cli.noop")
def noop(payload: object, ctx: duebox.JobContext) -> None:
    return None


not_an_app = 42
