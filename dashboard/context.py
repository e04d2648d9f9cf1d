"""What every view needs: the app, the guard, the clock, the flash messages."""

from __future__ import annotations

import secrets
import threading
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any
from urllib.parse import urlsplit

from sqlalchemy import Connection

from duebox import Duebox
from duebox.db import SQLITE_DEFERRED, db_errors
from duebox.masking import Masked, masked, shown_as_is

from .render import esc, notice
from .security import Guard
from .web import Request, url

_FLASH_KEEP = 200


class Dashboard:
    def __init__(self, app: Duebox, guard: Guard, *, page_size: int = 50,
                 refresh: float = 2.0, show_unregistered_payloads: bool = False) -> None:
        self.app = app
        self.guard = guard
        self.page_size = page_size
        self.refresh = refresh
        self.show_unregistered_payloads = show_unregistered_payloads
        self.scheme = urlsplit(app.settings.broker_url).scheme
        self._flashes: OrderedDict[str, tuple[str, str]] = OrderedDict()
        self._lock = threading.Lock()
        # A plain read: on SQLite it must not take the write lock.
        self._reader = app.engine.execution_options(**{SQLITE_DEFERRED: True})

    def now(self) -> datetime:
        return self.app.clock.now()

    @contextmanager
    def read(self, what: str) -> Iterator[Connection]:
        """A read-only connection; database errors become DatabaseError."""
        with db_errors(what), self._reader.connect() as conn:
            yield conn

    def mask(self, task: str, payload: Any) -> Masked:
        """What may be shown of a job or schedule of ``task`` (payload and
        error text alike)."""
        return masked(self.app, task, payload,
                      show_unregistered=self.show_unregistered_payloads)

    def shown_as_is(self, task: str) -> bool:
        return shown_as_is(self.app, task, show_unregistered=self.show_unregistered_payloads)

    def flash(self, text: str, kind: str = "ok") -> str:
        """Keep a message for the page the browser is redirected to."""
        key = secrets.token_urlsafe(12)
        with self._lock:
            self._flashes[key] = (text, kind)
            while len(self._flashes) > _FLASH_KEEP:
                self._flashes.popitem(last=False)
        return key

    def take_flash(self, request: Request) -> str:
        with self._lock:
            found = self._flashes.pop(request.query.get("flash", ""), None)
        return notice(*found) if found else ""

    def action_form(self, request: Request, action: str, label: str,
                    extra: str = "", danger: bool = False) -> str:
        """A form for a mutating action: token, operator, reason and the CSRF
        field; nothing at all on a read-only dashboard."""
        if self.guard.read_only:
            return ""
        cls = "danger" if danger else ""
        return (
            f'<form method=post action="{esc(url(action))}" class=action>'
            f'<input type=hidden name=csrf value="{self.guard.csrf_field(request.csrf_cookie)}">'
            f"{extra}"
            '<label>Operator <input name=operator autocomplete=username required></label>'
            '<label>Reason <input name=reason required></label>'
            '<label>Token <input name=token type=password autocomplete=current-password></label>'
            f'<button class="{cls}">{esc(label)}</button></form>')
