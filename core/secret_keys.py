"""Which payload keys hold secrets, app-wide: their values are masked
wherever people see a job, and cut out of error text that quotes them.

The ``mask_keys`` setting (a task may give its own list) names words; a key
is secret when it contains one of them, ignoring case and ``_``/``-``, so
``password`` covers ``db_password`` and ``PASSWORD``, and ``api_key`` covers
``apiKey`` and ``X-Api-Key``.  Like Django's ``hidden_settings`` and Sentry's
``DEFAULT_DENYLIST``, it matches by substring and fails closed: a key that
merely looks secret (``tokenizer``) is masked too.

:class:`SecretKeys` does the two things the words are for: ``mask`` a
payload (every value under a secret key becomes ``****``) and ``scrub``
text that quotes such a key with its value (``'password': 'hunter2'``,
``"token": "x"``, ``api_key=x``, ``Authorization: Bearer x``), whether or
not the value is in the payload.  duebox.masking applies both.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from .errors import ConfigurationError

REDACTED = "****"

# What a new app masks unless told otherwise (docs/failures.md, "Secrets").
DEFAULT_MASK_KEYS = ("password", "passwd", "secret", "token", "api_key", "authorization",
                     "cookie", "private_key", "credential")
# DUEBOX_MASK_KEYS=none: mask no key.
_NONE = "none"
_MOST_KEYS = 100
_LONGEST = 100
_NOT_A_LETTER = re.compile(r"[^0-9a-z]+")

# A secret key as error text quotes it (a Python repr, JSON, key=value, a
# header), then its value: quoted (up to 500 characters, on one line), or a
# bare run after an optional auth scheme ("Bearer x").  The key is one of
# the words, with anything before and after it and "_", "-" or "." between
# its letters; it starts where a word starts and every part is bounded, so
# a long text costs linear time.  Only secret keys match: a pair of another
# key is not consumed, so "headers: Authorization: Bearer x" finds the
# second.
_KEY = r"[\w.-]{{0,60}}?(?:{words})[\w.-]{{0,60}}"
_QUOTED_KEY = r"""(?P<kq>['"]){key}(?P=kq)[ \t]*[:=][ \t]*"""
_BARE_KEY = r"""(?<![\w.-]){key}(?:=|:[ \t]+)"""
_VALUE = (r"""(?:b?(?P<vq>['"])(?P<qval>[^'"\n]{1,500})(?P=vq)"""
          r"""|(?:(?:bearer|basic|token|digest)[ \t]+)?(?P<bval>[^\s'",;&}\])]{1,500}))""")


def _pattern(needles: tuple[str, ...]) -> re.Pattern[str]:
    words = "|".join("[_.-]?".join(re.escape(c) for c in n) for n in sorted(needles))
    key = _KEY.format(words=words)
    return re.compile(f"(?:{_QUOTED_KEY.format(key=key)}|{_BARE_KEY.format(key=key)}){_VALUE}",
                      re.IGNORECASE)


def normalized(word: str) -> str:
    return _NOT_A_LETTER.sub("", word.lower())


def parse_mask_keys(value: object, name: str = "mask_keys") -> tuple[str, ...]:
    """The setting as given (a list of words, a comma-separated string, or
    ``"none"``), checked: each word a non-empty string of at most 100
    characters with a letter or digit in it, at most 100 words."""
    if isinstance(value, str):
        value = () if value.strip().lower() == _NONE else value.split(",")
    if not isinstance(value, list | tuple):
        raise ConfigurationError(f"{name}: must be a list of key names, a comma-separated "
                                 f"string, or 'none' (got {value!r})")
    words = tuple(w.strip() if isinstance(w, str) else w for w in value)
    if len(words) > _MOST_KEYS:
        raise ConfigurationError(f"{name}: at most {_MOST_KEYS} key names (got {len(words)})")
    for w in words:
        if not isinstance(w, str) or not 0 < len(w) <= _LONGEST or not normalized(w):
            raise ConfigurationError(f"{name}: each key name must be a string of 1 to "
                                     f"{_LONGEST} characters with a letter or digit in it "
                                     f"(got {w!r})")
    return tuple(dict.fromkeys(words))


@dataclass(frozen=True)
class SecretKeys:
    """The secret keys of one task: ``words`` as configured."""

    words: tuple[str, ...] = ()
    _needles: tuple[str, ...] = field(init=False, repr=False, compare=False)
    _in_text: re.Pattern[str] | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        needles = tuple(sorted({normalized(w) for w in self.words}))
        object.__setattr__(self, "_needles", needles)
        object.__setattr__(self, "_in_text", _pattern(needles) if needles else None)

    @staticmethod
    @lru_cache(maxsize=64)
    def of(words: tuple[str, ...]) -> SecretKeys:
        """The (shared) SecretKeys of ``words``."""
        return SecretKeys(words)

    def __bool__(self) -> bool:
        return bool(self._needles)

    def hides(self, key: str) -> bool:
        """Whether ``key`` names a secret."""
        flat = normalized(key)
        return any(n in flat for n in self._needles)

    def mask(self, payload: Any) -> Any:
        """``payload`` with the value of every secret key (at any depth)
        replaced by ``****``; a copy, built without recursion (a payload may
        be nested deeper than the interpreter's recursion limit)."""
        if not self._needles:
            return payload
        holder: list[Any] = [None]
        stack: list[tuple[Any, Any, Any]] = [(holder, 0, payload)]
        while stack:
            parent, slot, value = stack.pop()
            if isinstance(value, dict):
                copy: dict[Any, Any] = {}
                for k, v in value.items():
                    secret = isinstance(k, str) and v is not None and self.hides(k)
                    copy[k] = REDACTED if secret else None
                    if not secret:
                        stack.append((copy, k, v))
                parent[slot] = copy
            elif isinstance(value, list | tuple):
                items: list[Any] = [None] * len(value)
                stack.extend((items, i, v) for i, v in enumerate(value))
                parent[slot] = items
            else:
                parent[slot] = value
        return holder[0]

    def scrub(self, text: str) -> str:
        """``text`` with the value after each secret key it quotes replaced
        by ``****`` (the key, the quotes and an auth scheme kept)."""
        if self._in_text is None:
            return text

        def cut(m: re.Match[str]) -> str:
            start, end = m.span("qval" if m["qval"] is not None else "bval")
            return m[0][:start - m.start()] + REDACTED + m[0][end - m.start():]

        return self._in_text.sub(cut, text)
