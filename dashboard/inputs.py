"""What a request may carry in its path, query and form, checked before any
view (or the database) sees it.

Every field is percent-decoded as strict UTF-8 and refused (400, naming
the field) if it is not UTF-8, holds a control character (NUL, ESC, a
newline, DEL, C1) or is longer than :data:`MAX_FIELD` characters; a query
or form has at most :data:`MAX_FIELDS` fields.  PostgreSQL refuses NUL in
text, and a name with a control character matches nothing a user could
have created, so such input is a bad request, not a server error.
"""

from __future__ import annotations

import re
import unicodedata
from urllib.parse import parse_qsl, unquote

from duebox.errors import ValidationError

MAX_FIELD = 2000  # characters (a reason is at most 2,000)
MAX_FIELDS = 50
MAX_ROOT = 200  # characters of a mount prefix
_ROOT_SEGMENT = re.compile(r"[A-Za-z0-9._~-]{1,100}")


def checked(name: str, value: str) -> str:
    if len(value) > MAX_FIELD:
        raise ValidationError(name, f"must be at most {MAX_FIELD} characters", value)
    if any(unicodedata.category(c) == "Cc" for c in value):
        raise ValidationError(name, "must not contain control characters", value)
    return value


def _fields(text: str, what: str) -> dict[str, str]:
    try:
        pairs = parse_qsl(text, keep_blank_values=True, encoding="utf-8", errors="strict",
                          max_num_fields=MAX_FIELDS)
    except UnicodeDecodeError:
        raise ValidationError(what, "must be percent-encoded UTF-8") from None
    except ValueError:
        raise ValidationError(what, f"must have at most {MAX_FIELDS} fields") from None
    return {checked(what, name): checked(name, value) for name, value in pairs}


def decode_query(query: str) -> dict[str, str]:
    """A query string as a transport gives it (percent-encoded ASCII)."""
    if not query.isascii():
        raise ValidationError("query", "must be percent-encoded UTF-8")
    return _fields(query, "query")


def checked_root(root: str) -> str:
    """The prefix another app mounts the dashboard under (ASGI ``root_path``,
    WSGI ``SCRIPT_NAME``), without its trailing slash: every link and
    redirect starts with it, and the CSRF cookie's Path is it.  It may be
    built from the request (a mount with a path parameter), so it is held
    to letters, digits and ``-._~`` between single slashes: no ``.`` or
    ``..`` segment, no ``//`` (a link to another site), nothing to escape."""
    clean = root.rstrip("/")
    segments = clean.split("/")
    if clean and (len(clean) > MAX_ROOT or segments[0] != "" or any(
            s in (".", "..") or not _ROOT_SEGMENT.fullmatch(s) for s in segments[1:])):
        raise ValidationError("mount prefix", "must be /NAME or /NAME/NAME..., each NAME of "
                              "letters, digits and - . _ ~ (not . or ..), at most "
                              f"{MAX_ROOT} characters", root)
    return clean


def decode_target(target: str) -> tuple[str, dict[str, str]]:
    """``/path?query`` (ASCII, percent-encoded) → decoded path and query fields."""
    raw_path, _, query = target.partition("?")
    query = query.partition("#")[0]
    try:
        path = unquote(raw_path, errors="strict")
    except UnicodeDecodeError:
        raise ValidationError("path", "must be percent-encoded UTF-8") from None
    return checked("path", path), decode_query(query)


def decode_form(body: bytes) -> dict[str, str]:
    """An ``application/x-www-form-urlencoded`` body → its fields."""
    try:
        text = body.decode("ascii")
    except UnicodeDecodeError:
        raise ValidationError("form", "must be percent-encoded UTF-8") from None
    return _fields(text, "form")
