"""A FastAPI shop: an order and the job that confirms it commit together.

Run it (from examples/, PostgreSQL in SHOP_DATABASE_URL)::

    export SHOP_DATABASE_URL=postgresql+psycopg://localhost/shop
    python -m duebox db upgrade --app fastapi_shop.main:jobs   # duebox's tables
    uvicorn fastapi_shop.main:api

The relay and the worker run inside the app's lifespan (``duebox.Background``).
To run them beside it instead, as their own processes (what a deployment
with several web processes wants), set ``SHOP_JOBS_IN_PROCESS=0`` and::

    python -m duebox relay  --app fastapi_shop.main:jobs
    python -m duebox worker --app fastapi_shop.main:jobs
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Annotated, Any

from fastapi import Depends, FastAPI, HTTPException
from pydantic import BaseModel, Field
from sqlalchemy import ForeignKey, String, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

import duebox

DATABASE_URL = os.environ.get("SHOP_DATABASE_URL", "postgresql+psycopg://localhost/shop")


class Base(DeclarativeBase):
    pass


class Stock(Base):
    __tablename__ = "fastapi_shop_stock"
    item: Mapped[str] = mapped_column(String(100), primary_key=True)
    available: Mapped[int]


class Order(Base):
    __tablename__ = "fastapi_shop_order"
    id: Mapped[int] = mapped_column(primary_key=True)
    item: Mapped[str] = mapped_column(ForeignKey(Stock.item))
    quantity: Mapped[int]
    confirmations: Mapped[int] = mapped_column(default=0)


# --- the jobs ------------------------------------------------------------------

jobs = duebox.Duebox(database_url=DATABASE_URL, broker_url=os.environ.get("SHOP_BROKER_URL"))


@jobs.task("send-confirmation", max_attempts=5)
async def send_confirmation(payload: dict[str, Any], ctx: duebox.JobContext) -> None:
    # ctx.session is this job's own transaction: the update below commits
    # with the job's completion, so it happens once per job.
    await ctx.session.execute(update(Order).where(Order.id == payload["order_id"])
                              .values(confirmations=Order.confirmations + 1))


# --- the web app ---------------------------------------------------------------

engine = create_async_engine(DATABASE_URL)  # the app's own engine
sessions = async_sessionmaker(engine, expire_on_commit=False)


@contextlib.asynccontextmanager
async def lifespan(_: FastAPI) -> AsyncIterator[None]:
    async with engine.begin() as conn:
        await conn.run_sync(Base.metadata.create_all)  # the shop's tables (a demo's shortcut)
    if os.environ.get("SHOP_JOBS_IN_PROCESS", "1") == "1":
        async with duebox.Background(jobs):  # relay + worker; stopped cleanly on shutdown
            yield
    else:
        yield
    await engine.dispose()
    await jobs.adispose()


api = FastAPI(lifespan=lifespan)


async def session() -> AsyncIterator[AsyncSession]:
    async with sessions() as s:
        yield s


class OrderIn(BaseModel):
    item: str = Field(max_length=100)
    quantity: int = Field(gt=0)
    confirm_after: float = Field(default=0, ge=0, le=86_400, description="seconds")


@api.post("/orders", status_code=201)
async def place_order(order: OrderIn, s: Annotated[AsyncSession, Depends(session)]
                      ) -> dict[str, Any]:
    async with s.begin():  # one transaction: the stock, the order and its job
        # The stock first: an item with no stock row is refused here (409),
        # before the order's foreign key to it would fail the insert (500).
        taken = await s.execute(update(Stock).where(Stock.item == order.item,
                                                    Stock.available >= order.quantity)
                                .values(available=Stock.available - order.quantity))
        if taken.rowcount != 1:  # type: ignore[attr-defined]
            # Raising rolls the whole transaction back: no stock taken.
            raise HTTPException(409, f"not enough {order.item!r} in stock")
        row = Order(item=order.item, quantity=order.quantity)
        s.add(row)
        await s.flush()
        job_id = await jobs.schedule(s, "send-confirmation", {"order_id": row.id},
                                     delay=timedelta(seconds=order.confirm_after),
                                     key=f"confirm-order:{row.id}")
    return {"order_id": row.id, "job_id": str(job_id)}


@api.get("/orders/{order_id}")
async def get_order(order_id: int, s: Annotated[AsyncSession, Depends(session)]
                    ) -> dict[str, Any]:
    row = await s.get(Order, order_id)
    if row is None:
        raise HTTPException(404, "no such order")
    return {"order_id": row.id, "item": row.item, "confirmations": row.confirmations}
