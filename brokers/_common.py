"""Small pieces the backends share: URL parameter checks that name the
parameter and the rule, and safe tokens for names and ids."""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Mapping

from duebox.errors import ConfigurationError

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def number(params: Mapping[str, str], name: str, default: float, *, low: float,
           high: float = math.inf, integer: bool = False, seconds: bool = False,
           above: bool = False) -> float:
    """``?name=`` as a number in ``[low, high]`` (``above``: ``(low, high]``),
    or ``default`` when absent.  The one parser of every backend's URL
    numbers: an error names the parameter and the rule (``seconds``: the
    rule says the unit)."""
    raw = params.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or not (low < value if above else low <= value) or (
            value > high) or (integer and value != int(value)):
        kind = "an integer" if integer else "a number of seconds" if seconds else "a number"
        upper = "" if high == math.inf else f" and <= {high:g}"
        raise ConfigurationError(
            f"broker_url: {name} must be {kind} {'>' if above else '>='} {low:g}{upper} "
            f"(got {raw!r})")
    return value


def flag(params: Mapping[str, str], name: str, default: bool) -> bool:
    raw = params.get(name)
    if raw is None:
        return default
    if raw.lower() in _TRUE:
        return True
    if raw.lower() in _FALSE:
        return False
    raise ConfigurationError(f"broker_url: {name} must be true or false (got {raw!r})")


def name_param(params: Mapping[str, str], name: str, default: str, pattern: str,
               rule: str) -> str:
    value = params.get(name, default)
    if not re.fullmatch(pattern, value):
        raise ConfigurationError(f"broker_url: {name} must be {rule} (got {value!r})")
    return value


def refuse_unknown(params: dict[str, str], known: frozenset[str], scheme: str) -> None:
    """A misspelt parameter (``?prefx=``) would otherwise be ignored in silence
    and the backend would run with the default it was meant to replace."""
    unknown = sorted(set(params) - known)
    if unknown:
        raise ConfigurationError(
            f"broker_url: unknown parameter {unknown[0]!r} for {scheme}:// "
            f"(known: {', '.join(sorted(known))})")


def safe_token(value: str, allowed: str = r"[A-Za-z0-9!-/:-@\[-`{-~]{1,128}") -> str:
    """``value`` if it matches ``allowed`` (SQS's group and deduplication id
    rule by default), else its SHA-256 in hex: stable, so equal keys still group."""
    if re.fullmatch(allowed, value):
        return value
    return hashlib.sha256(value.encode()).hexdigest()
