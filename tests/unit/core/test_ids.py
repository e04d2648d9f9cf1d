"""duebox.ids: job ids are RFC 9562 UUIDv7 — version and variant bits set,
the millisecond of creation in the top 48 bits, random below — so they sort
by creation across milliseconds; and a job id is parsed or refused by name."""

from __future__ import annotations

import itertools
import os
import time
import uuid

import pytest

from duebox import ValidationError
from duebox.ids import parse_job_id, process_token, uuid7, uuid7_many


def millisecond(value: uuid.UUID) -> int:
    return value.int >> 80


def test_a_uuid7_has_its_version_variant_and_creation_millisecond() -> None:
    before = time.time_ns() // 1_000_000
    made = [uuid7(), *uuid7_many(50)]
    after = time.time_ns() // 1_000_000
    for value in made:
        assert value.version == 7
        assert value.variant == uuid.RFC_4122
        assert before <= millisecond(value) <= after


def test_ids_of_later_milliseconds_sort_after_and_none_repeat() -> None:
    batches = []
    while len(batches) < 3:  # ids of three different milliseconds
        batch = uuid7_many(200)
        if not batches or millisecond(batch[0]) > millisecond(batches[-1][0]):
            batches.append(batch)
    flat = [value for batch in batches for value in batch]
    assert len(set(flat)) == len(flat)
    for earlier, later in itertools.pairwise(batches):
        assert max(earlier) < min(later)


def test_the_random_bits_are_not_constant() -> None:
    lows = {value.int & ((1 << 62) - 1) for value in uuid7_many(100)}
    highs = {(value.int >> 64) & 0xFFF for value in uuid7_many(100)}
    assert len(lows) == 100
    assert len(highs) > 50


def test_a_job_id_in_any_spelling_or_refused_by_field() -> None:
    value = uuid7()
    assert parse_job_id(value) is value
    assert parse_job_id(str(value).upper()) == value
    assert parse_job_id(value.hex) == value
    for bad in ("", "0190-nope", 42, None, "x" * 1000):
        with pytest.raises(ValidationError) as refused:
            parse_job_id(bad, field="id")
        assert refused.value.field == "id"


def test_a_process_token_names_the_role_and_is_unique() -> None:
    tokens = {process_token("worker") for _ in range(100)}
    assert len(tokens) == 100
    role, host, pid, tail = next(iter(tokens)).split(":")
    assert (role, pid, len(tail)) == ("worker", str(os.getpid()), 8)
    assert 0 < len(host) <= 40
