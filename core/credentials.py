"""Passwords in URLs: hidden wherever a URL is shown, unambiguous where one
is given.

A URL's user and password (its *userinfo*) run from after ``scheme://`` to
the URL's **last** ``@``.  ``urllib.parse`` ends them at the first ``/``,
``?`` or ``#`` instead, so a password holding one of those (AWS secrets
often hold ``/``) was read as part of the host, path, query or fragment,
and printed whole by every line that hid passwords with it.  The rule here
takes whatever the password holds: :func:`redacted` is what every log line,
error message, command output and stored route key (``published_to``, a
relay's registry row) shows of a URL.

A broker URL whose userinfo holds a raw ``/``, ``?`` or ``#`` is refused
(:func:`check_userinfo`): the broker clients parse it the ``urllib`` way and
would connect to a host made of half the password.  Percent-encoded, such a
password works.  (A database URL is parsed by SQLAlchemy, which reads such a
password correctly, so it is only hidden.)
"""

from __future__ import annotations

import re

from .errors import ConfigurationError

HIDDEN = "***"

# Where the first URL of a text starts: ``scheme://`` (or a bare ``//``)
# anywhere; where any further one starts: ``scheme://`` after whitespace (a
# message quoting several URLs, RoutedBroker's "a + b": each is redacted on
# its own).  So a password holding whitespace followed by ``scheme://``
# would be cut there; nothing else in a password is.
_FIRST = re.compile(r"(?:[A-Za-z][A-Za-z0-9+.-]*:)?//")
_NEXT = re.compile(r"(?<=\s)[A-Za-z][A-Za-z0-9+.-]*://")


def _userinfos(text: str) -> list[tuple[int, int]]:
    """Where the userinfo of each URL in ``text`` is: from after its ``//``
    to the last ``@`` before the next URL starts."""
    first = _FIRST.search(text)
    if first is None:
        return []
    urls = [(first.end(), len(text))]
    for m in _NEXT.finditer(text, first.end()):
        urls[-1] = (urls[-1][0], m.start())
        urls.append((m.end(), len(text)))
    found = []
    for start, end in urls:
        at = text.rfind("@", start, end)
        if at >= 0:
            found.append((start, at))
    return found


def redacted(text: str) -> str:
    """``text`` (a URL, or a message that quotes URLs) with each URL's
    password as ``***``, whatever characters the password holds.

    A URL starts at ``scheme://``; its password runs from the first ``:``
    after that to the last ``@`` before the next URL (or the text's end), so
    a message that goes on after a URL may lose more than the password,
    never less.  A URL with
    no password is shown as it is, and so is an empty one (``user:@host``),
    which keeps what older releases stored as a route key (``published_to``)
    the same."""
    shown, done = [], 0
    for start, at in _userinfos(text):
        user, colon, password = text[start:at].partition(":")
        if colon and password:
            shown += [text[done:start], user, ":", HIDDEN]
            done = at
    return "".join([*shown, text[done:]])


def check_userinfo(field: str, url: str) -> None:
    """Refuse, naming ``field``, a URL whose user or password holds a raw
    ``/``, ``?`` or ``#`` (or whose path or query holds a raw ``@``, which
    reads the same): percent-encoded it means one thing to every client."""
    raw = sorted({c for start, at in _userinfos(url) for c in url[start:at] if c in "/?#"})
    if raw:
        raise ConfigurationError(
            f"{field}: {' and '.join(repr(c) for c in raw)} before the URL's last '@': "
            "percent-encode '/', '?', '#' and '@' in a user or password (%2F, %3F, %23, "
            "%40), and an '@' after the host (%40)")

__all__ = ["HIDDEN", "check_userinfo", "redacted"]
