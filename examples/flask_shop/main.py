"""A Flask-SQLAlchemy shop: an order and the job that confirms it commit together.

Run it (from examples/, PostgreSQL in SHOP_DATABASE_URL)::

    export SHOP_DATABASE_URL=postgresql+psycopg://localhost/shop
    python -m duebox db upgrade --app flask_shop.main:jobs    # duebox's tables
    flask --app flask_shop.main run
    python -m duebox relay  --app flask_shop.main:jobs        # beside it
    python -m duebox worker --app flask_shop.main:jobs
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

from flask import Flask, abort, request
from flask_sqlalchemy import SQLAlchemy
from sqlalchemy import ForeignKey, String, update
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

import duebox

DATABASE_URL = os.environ.get("SHOP_DATABASE_URL", "postgresql+psycopg://localhost/shop")


class Base(DeclarativeBase):
    pass


db = SQLAlchemy(model_class=Base)


class Stock(db.Model):  # type: ignore[name-defined,misc]
    __tablename__ = "flask_shop_stock"
    item: Mapped[str] = mapped_column(String(100), primary_key=True)
    available: Mapped[int]


class Order(db.Model):  # type: ignore[name-defined,misc]
    __tablename__ = "flask_shop_order"
    id: Mapped[int] = mapped_column(primary_key=True)
    item: Mapped[str] = mapped_column(ForeignKey(Stock.item))
    quantity: Mapped[int]
    confirmations: Mapped[int] = mapped_column(default=0)


# --- the jobs ------------------------------------------------------------------

jobs = duebox.Duebox(database_url=DATABASE_URL, broker_url=os.environ.get("SHOP_BROKER_URL"))


@jobs.task("send-confirmation", max_attempts=5)
def send_confirmation(payload: dict[str, Any], ctx: duebox.JobContext) -> None:
    # The models work with ctx.session, the job's own transaction (no app
    # context needed): the update commits with the job's completion, once.
    ctx.session.execute(update(Order).where(Order.id == payload["order_id"])
                        .values(confirmations=Order.confirmations + 1))


# --- the web app ---------------------------------------------------------------

def create_app() -> Flask:
    app = Flask(__name__)
    app.config["SQLALCHEMY_DATABASE_URI"] = DATABASE_URL
    db.init_app(app)
    with app.app_context():
        db.create_all()  # the shop's tables (a demo's shortcut; use migrations)

    @app.post("/orders")
    def place_order() -> tuple[dict[str, Any], int]:
        body = request.get_json()
        order = Order(item=body["item"], quantity=int(body["quantity"]))
        # The stock first: an item with no stock row is refused here (409),
        # before the order's foreign key to it would fail the insert (500).
        taken = db.session.execute(update(Stock).where(Stock.item == order.item,
                                                       Stock.available >= order.quantity)
                                   .values(available=Stock.available - order.quantity))
        if taken.rowcount != 1:  # type: ignore[attr-defined]
            db.session.rollback()  # no stock taken, no order, no job
            abort(409, f"not enough {order.item!r} in stock")
        db.session.add(order)
        db.session.flush()
        # db.session is a registry (scoped_session); db.session() is this
        # request's Session, whose transaction the job joins.
        job_id = jobs.schedule(db.session(), "send-confirmation", {"order_id": order.id},
                               delay=timedelta(seconds=float(body.get("confirm_after", 0))),
                               key=f"confirm-order:{order.id}")
        db.session.commit()  # the order, its job and the stock, together
        return {"order_id": order.id, "job_id": str(job_id)}, 201

    @app.get("/orders/<int:order_id>")
    def get_order(order_id: int) -> dict[str, Any]:
        order = db.get_or_404(Order, order_id)
        return {"order_id": order.id, "item": order.item, "confirmations": order.confirmations}

    return app
