"""duebox.dashboard.inputs: a request's path, query and form are decoded as
strict UTF-8 and refused by field (never a server error) when they carry a
control character, an overlong field or too many fields."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from duebox import ValidationError
from duebox.dashboard.inputs import (
    MAX_FIELD,
    MAX_FIELDS,
    checked_root,
    decode_form,
    decode_target,
)


def test_path_and_query_are_percent_decoded() -> None:
    assert decode_target("/jobs/%C3%A9t%C3%A9?q=a%20b&tenant=&x=%2B#frag") == (
        "/jobs/été", {"q": "a b", "tenant": "", "x": "+"})
    assert decode_form(b"operator=ana&reason=clean+up") == {"operator": "ana",
                                                            "reason": "clean up"}


@pytest.mark.parametrize(("target", "field"), [
    ("/jobs/%FF", "path"), ("/a%00b", "path"), ("/x?q=%FF", "query"), ("/x?q=%1B", "q"),
    ("/x?q=a%0Ab", "q"), ("/x?q=%7F", "q"), ("/x?q=%C2%85", "q"), ("/x?%00=1", "query"),
    ("/x?q=" + "a" * (MAX_FIELD + 1), "q"),
    ("/x?" + "&".join(f"k{i}=v" for i in range(MAX_FIELDS + 1)), "query"),
])
def test_bad_input_is_refused_by_field(target: str, field: str) -> None:
    with pytest.raises(ValidationError) as refused:
        decode_target(target)
    assert refused.value.field == field


@pytest.mark.parametrize(("body", "field"), [
    (b"reason=\xe9", "form"), (b"reason=%FF", "form"), (b"reason=a%0Db", "reason"),
    (b"&".join(b"k%d=v" % i for i in range(MAX_FIELDS + 1)), "form"),
])
def test_a_bad_form_is_refused_by_field(body: bytes, field: str) -> None:
    with pytest.raises(ValidationError) as refused:
        decode_form(body)
    assert refused.value.field == field


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=60))
def test_any_target_decodes_or_is_refused_naming_a_field(text: str) -> None:
    refused: ValidationError | None = None
    try:
        path, query = decode_target("/" + text)
    except ValidationError as exc:
        refused = exc
    if refused is not None:
        assert refused.field
    else:
        for value in (path, *query, *query.values()):
            assert len(value) <= MAX_FIELD
            assert not any(ord(c) < 32 or 0x7F <= ord(c) <= 0x9F for c in value)


@pytest.mark.parametrize(("root", "clean"), [
    ("", ""), ("/", ""), ("/duebox", "/duebox"), ("/duebox/", "/duebox"),
    ("/ops/duebox-1.2_x~", "/ops/duebox-1.2_x~"),
])
def test_a_mount_prefix_is_kept_without_its_last_slash(root: str, clean: str) -> None:
    assert checked_root(root) == clean


@pytest.mark.parametrize("root", [
    "//evil.example", "/a//b", "/a/../b", "/..", "/.", "/a/./b", "duebox", "/a b", "/é",
    '/"><script>', "/a\r\nSet-Cookie:x", "/a%2Fb", "/" + "a" * 101, "/a" * 101,
])
def test_a_mount_prefix_that_is_no_plain_path_is_refused(root: str) -> None:
    """It starts every link and the cookie's Path: another site (``//``),
    a step up, or anything a link or header would have to escape is refused."""
    with pytest.raises(ValidationError) as refused:
        checked_root(root)
    assert refused.value.field == "mount prefix"
