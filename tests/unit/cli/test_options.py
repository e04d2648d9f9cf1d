"""duebox.cli.options: what every command shares.  An error duebox raises
on purpose, or a statement the database refused, ends the command in one
printable line and exit status 1; text arguments the database cannot store
and numbers that are not finite are usage errors (exit 2)."""

from __future__ import annotations

import click
import sqlalchemy as sa
from click.testing import CliRunner

from duebox import ValidationError
from duebox.cli.options import TEXT, FiniteRange, errors_as_messages, one_line


def run(command: click.Command, *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(command, list(args))
    assert not isinstance(result.exception, Exception) or isinstance(
        result.exception, SystemExit), result.exception  # never a traceback
    return result.exit_code, result.output


@click.command("refuse")
@errors_as_messages
def refuse() -> None:
    raise ValidationError("delay", "must be >= 0\n(and then)\x1b[2J", -1)


@click.command("query")
@click.argument("url")
@click.argument("statement")
@errors_as_messages
def query(url: str, statement: str) -> None:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            conn.execute(sa.text("CREATE TEMP TABLE t (x INTEGER CHECK (x > 0))"))
            conn.execute(sa.text(statement))
    finally:
        engine.dispose()


@click.command("take")
@click.option("--reason", type=TEXT, required=True)
@click.option("--window", type=FiniteRange(min=0.0), default=1.0)
def take(reason: str, window: float) -> None:
    click.echo(f"{reason}|{window}")


def test_an_error_on_purpose_is_one_printable_line() -> None:
    code, output = run(refuse)
    assert code == 1
    assert output == ("Error: ValidationError: delay: must be >= 0 (and then)\\x1b[2J "
                      "(got -1)\n")


def test_a_statement_the_database_refused_is_one_line_too(sqlite_url: str) -> None:
    code, output = run(query, sqlite_url, "INSERT INTO t VALUES (0)")
    assert code == 1
    assert output.count("\n") == 1
    assert output.startswith("Error: DatabaseError: query: the database refused it: CHECK")
    code, output = run(query, sqlite_url, "SELECT * FROM duebox_nothing")
    assert code == 1
    assert output.count("\n") == 1
    assert output.startswith("Error: DatabaseError: query: duebox's tables are missing")
    assert "run `duebox db upgrade`" in output


def test_text_the_database_cannot_store_is_a_usage_error() -> None:
    assert run(take, "--reason", "ok") == (0, "ok|1.0\n")
    code, output = run(take, "--reason", "a\x00b")
    assert code == 2
    assert "must not contain NUL" in output
    code, output = run(take, "--reason", "x\udcff")  # undecodable command-line bytes
    assert code == 2
    assert "lone surrogate" in output


def test_a_number_that_is_not_finite_is_a_usage_error() -> None:
    for bad in ("nan", "inf"):
        code, output = run(take, "--reason", "r", "--window", bad)
        assert code == 2, output
        assert "is not a finite number" in output, output
    assert run(take, "--reason", "r", "--window", "2.5") == (0, "r|2.5\n")


def test_one_line_folds_whitespace_and_escapes_controls() -> None:
    assert one_line("a\n  b\tc\x1b[0m\u202e") == "a b c\\x1b[0m\\u202e"
