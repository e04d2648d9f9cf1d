"""The pika loop of docs/own-consumers.md as a process of its own, for
tests/test_own_consumer_loops.py (run under ``faketime`` there).

    python tests/procs/own_loop.py DATABASE_URL BROKER_URL AMQP_URL

Prints ``skew SECONDS`` (this process's clock minus the database server's)
once it is set up, then runs the loop until the stop message
(tests/own_loops.py) and exits 0.
"""

from __future__ import annotations

import sys
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from own_loops import QUEUE, StopLoop, compiled, namespace

import duebox
from duebox.clock import as_utc, server_now_sql


def main(database_url: str, broker_url: str, amqp_url: str) -> None:
    app = duebox.Duebox(database_url, broker_url,
                        settings=duebox.Settings(own_consumer_queues=[QUEUE]))
    sql = server_now_sql(app.engine.dialect.name)
    assert sql is not None, "a database server: its clock is the one that counts"
    with app.engine.connect() as conn:
        server = as_utc(conn.execute(sql).scalar_one())
    print("skew", (datetime.now(UTC) - server).total_seconds(), flush=True)
    ns = namespace(app, amqp_url=amqp_url)
    try:
        exec(compiled("pika (RabbitMQ)"), ns)
    except StopLoop:
        pass
    finally:
        if "connection" in ns and ns["connection"].is_open:
            ns["connection"].close()
        app.dispose()


if __name__ == "__main__":
    main(*sys.argv[1:4])
