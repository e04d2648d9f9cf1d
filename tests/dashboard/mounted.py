"""The dashboard mounted in a host web app and served over real HTTP: a
FastAPI app under uvicorn (ASGI), a Flask app behind werkzeug's
DispatcherMiddleware under wsgiref (WSGI)."""

from __future__ import annotations

import socket
import socketserver
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import uvicorn
from fastapi import FastAPI
from flask import Flask
from werkzeug.middleware.dispatcher import DispatcherMiddleware

import duebox
from duebox.dashboard import asgi_app, wsgi_app

PREFIX = {"asgi": "/duebox", "wsgi": "/ops/duebox"}


@contextmanager
def uvicorn_serving(web: Any) -> Iterator[str]:
    sock = socket.create_server(("127.0.0.1", 0))
    config = uvicorn.Config(web, log_level="warning", lifespan="off", ws="none", http="h11")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        while not server.started:
            assert thread.is_alive(), "uvicorn did not start"
            threading.Event().wait(0.02)  # uvicorn sets a flag, no event to wait on
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


class _ThreadedWSGIServer(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True


@contextmanager
def wsgiref_serving(app: Any) -> Iterator[str]:
    server = make_server("127.0.0.1", 0, app, server_class=_ThreadedWSGIServer,
                         handler_class=_Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(30)


@contextmanager
def mounted(kind: str, app: duebox.Duebox, **options: Any) -> Iterator[str]:
    """The URL of a host app (answering ``/`` itself) with the dashboard of
    ``app`` mounted at ``PREFIX[kind]``."""
    if kind == "asgi":
        web = FastAPI()
        web.get("/")(lambda: {"shop": True})
        dashboard = asgi_app(app, **options)
        web.mount(PREFIX[kind], dashboard)
        try:
            with uvicorn_serving(web) as url:
                yield url
        finally:
            dashboard.close()
    else:
        flask = Flask("shop")
        flask.get("/")(lambda: {"shop": True})
        flask.wsgi_app = DispatcherMiddleware(  # type: ignore[method-assign]
            flask.wsgi_app, {PREFIX[kind]: wsgi_app(app, **options)})
        with wsgiref_serving(flask) as url:
            yield url
