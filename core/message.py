"""The envelope every backend carries: outbox id, version, attempt, due time.

The body is JSON; the same fields also travel as headers/attributes
(``duebox-id`` ...) so a consumer can dedupe and validate without parsing the
body.  :func:`JobMessage.decode` is the boundary check for anything arriving
from a broker.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from .errors import MessageDecodeError

FORMAT = "duebox/1"

HEADER_ID = "duebox-id"
HEADER_VERSION = "duebox-version"
HEADER_ATTEMPT = "duebox-attempt"
HEADER_DUE_AT = "duebox-due-at"
HEADER_TASK = "duebox-task"

# json.dumps(separators=...) builds an encoder per call: a relay hot spot.
_ENCODER = json.JSONEncoder(separators=(",", ":"))


class UndecodableJSON(str):
    """The text of a JSON column that does not parse: a row written by hand
    or another program into a database that does not check JSON (SQLite).
    Reading it must not stop a worker; :func:`check_stored_payload` turns it
    into a refusal that dead-letters the job with the reason."""


def lenient_json(text: str | bytes) -> Any:
    """The engines' JSON deserializer: a stored value that does not parse
    becomes an :class:`UndecodableJSON` instead of an exception in a claim."""
    try:
        return json.loads(text)
    except ValueError:
        return UndecodableJSON(text if isinstance(text, str) else text.decode("utf-8", "replace"))


def check_stored_payload(payload: object) -> None:
    if isinstance(payload, UndecodableJSON):
        raise MessageDecodeError("payload", "the stored value is not valid JSON", str(payload))


@dataclass(frozen=True, slots=True)
class JobMessage:
    job_id: uuid.UUID
    task: str
    queue: str
    version: int
    attempt: int
    due_at: datetime
    payload: Any = None
    headers: dict[str, Any] = field(default_factory=dict)

    def encode(self) -> bytes:
        return _ENCODER.encode(
            {
                "format": FORMAT,
                "id": str(self.job_id),
                "task": self.task,
                "queue": self.queue,
                "version": self.version,
                "attempt": self.attempt,
                "due_at": self.due_at.isoformat(),
                "payload": self.payload,
                "headers": self.headers,
            },
        ).encode()

    def header_map(self) -> dict[str, str]:
        return {
            HEADER_ID: str(self.job_id),
            HEADER_VERSION: str(self.version),
            HEADER_ATTEMPT: str(self.attempt),
            HEADER_DUE_AT: self.due_at.isoformat(),
            HEADER_TASK: self.task,
        }

    @classmethod
    def decode(cls, body: bytes | str) -> JobMessage:
        try:
            data = json.loads(body)
        except (ValueError, UnicodeDecodeError) as exc:
            raise MessageDecodeError("body", "must be a JSON duebox message", body) from exc
        if not isinstance(data, dict):
            raise MessageDecodeError("body", "must be a JSON object", body)
        if data.get("format") != FORMAT:
            raise MessageDecodeError("format", f"must be {FORMAT!r}", data.get("format"))
        try:
            job_id = uuid.UUID(str(data["id"]))
        except (KeyError, ValueError):
            raise MessageDecodeError(
                "id", "must be the job's outbox UUID", data.get("id")
            ) from None
        version = data.get("version")
        attempt = data.get("attempt")
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise MessageDecodeError("version", "must be an integer >= 1", version)
        if not isinstance(attempt, int) or isinstance(attempt, bool) or attempt < 0:
            raise MessageDecodeError("attempt", "must be an integer >= 0", attempt)
        task = data.get("task")
        if not isinstance(task, str) or not task:
            raise MessageDecodeError("task", "must be a non-empty string", task)
        queue = data.get("queue")
        if not isinstance(queue, str) or not queue:
            raise MessageDecodeError("queue", "must be a non-empty string", queue)
        try:
            due_at = datetime.fromisoformat(data["due_at"])
        except (KeyError, TypeError, ValueError):
            raise MessageDecodeError(
                "due_at", "must be an ISO 8601 instant with offset", data.get("due_at")
            ) from None
        if due_at.tzinfo is None:
            raise MessageDecodeError("due_at", "must carry a UTC offset", data["due_at"])
        headers = data.get("headers") or {}
        if not isinstance(headers, dict):
            raise MessageDecodeError("headers", "must be an object", headers)
        return cls(
            job_id=job_id,
            task=task,
            queue=queue,
            version=version,
            attempt=attempt,
            due_at=due_at.astimezone(UTC),
            payload=data.get("payload"),
            headers=headers,
        )
