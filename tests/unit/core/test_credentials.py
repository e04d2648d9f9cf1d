"""duebox.credentials: a URL's password is hidden wherever a URL is shown,
however many URLs a text quotes, and refused where a broker client would
read part of it as the host.

Any password in a route's label and key is tests/badinput/test_url_passwords.py's;
here the rule of :func:`redacted` and :func:`check_userinfo` on texts."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from duebox import ConfigurationError
from duebox.credentials import HIDDEN, check_userinfo, redacted


@pytest.mark.parametrize(("text", "shown"), [
    ("redis://h:6379/0", "redis://h:6379/0"),
    ("redis://user@h/0", "redis://user@h/0"),
    ("amqp://user:@h/", "amqp://user:@h/"),  # an empty password is shown as it is
    ("amqp://u:p@h/", f"amqp://u:{HIDDEN}@h/"),
    ("sqs://AKIA:a/b?c#d@h:4566", f"sqs://AKIA:{HIDDEN}@h:4566"),
    ("//u:p@h/x", f"//u:{HIDDEN}@h/x"),
    ("postgresql+psycopg://app:s3cr@t@db/x", f"postgresql+psycopg://app:{HIDDEN}@db/x"),
    # A message quoting several URLs: each is hidden on its own.
    ("redis://a:one@h/0 + amqp://b:two@h/", f"redis://a:{HIDDEN}@h/0 + amqp://b:{HIDDEN}@h/"),
    ("cannot reach kafka://k:pw@h1:9092,h2:9092 (timeout)",
     f"cannot reach kafka://k:{HIDDEN}@h1:9092,h2:9092 (timeout)"),
    ("no url here: user:pw@host", "no url here: user:pw@host"),
])
def test_each_urls_password_is_hidden(text: str, shown: str) -> None:
    assert redacted(text) == shown


# Any password without ':', '@' or whitespace (whitespace then "scheme://" would
# start the next URL of a message: the one shape the rule cannot tell apart).
SECRETS = st.text(st.characters(exclude_characters=":@",
                                exclude_categories=["Cs", "Cc", "Zs", "Zl", "Zp"]),
                  min_size=1, max_size=12)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["redis", "amqp", "sqs", "kafka", "postgresql"]),
                          SECRETS), min_size=1, max_size=3))
def test_no_password_of_any_url_in_a_message_survives(urls: list[tuple[str, str]]) -> None:
    text = " and ".join(f"{scheme}://user{i}:{secret}@host{i}/x"
                        for i, (scheme, secret) in enumerate(urls))
    shown = redacted(text)
    assert shown == " and ".join(f"{scheme}://user{i}:{HIDDEN}@host{i}/x"
                                 for i, (scheme, _) in enumerate(urls))


@pytest.mark.parametrize(("url", "named"), [
    ("redis://u:a/b@h/0", "'/'"), ("amqp://u:a?b@h/", "'?'"), ("sqs://k:a#b@h", "'#'"),
    ("kafka://u:a/?#@h:9092", "'#' and '/' and '?'"),
    ("redis://h/0?prefix=a@b", "'/' and '?'"),  # a raw '@' after the host reads the same
])
def test_a_raw_separator_before_the_last_at_is_refused_unprinted(url: str, named: str) -> None:
    with pytest.raises(ConfigurationError) as refused:
        check_userinfo("broker_url", url)
    message = str(refused.value)
    assert message.startswith(f"broker_url: {named} before the URL's last '@'")
    assert "percent-encode" in message
    assert url.split("//", 1)[1].split("@")[0] not in message


@pytest.mark.parametrize("url", ["redis://u:a%2Fb@h/0", "amqp://u:a%3F%23@h/", "sqs://k:s@h",
                                 "redis://h/0", "kafka://h1:9092,h2:9092"])
def test_percent_encoded_or_plain_userinfo_is_taken(url: str) -> None:
    check_userinfo("broker_url", url)
