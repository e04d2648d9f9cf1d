"""The envelope every backend carries: outbox id, version, attempt, due time.

The body is JSON; the same fields also travel as headers/attributes
(``duebox-id`` ...) so a consumer can dedupe and validate without parsing the
body.  :func:`JobMessage.decode` is the boundary check for anything arriving
from a broker: anyone who can write to a queue can send it anything.

Before parsing, decode bounds what it parses.  Size: at most the broker's
own message limit (``max_bytes``; a body larger than the broker carries is not
from duebox).  Depth: arrays and objects nested at most
:data:`MAX_JSON_DEPTH` deep, counted by :func:`too_deep` without parsing.
``json.loads`` recurses once per level, and 1,000 bytes of ``[`` raised
``RecursionError`` out of the consumer (it stopped every worker of the
queue).  200 levels leave the parser far from Python's recursion limit
whatever the caller's stack, and are far more than any envelope needs:
``schedule()`` refuses payloads and headers nested deeper than
:data:`PAYLOAD_MAX_DEPTH` (the envelope adds one level), so everything duebox
publishes decodes.
"""

from __future__ import annotations

import itertools
import json
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from json.encoder import c_make_encoder, encode_basestring_ascii  # type: ignore[attr-defined]
from typing import Any

from .errors import MessageDecodeError
from .observability.tracing import TRACE_HEADERS
from .states import Discard
from .validation import text_problem

FORMAT = "duebox/1"

HEADER_ID = "duebox-id"
HEADER_VERSION = "duebox-version"
HEADER_ATTEMPT = "duebox-attempt"
HEADER_DUE_AT = "duebox-due-at"
HEADER_TASK = "duebox-task"

# json.dumps(separators=...) builds an encoder per call: a relay hot spot.
_ENCODER = json.JSONEncoder(separators=(",", ":"))
# A str as the encoder above writes it (ensure_ascii): quoted and escaped.
_json_string = encode_basestring_ascii
# The C encoder under _ENCODER, made once: JSONEncoder.encode builds it anew
# for every call, half the cost of encoding a small payload.  No circular
# check (markers=None): a shared markers dict would make two threads that
# encode the same object see a cycle; a payload read back from JSON has none.
_C_ENCODE = None if c_make_encoder is None else c_make_encoder(
    None, _ENCODER.default, encode_basestring_ascii, None, ":", ",", False, False, True)


def _json(value: Any) -> str:
    """``value`` as _ENCODER writes it."""
    if _C_ENCODE is None:  # no C accelerator (PyPy)
        return _ENCODER.encode(value)
    return "".join(_C_ENCODE(value, 0))

MAX_JSON_DEPTH = 200
# The job table's version column is a 32-bit integer: a larger version names
# no job, and as a query parameter it failed the batch lane's lock query for
# its whole batch (NumericValueOutOfRange).
VERSION_MAX = 2**31 - 1
# The job table's task column; @app.task refuses longer names (core/tasks.py).
TASK_NAME_MAX = 200
PAYLOAD_MAX_DEPTH = MAX_JSON_DEPTH - 1  # the envelope object is the first level
# A JSON column read from the database (a payload, a checkpoint) may nest this
# deep; a row nested deeper (written by hand) reads as UndecodableJSON.  Far
# enough below the parser's recursion limit from any thread's stack.
STORED_MAX_DEPTH = 500
# The largest body decode() parses when the broker names no limit of its own
# (memory://): Redis's string limit, the largest any backend carries.
MAX_BODY_BYTES = 512 * 1024 * 1024

# A JSON string (escapes included), whose brackets are text, not structure.
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
# Brackets to +1 / -1 (as signed bytes), everything else deleted.
_STEPS = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")
_NOT_BRACKETS = bytes(c for c in range(256) if c not in b"[]{}")
_CHUNK = 1 << 16


def too_deep(text: bytes | str, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether JSON ``text`` nests arrays and objects more than ``limit``
    deep, found without parsing it: the brackets outside strings, counted.

    A body with at most ``limit`` opening brackets (nearly every real
    message) is answered by two ``count()`` calls.  Otherwise the brackets
    become +1/-1 steps; passes that drop adjacent open-close pairs (each
    lowers the deepest level by exactly one, at the speed of ``replace``)
    shrink wide structures first, and the running sum of what is left is the
    depth.  Linear in the size and cheaper than parsing; malformed text may
    be over-counted, never under-counted (it does not parse anyway)."""
    raw = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else bytes(text)
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False
    steps = _STRING.sub(b"", raw).translate(_STEPS, _NOT_BRACKETS)
    removed = 0
    while steps and removed < limit:
        fewer = steps.replace(b"\x01\xff", b"")
        if len(fewer) == len(steps):
            break
        shrunk_well = len(fewer) * 4 <= len(steps) * 3
        steps, removed = fewer, removed + 1
        if not shrunk_well:
            break
    depth, most = 0, limit - removed
    for start in range(0, len(steps), _CHUNK):
        levels = list(itertools.accumulate(memoryview(steps[start:start + _CHUNK]).cast("b"),
                                           initial=depth))
        if max(levels) > most:
            return True
        depth = levels[-1]
    return False


class UndecodableJSON(str):
    """The text of a JSON column that does not parse: a row written by hand
    or another program into a database that does not check JSON (SQLite).
    Reading it must not stop a worker; :func:`check_stored_payload` turns it
    into a refusal that dead-letters the job with the reason."""


def lenient_json(text: str | bytes | float) -> Any:
    """The engines' JSON deserializer: a stored value that does not parse (or
    nests too deep to parse safely) becomes an :class:`UndecodableJSON`
    instead of an exception in a claim."""
    if isinstance(text, int | float):
        # SQLite's NUMERIC affinity (a JSON column) stores a bare number as
        # a number and hands it back as one: already decoded.
        return text
    try:
        if not too_deep(text, STORED_MAX_DEPTH):
            return json.loads(text)
    except (ValueError, RecursionError):
        pass
    return UndecodableJSON(text if isinstance(text, str) else text.decode("utf-8", "replace"))


class RawJSON(str):
    """JSON text as PostgreSQL's ``jsonb`` gave it, handed on unparsed: the
    relay's claim reads payloads so (:func:`passed_on`) and the message body
    embeds the text as it is.  Parsing each payload only to encode it again
    was the largest part of a claim's Python (issue #20)."""


# A run of digits this long may be an integer json.loads refuses to read
# (sys.set_int_max_str_digits: 640 is the lowest limit a process can set).
_LONG_NUMBER = re.compile(r"\d{640}")


def passed_on(text: str | None) -> Any:
    """A stored ``jsonb`` payload's text as the relay hands it on: as
    :class:`RawJSON` when any worker will decode it (``jsonb`` is always
    well-formed JSON: no NUL, no lone surrogate, no NaN), else parsed as
    the claim always did (:func:`lenient_json`: too deep for the worker, or a
    number too long for json.loads, becomes :class:`UndecodableJSON`)."""
    if text is None or text == "null":
        return None
    # Both checks are skipped for the usual short payload: fewer brackets
    # than the depth limit, fewer characters than a long number.
    deep = text.count("[") + text.count("{") > STORED_MAX_DEPTH and too_deep(
        text, STORED_MAX_DEPTH)
    if deep or (len(text) >= 640 and _LONG_NUMBER.search(text)):
        return lenient_json(text)
    return RawJSON(text)


def check_stored_payload(payload: object) -> None:
    if isinstance(payload, UndecodableJSON):
        raise MessageDecodeError(
            "payload", f"the stored value is not valid JSON (or nests more than "
            f"{STORED_MAX_DEPTH} levels deep)", str(payload)[:100])


def stored_payload_ok(rec: Any) -> bool:
    """Whether a job record's stored payload decoded (see check_stored_payload)."""
    return not isinstance(rec.payload, UndecodableJSON)


# A job header naming the ordering key: without it the job id is used, so
# there is no order between jobs (JobMessage.ordering_key).
ORDERING_KEY_HEADER = "ordering_key"


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
    # The id and the due time as text, made on first use: a publish writes
    # them into the body, the headers and the record key of one message,
    # which made ``str(UUID)`` and ``isoformat()`` two or three times each.
    _texts: tuple[str, str] | None = field(default=None, init=False, repr=False,
                                           compare=False)

    def _id_and_due(self) -> tuple[str, str]:
        texts = self._texts
        if texts is None:
            texts = (str(self.job_id), self.due_at.isoformat())
            object.__setattr__(self, "_texts", texts)
        return texts

    @property
    def id_text(self) -> str:
        """``str(job_id)``, made once per message."""
        return self._id_and_due()[0]

    def encode(self) -> bytes:
        """The JSON body: the envelope's fields in a fixed order, compact.

        Written out field by field rather than as a dict through
        ``JSONEncoder.encode``, which sets up a new C encoder for every call
        (most of the cost of a small message); the result is byte for byte
        what :meth:`_encode_dict` gives, as tests/test_message_encode.py
        checks.  Anything but the exact types duebox writes takes that path."""
        if not (type(self.task) is str and type(self.queue) is str
                and type(self.version) is int and type(self.attempt) is int):
            return self._encode_dict()
        job_id, due = self._id_and_due()
        payload = self.payload if type(self.payload) is RawJSON else _json(self.payload)
        headers = _json(self.headers) if self.headers else "{}"
        return (f'{{"format":"{FORMAT}","id":"{job_id}","task":{_json_string(self.task)},'
                f'"queue":{_json_string(self.queue)},"version":{self.version},'
                f'"attempt":{self.attempt},"due_at":"{due}",'
                f'"payload":{payload},"headers":{headers}}}').encode()

    def _encode_dict(self) -> bytes:
        job_id, due = self._id_and_due()
        return _ENCODER.encode(
            {
                "format": FORMAT,
                "id": job_id,
                "task": self.task,
                "queue": self.queue,
                "version": self.version,
                "attempt": self.attempt,
                "due_at": due,
                "payload": (json.loads(self.payload) if isinstance(self.payload, RawJSON)
                            else self.payload),
                "headers": self.headers,
            },
        ).encode()

    def ordering_key(self) -> str:
        """The job's ``ordering_key`` header as a string, else its id: jobs of
        one key keep their order where the backend can (a Kafka partition, an
        SQS FIFO message group, the order a worker hands them to handlers)."""
        key = self.headers.get(ORDERING_KEY_HEADER) if self.headers else None
        if key is None or key == "":
            return self.id_text
        return key if isinstance(key, str) else str(key)

    def header_map(self) -> dict[str, str]:
        job_id, due = self._id_and_due()
        headers = {
            HEADER_ID: job_id,
            HEADER_VERSION: str(self.version),
            HEADER_ATTEMPT: str(self.attempt),
            HEADER_DUE_AT: due,
            HEADER_TASK: self.task,
        }
        # The W3C trace context (duebox.observability.tracing), where the job has one.
        if self.headers:
            for k in TRACE_HEADERS:
                if k in self.headers:
                    headers[k] = str(self.headers[k])
        return headers

    @classmethod
    def decode(cls, body: bytes | str, max_bytes: int | None = None) -> JobMessage:
        """The message in ``body``, or :class:`MessageDecodeError` naming the
        field; ``max_bytes``: the broker's message limit (see the module's
        docstring for the bounds checked before parsing)."""
        limit = MAX_BODY_BYTES if max_bytes is None else max_bytes
        raw = body.encode("utf-8", "surrogatepass") if isinstance(body, str) else body
        if len(raw) > limit:
            raise MessageDecodeError("body", f"must be at most {limit} bytes (the broker's "
                                     "message limit)", f"{len(raw)} bytes",
                                     reason=Discard.TOO_LARGE)
        if too_deep(raw):
            raise MessageDecodeError("body", f"must nest at most {MAX_JSON_DEPTH} levels deep",
                                     raw[:40], reason=Discard.TOO_DEEP)
        try:
            data = json.loads(raw)
        except (ValueError, RecursionError) as exc:
            raise MessageDecodeError("body", "must be a JSON duebox message", raw[:100]) from exc
        if not isinstance(data, dict):
            raise MessageDecodeError("body", "must be a JSON object", body)
        return cls.from_data(data)

    @classmethod
    def from_data(cls, data: dict[str, Any]) -> JobMessage:
        """The message an envelope already parsed from JSON holds (one of a
        pack's, brokers/amqp_pack.py), checked as :meth:`decode` checks it."""
        if data.get("format") != FORMAT:
            raise MessageDecodeError("format", f"must be {FORMAT!r}", data.get("format"))
        if "id" not in data:
            raise MessageDecodeError("id", "must be the job's outbox UUID", None)
        job_id = checked_id("id", data["id"])
        version = checked_version("version", data.get("version"))
        attempt = data.get("attempt")
        if not isinstance(attempt, int) or isinstance(attempt, bool) or attempt < 0:
            raise MessageDecodeError("attempt", "must be an integer >= 0", attempt)
        task = checked_task("task", data.get("task"))
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


# --- the fields, checked one by one: the body's and the headers' ------------------------


def checked_id(field: str, value: object) -> uuid.UUID:
    """The job's outbox id: a UUID, in any of its spellings."""
    try:
        return uuid.UUID(value if isinstance(value, str) else str(value))
    except ValueError:
        raise MessageDecodeError(field, "must be the job's outbox UUID", value) from None


def checked_version(field: str, value: object) -> int:
    """A job version: an integer the job table's column can hold."""
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= VERSION_MAX:
        raise MessageDecodeError(field, f"must be an integer from 1 to {VERSION_MAX}", value)
    return value


def checked_task(field: str, value: object) -> str:
    """A task name as ``@app.task`` accepts one: anything else names no task
    and cannot even be a query parameter (NUL on PostgreSQL)."""
    if not isinstance(value, str) or not value or len(value) > TASK_NAME_MAX:
        raise MessageDecodeError(field, f"must be a task name: a non-empty string of at most "
                                 f"{TASK_NAME_MAX} characters", value)
    if (problem := text_problem(value)) is not None:
        raise MessageDecodeError(field, problem, value)
    return value


# Decimal digits in ASCII only: str.isdigit() also takes '²' and '٣', which
# int() refuses or reads as another number.
_DIGITS = re.compile(r"[0-9]{1,12}")


def _header_text(field: str, value: object) -> str:
    """A header's value as text: brokers carry str or UTF-8 bytes (an AMQP
    header may also be a number)."""
    if isinstance(value, bytes):
        try:
            return value.decode()
        except UnicodeDecodeError:
            raise MessageDecodeError(field, "must be UTF-8 text", value) from None
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, str):
        raise MessageDecodeError(field, "must be text", value)
    return value


@dataclass(frozen=True, slots=True)
class MessageRef:
    """What a message handed to ``@duebox.dedupe`` says about its job, checked:
    the id to deduplicate on, and the version and task that must match the
    job's (None where the message names none: a message of your own that
    carries only a ``duebox-id``)."""

    job_id: uuid.UUID
    version: int | None
    task: str | None

    @classmethod
    def of(cls, headers: Mapping[str, object], body: bytes | str | Mapping[str, Any] | None,
           ) -> MessageRef:
        """From a message's ``duebox-*`` headers and its body (raw, or an
        envelope already parsed), or :class:`MessageDecodeError` naming the
        field.  A body must be a duebox message, decoded and bounded as the
        worker decodes it (:meth:`JobMessage.decode`), and headers must agree
        with it: a forged header beside a real body would fence the job with
        one job and hand the handler another's payload."""
        said: dict[str, Any] = {}
        for name, check in ((HEADER_ID, checked_id), (HEADER_VERSION, _header_version),
                            (HEADER_TASK, checked_task)):
            if headers.get(name) is not None:
                said[name] = check(name, _header_text(name, headers[name]))
        if body is None:
            if HEADER_ID not in said:
                raise MessageDecodeError(HEADER_ID, "the message carries no outbox id (not a "
                                         "duebox message?)", dict(headers) or None)
            return cls(said[HEADER_ID], said.get(HEADER_VERSION), said.get(HEADER_TASK))
        msg = (JobMessage.from_data(dict(body)) if isinstance(body, Mapping)
               else JobMessage.decode(body))
        for name, key, value in ((HEADER_ID, "id", msg.job_id),
                                 (HEADER_VERSION, "version", msg.version),
                                 (HEADER_TASK, "task", msg.task)):
            if name in said and said[name] != value:
                raise MessageDecodeError(name, f"must agree with the body's {key} ({value})",
                                         headers[name])
        return cls(msg.job_id, msg.version, msg.task)


def _header_version(field: str, text: str) -> int:
    if not _DIGITS.fullmatch(text):
        raise MessageDecodeError(field, f"must be an integer from 1 to {VERSION_MAX}", text)
    return checked_version(field, int(text))
