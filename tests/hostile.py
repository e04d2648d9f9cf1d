"""Hostile messages and a forger that writes them straight into a real broker.

Anyone who can reach a broker can write into duebox's queues: garbage, JSON
nested past the parser's recursion limit, and well-formed envelopes for jobs
that do not exist, due in an hour, naming a queue no broker can use.  The
bad-input tests (``tests/badinput/``), the multi-process demonstration and
the chaos soak's ``hostile`` fault (``tests/soak/faults.py``) all send them
with :class:`Forger`, which uses each broker's own client the way an outsider
would (redis-py ``XADD``, pika ``basic_publish``, boto3 ``send_message``,
librdkafka's producer), not duebox.
"""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import parse_qsl, urlsplit, urlunsplit

FORMAT = "duebox/1"


def envelope(job_id: uuid.UUID | str | None = None, *, due_in: float = 0.0,
             queue: str = "default", task: str = "effect", version: int = 1,
             payload: Any = None) -> bytes:
    """A well-formed message body: by default for a job that does not exist."""
    due = datetime.now(UTC) + timedelta(seconds=due_in)
    return json.dumps({
        "format": FORMAT, "id": str(job_id or uuid.uuid4()), "task": task, "queue": queue,
        "version": version, "attempt": 0, "due_at": due.isoformat(), "payload": payload,
        "headers": {}}).encode()


def forged_future(n: int = 40, *, queue: str = "a.*.b", due_in: float = 3600.0) -> list[bytes]:
    """The issue's forgery: ``n`` envelopes for unknown jobs, due in an hour,
    naming a queue RabbitMQ cannot use."""
    return [envelope(due_in=due_in, queue=queue) for _ in range(n)]


def pack(*envelopes: bytes) -> bytes:
    """A pack's body (brokers/amqp_pack.py) around these envelopes, as is."""
    return b'{"format":"duebox-pack/1","jobs":[' + b",".join(envelopes) + b"]}"


def deep_json(levels: int = 1000) -> bytes:
    """Arrays and objects nested ``levels`` deep, past ``json.loads``'s
    recursion limit at 1,000."""
    return b'{"a":' * (levels // 2) + b"[" * (levels - levels // 2) + \
        b"]" * (levels - levels // 2) + b"}" * (levels // 2)


# Bodies that are no duebox message, and the reason a worker discards each.
GARBAGE = [
    (b"\xff\xfe\x00 not utf-8", "undecodable"),
    (b"{not json", "undecodable"),
    (b"", "undecodable"),
    (b"[1, 2, 3]", "undecodable"),
    (b"null", "undecodable"),
    (b'{"format": "duebox/1", "id": "\\ud800", "version": 1e999}', "undecodable"),
    (b"[" * 1000, "too_deep"),
]


def hostile_mix(forged: int = 40) -> list[bytes]:
    """What the demonstration and the soak inject at once: forged future-due
    envelopes for unknown jobs, a deep body and garbage."""
    return [*forged_future(forged), deep_json(1000), deep_json(5000),
            *(raw for raw, _ in GARBAGE)]


class Forger:
    """Writes raw bodies into the queue ``queue`` of the duebox backend at
    ``broker_url`` (its prefix and names as duebox would use them)."""

    def __init__(self, broker_url: str) -> None:
        self.url = broker_url
        parts = urlsplit(broker_url)
        self.scheme = parts.scheme
        self.params = dict(parse_qsl(parts.query))
        self._client: Any = None
        if self.scheme == "redis":
            import redis

            own = ("prefix", "horizon", "group", "claim_idle", "max_delay")
            rest = "&".join(f"{k}={v}" for k, v in self.params.items() if k not in own)
            self._client = redis.Redis.from_url(urlunsplit(parts._replace(query=rest)))
        elif self.scheme == "amqp":
            import pika

            self._client = pika.BlockingConnection(
                pika.URLParameters(urlunsplit(parts._replace(query=""))))
            self._channel = self._client.channel()
        elif self.scheme == "sqs":
            import boto3

            endpoint = self.params.get("endpoint") or f"http://{parts.hostname}:{parts.port}"
            self._client = boto3.client("sqs", endpoint_url=endpoint, region_name="us-east-1",
                                        aws_access_key_id=parts.username or "test",
                                        aws_secret_access_key=parts.password or "test")
        elif self.scheme == "kafka":
            from confluent_kafka import Producer

            self._client = Producer({"bootstrap.servers": parts.netloc.rpartition("@")[2],
                                     "message.max.bytes": 8 * 1024 * 1024})
        else:
            raise ValueError(f"no forger for {self.scheme}://")

    def send(self, raw: bytes, queue: str = "default",
             headers: dict[str, str] | None = None) -> None:
        """``headers``: AMQP message headers (RabbitMQ only: a forged pack)."""
        if self.scheme == "redis":
            prefix = self.params.get("prefix", "duebox")
            self._client.xadd(f"{prefix}:{{{queue}}}:ready", {"id": "", "v": "1", "body": raw})
        elif self.scheme == "amqp":
            prefix = self.params.get("prefix", "duebox")
            import pika

            self._channel.basic_publish("", f"{prefix}.q.{queue}", raw,
                                        pika.BasicProperties(headers=headers))
        elif self.scheme == "sqs":
            name = self.params.get("prefix", "duebox-") + queue
            url = self._client.get_queue_url(QueueName=name)["QueueUrl"]
            # SQS bodies are XML text: what is not UTF-8, and control
            # characters, cannot even be sent.
            text = "".join(c if c >= " " or c in "\t\n\r" else "?"
                           for c in raw.decode("utf-8", "replace")) or " "
            self._client.send_message(QueueUrl=url, MessageBody=text)
        else:
            self._client.produce(self.params.get("prefix", "duebox.") + queue, raw)
            self._client.flush(30)

    def send_all(self, bodies: list[bytes], queue: str = "default") -> None:
        for raw in bodies:
            self.send(raw, queue)

    def close(self) -> None:
        if self.scheme in ("redis", "amqp"):
            self._client.close()
        elif self.scheme == "kafka":
            self._client.flush(30)

    def __enter__(self) -> Forger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
