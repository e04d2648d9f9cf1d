"""duebox.brokers.sqs_settings: what an ``sqs://`` URL says — the endpoint
from the host or ``?endpoint=``, TLS by default except on loopback, the keys
percent-decoded — and the queue names its prefix makes."""

from __future__ import annotations

import pytest

from duebox import ConfigurationError, ValidationError
from duebox.brokers.sqs_settings import SQSSettings


def test_aws_by_region_with_the_defaults() -> None:
    assert SQSSettings.from_url("sqs://?region=eu-west-1") == SQSSettings(region="eu-west-1")
    assert SQSSettings.from_url("sqs://").region is None  # boto3's own configuration


@pytest.mark.parametrize(("url", "endpoint", "region"), [
    ("sqs://localhost:4566", "http://localhost:4566", "us-east-1"),
    ("sqs://127.0.0.1:4566", "http://127.0.0.1:4566", "us-east-1"),
    ("sqs://[::1]:4566", "http://[::1]:4566", "us-east-1"),
    ("sqs://sqs.example:443?region=eu-west-1", "https://sqs.example:443", "eu-west-1"),
    ("sqs://sqs.example", "https://sqs.example", "us-east-1"),
    ("sqs://localhost:4566?tls=true", "https://localhost:4566", "us-east-1"),
    ("sqs://?endpoint=http://h:1/", "http://h:1", "us-east-1"),
])
def test_the_endpoint_from_the_host_or_the_parameter(url: str, endpoint: str, region: str
                                                     ) -> None:
    s = SQSSettings.from_url(url)
    assert (s.endpoint, s.region) == (endpoint, region)


def test_keys_are_percent_decoded_and_numbers_land_in_their_fields() -> None:
    s = SQSSettings.from_url("sqs://AKIA:se%2Fcr%40t@localhost:4566?fifo=yes&wait=0"
                             "&visibility_timeout=43200&threads=64&max_message_size=1024"
                             "&create=false&check_interval=0.5&align=0&prefix=app_")
    assert (s.access_key, s.secret_key) == ("AKIA", "se/cr@t")
    assert (s.fifo, s.wait, s.visibility_timeout, s.threads, s.max_message_size, s.create,
            s.check_interval, s.align, s.prefix) == (
        True, 0, 43200, 64, 1024, False, 0.5, 0.0, "app_")


@pytest.mark.parametrize(("url", "says"), [
    ("redis://h", "must start with sqs://"),
    ("sqs://h:1?endpoint=http://h:1", "give the SQS endpoint either as the URL's host or"),
    ("sqs://?tls=true", "tls applies only with a host in the URL"),
    ("sqs://?endpoint=ftp://h", "endpoint must be an http(s)://host[:port] URL"),
    ("sqs://?endpoint=http://h/path", "endpoint must be an http(s)://host[:port] URL"),
    ("sqs://AKIA@h", "give both the access key and the secret"),
    ("sqs://?region=EU_WEST", "region must look like us-east-1"),
    ("sqs://?wait=21", "wait must be an integer >= 0 and <= 20"),
    ("sqs://?visibility_timeout=43201", "visibility_timeout must be an integer >= 1"),
    ("sqs://?prefix=a.b", "prefix must be at most 40 letters, digits, '-' or '_'"),
    ("sqs://?fifo=maybe", "fifo must be true or false"),
    ("sqs://?regoin=x", "unknown parameter 'regoin' for sqs://"),
    ("sqs://h:99999", "Port out of range"),
])
def test_a_bad_url_is_refused_naming_the_rule(url: str, says: str) -> None:
    with pytest.raises(ConfigurationError) as refused:
        SQSSettings.from_url(url)
    assert str(refused.value).startswith(f"broker_url: {says}"), str(refused.value)


def test_queue_names_with_the_prefix_and_fifo_suffix() -> None:
    s = SQSSettings(prefix="app-")
    assert s.queue_name("mail") == "app-mail"
    assert s.queue_name("mail", fifo=True) == "app-mail.fifo"
    assert SQSSettings(prefix="", fifo=True).queue_name("x" * 75) == "x" * 75 + ".fifo"
    for bad, fifo in (("x" * 77, False), ("x" * 72, True), ("a.b", False), ("ü", False)):
        with pytest.raises(ValidationError) as refused:
            s.queue_name(bad, fifo=fifo)
        assert refused.value.field == "queue"
