"""duebox.errors: one hierarchy under DueboxError, as the module draws it,
and a ValidationError's message that names the field and the rule and
shows what it got without ever failing to show it."""

from __future__ import annotations

import pytest

from duebox import errors
from duebox.errors import DueboxError, ValidationError
from duebox.states import Discard

# The tree the module's docstring draws: each error and its parent.
TREE = {
    "ConfigurationError": "DueboxError", "MissingDependencyError": "ConfigurationError",
    "ValidationError": "DueboxError", "UnknownTaskError": "ValidationError",
    "AmbiguousJobError": "ValidationError", "MessageDecodeError": "ValidationError",
    "DatabaseError": "DueboxError", "PermissionDeniedError": "DatabaseError",
    "TablesMissingError": "DatabaseError", "BrokerError": "DueboxError",
    "BrokerUnreachableError": "BrokerError", "BrokerRefusedError": "BrokerUnreachableError",
    "AccessRefusedError": "ConfigurationError",
    "JobStateError": "DueboxError", "JobNotFoundError": "JobStateError",
    "LeaseLostError": "JobStateError", "NotDueError": "JobStateError",
}


@pytest.mark.parametrize(("error", "parent"), sorted(TREE.items()))
def test_the_hierarchy_is_the_one_drawn(error: str, parent: str) -> None:
    assert getattr(errors, error).__mro__[1] is getattr(errors, parent)
    assert error in (errors.__doc__ or "")


def test_every_error_class_of_the_module_is_a_duebox_error() -> None:
    classes = [v for v in vars(errors).values()
               if isinstance(v, type) and issubclass(v, BaseException)]
    assert len(classes) >= 15
    assert all(issubclass(c, DueboxError) for c in classes)
    assert issubclass(ValidationError, ValueError)  # callers catching ValueError still do


def test_a_validation_error_names_field_and_rule_and_shows_the_value() -> None:
    exc = ValidationError("delay", "must be >= 0", -1)
    assert (str(exc), exc.field, exc.rule) == ("delay: must be >= 0 (got -1)", "delay",
                                               "must be >= 0")
    assert str(ValidationError("delay", "must be >= 0")) == "delay: must be >= 0"
    assert str(ValidationError("x", "r", None)) == "x: r (got None)"


class Unprintable:
    def __repr__(self) -> str:
        raise RuntimeError("no repr")


@pytest.mark.parametrize(("value", "shown"), [
    ("x" * 500, "(got '" + "x" * 76 + "...)"),
    (10**5000, "(got an int of about 5000 digits)"),
    (Unprintable(), "(got a Unprintable)"),
], ids=["long", "huge int", "no repr"])
def test_any_value_is_shown_short(value: object, shown: str) -> None:
    message = str(ValidationError("payload", "must be small", value))
    assert message.endswith(shown)
    assert len(message) < 120


def test_the_specific_errors_say_what_to_do() -> None:
    assert "pip install 'duebox[redis]'" in str(errors.MissingDependencyError("redis", "redis"))
    unknown = errors.UnknownTaskError("sned", ["send", "refund"])
    assert (unknown.field, str(unknown)) == (
        "task", "task: must be a registered task name (known: refund, send) (got 'sned')")
    assert "none registered" in str(errors.UnknownTaskError("x", []))
    ambiguous = errors.AmbiguousJobError("job_id", "01", ["0190a", "0190b"], more=True)
    assert ambiguous.candidates == ["0190a", "0190b"]
    assert "0190a, 0190b, ..." in str(ambiguous)
    assert "give more of the id" in str(ambiguous)
    assert errors.MessageDecodeError("body", "r").reason == Discard.UNDECODABLE
    assert "docs/operators.md" in str(errors.PermissionDeniedError("dlq purge", "no DELETE"))
    missing = errors.TablesMissingError("jobs list", "sqlite:///x", "run `duebox db upgrade`")
    assert str(missing) == (
        "jobs list: no duebox tables in this database (sqlite:///x): run `duebox db upgrade`")
    late = errors.NotDueError("j", "2030-01-01", 1.5)
    assert late.seconds == 1.5
    assert "1.500 s from now" in str(late)
