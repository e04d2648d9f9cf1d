"""core/db.py: a multi-host PostgreSQL URL, in either of its forms, reaches
psycopg as one host list, and so does duebox's own LISTEN connection.

A failover with such a URL against real servers is tests/test_pg_failover.py.
"""

from __future__ import annotations

import pytest
from psycopg.conninfo import conninfo_to_dict

from duebox.db import libpq_conninfo, parse_database_url
from duebox.errors import ConfigurationError

COMMA = ("postgresql+psycopg://app:s3/cr%40t@db1:5433,db2:5434,db3/shop"
         "?target_session_attrs=read-write&connect_timeout=3")
QUERY = ("postgresql+psycopg://app:s3/cr%40t@/shop?host=db1:5433&host=db2:5434&host=db3"
         "&target_session_attrs=read-write&connect_timeout=3")


def connect_args(url: str) -> dict[str, object]:
    parsed = parse_database_url(url)
    _, params = parsed.get_dialect()().create_connect_args(parsed)
    params.pop("context", None)
    return params


@pytest.mark.parametrize("url", [COMMA, QUERY], ids=["libpq-host-list", "sqlalchemy-query"])
def test_a_multi_host_url_reaches_the_driver_as_one_host_list(url: str) -> None:
    assert connect_args(url) == {
        "host": "db1,db2,db3", "port": "5433,5434,", "dbname": "shop", "user": "app",
        "password": "s3/cr@t", "target_session_attrs": "read-write", "connect_timeout": "3"}


def test_the_listen_connection_gets_every_host() -> None:
    """SQLAlchemy's rendering of the query form (``host=db1%3A5433``) is a
    host libpq cannot resolve: the LISTEN connection never connected."""
    assert conninfo_to_dict(libpq_conninfo(parse_database_url(QUERY))) == {
        "host": "db1,db2,db3", "port": "5433,5434,", "dbname": "shop", "user": "app",
        "password": "s3/cr@t", "target_session_attrs": "read-write", "connect_timeout": "3"}


def test_a_single_host_url_is_left_as_it_is() -> None:
    url = "postgresql+psycopg://app@db1:5433/shop?sslmode=require"
    assert parse_database_url(url).render_as_string() == url
    assert conninfo_to_dict(libpq_conninfo(parse_database_url(url))) == {
        "host": "db1", "port": "5433", "dbname": "shop", "user": "app", "sslmode": "require"}


def test_a_host_list_without_a_database_or_a_query() -> None:
    assert connect_args("postgresql://db1:1,db2:2") == {"host": "db1,db2", "port": "1,2"}


@pytest.mark.parametrize("hosts", ["db1:x,db2", "db1,,db2", "[::1]:5432,db2"])
def test_a_bad_host_list_names_the_field_and_the_entry(hosts: str) -> None:
    with pytest.raises(ConfigurationError, match=r"database_url: .*host list") as caught:
        parse_database_url(f"postgresql://app:secret@{hosts}/shop")
    assert "secret" not in str(caught.value)


def test_other_databases_are_not_rewritten() -> None:
    """A comma in a MySQL host is MySQL's business (it has no host list)."""
    with pytest.raises(ConfigurationError, match="database_url: must be an SQLAlchemy URL"):
        parse_database_url("mysql+pymysql://app@db1:3306,db2:3306/shop")
