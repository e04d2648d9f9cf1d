"""HTML building blocks: escaping, the page frame, tables, times.

Every value that reaches a page goes through :func:`esc`; helpers that take
``html`` arguments expect markup built by this module."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from datetime import datetime
from html import escape
from typing import Any
from urllib.parse import urlencode

from .web import url

NAV = (("/", "Overview"), ("/jobs", "Jobs"), ("/schedules", "Schedules"), ("/dlq", "DLQ"),
       ("/processes", "Relays & workers"))


def esc(value: object) -> str:
    return escape("" if value is None else str(value), quote=True)


def ts(at: datetime | None) -> str:
    """A UTC instant, to the millisecond ('-' when absent)."""
    if at is None:
        return "-"
    return f'<time datetime="{esc(at.isoformat())}">{at:%Y-%m-%d %H:%M:%S}.' \
           f'{at.microsecond // 1000:03d}Z</time>'


def seconds(value: float | None) -> str:
    """A duration for people: ms below a second, then s, min, h."""
    if value is None:
        return "-"
    v = abs(value)
    sign = "-" if value < 0 else ""
    if v < 1:
        return f"{sign}{v * 1000:.0f} ms"
    if v < 120:
        return f"{sign}{v:.1f} s"
    if v < 7200:
        return f"{sign}{v / 60:.1f} min"
    return f"{sign}{v / 3600:.1f} h"


def link(href: str, text: object, **params: object) -> str:
    query = urlencode({k: v for k, v in params.items() if v not in (None, "")})
    return f'<a href="{esc(url(href) + ("?" + query if query else ""))}">{esc(text)}</a>'


def table(headers: Sequence[str], rows: Iterable[Sequence[str]], empty: str = "none",
          cls: str = "") -> str:
    """``rows`` are cells of markup (escape values with :func:`esc`)."""
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    if not body:
        body = f'<tr><td colspan="{len(headers)}" class="empty">{esc(empty)}</td></tr>'
    head = "".join(f"<th>{esc(h)}</th>" for h in headers)
    return f'<table class="{esc(cls)}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def compact_json(value: Any) -> str:
    """A JSON value on one line, escaped ('' for none)."""
    return "" if value is None else esc(json.dumps(value, sort_keys=True, default=str))


def pre_json(value: Any) -> str:
    return f"<pre>{esc(json.dumps(value, indent=2, sort_keys=True, default=str))}</pre>"


def payload_section(shown: Any, note: str, hidden: bool) -> str:
    """The Payload heading, a note on masking, and the payload unless hidden."""
    return ("<h2>Payload</h2>" + (f"<p class=muted>{esc(note)}</p>" if note else "")
            + ("" if hidden else pre_json(shown)))


def badge(state: str) -> str:
    return f'<span class="badge s-{esc(state.lower())}">{esc(state)}</span>'


def notice(text: str, kind: str = "info") -> str:
    return f'<div class="notice {esc(kind)}">{esc(text)}</div>'


def page(title: str, live: str, rest: str = "", *, active: str = "/", refresh: float | None = None,
         banner: str = "") -> str:
    """The whole page: ``live`` is the part the auto-refresh script replaces
    every ``refresh`` seconds (forms belong in ``rest``, so typing survives)."""
    nav = "".join(
        f'<a href="{esc(url(href))}"{" class=active" if href == active else ""}>{esc(text)}</a>'
        for href, text in NAV)
    every = f' data-refresh="{refresh:g}"' if refresh else ""
    return (
        "<!doctype html><html lang=en><head><meta charset=utf-8>"
        f"<title>{esc(title)} · duebox</title>"
        '<meta name=viewport content="width=device-width, initial-scale=1">'
        f'<link rel=stylesheet href="{esc(url("/static/dashboard.css"))}">'
        f'<script src="{esc(url("/static/dashboard.js"))}" defer></script></head><body>'
        f'<header><span class=brand>duebox</span><nav>{nav}</nav></header>'
        f"<main>{banner}<h1>{esc(title)}</h1>"
        f'<div id=live{every}>{live}</div>{rest}</main></body></html>'
    )
