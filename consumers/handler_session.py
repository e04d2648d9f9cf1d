"""``ctx.session`` of a sync handler, and the rules a handler keeps in it.

A handler's writes through ``ctx.session``, the job's dedupe row and its
completion commit in one transaction, so that they happen once per job: the
transaction is duebox's to end, never the handler's.  :class:`HandlerSession`
refuses ``commit()``, ``rollback()``, ``close()``, ``reset()``,
``invalidate()`` and a second ``begin()`` while the handler runs
(``begin_nested()``, a savepoint of the handler's own, is fine): the call
raises :class:`~duebox.failures.HandlerSessionError`, and the attempt fails
with it even if the handler catches it — its writes rolled back, never
committed half-way.  A connection the handler invalidates is caught after
it returns, with the same error.

In a batch (several jobs in one transaction, consumers/batch.py) the
session joins the batch's connection at its first statement with a
SAVEPOINT of its own (``join_transaction_mode="create_savepoint"``), through
a :class:`Gate`.  Until the handler has used the session, the batch may
**detach** it: the gate then sends its statements to a transaction of its
own, and the batch commits without it (consumers/batch.py says when and
why).
"""

from __future__ import annotations

import enum
import threading
from typing import Any

from sqlalchemy import Connection, Engine, event
from sqlalchemy.orm import Session, SessionTransaction

from duebox.failures import HandlerSessionError

from .settling import unreachable

_RULE = ("a handler must not end the transaction duebox runs it in: its writes commit "
         "together with the job's completion (docs/worker.md, 'Handlers and ctx.session')")


class Attachment(enum.Enum):
    """Where a batched handler's statements go."""

    PENDING = "pending"  # it has not used the session yet
    ATTACHED = "attached"  # its savepoint is on the batch's connection
    DETACHING = "detaching"  # the batch is committing without it
    DETACHED = "detached"  # its statements go to a transaction of its own
    FINISHED = "finished"  # it returned while still the batch's


class Gate:
    """One batched handler's choice between the batch's connection and a
    transaction of its own, made once and under a lock: either the handler
    uses the session first (then it stays in the batch), or the batch lets
    it go first (then it never touches the batch's connection)."""

    def __init__(self, conn: Connection, engine: Engine) -> None:
        self.conn = conn
        self.engine = engine
        self.state = Attachment.PENDING
        self._lock = threading.Lock()
        self._detach_over = threading.Event()

    def bind(self) -> Connection | Engine:
        """Where the handler's next statement goes (called through
        ``Session.get_bind``)."""
        with self._lock:
            if self.state is Attachment.PENDING:
                self.state = Attachment.ATTACHED
            # FINISHED: the ORM objects it left pending are flushed into the
            # batch when its savepoint is released.
            detached = self.state in (Attachment.DETACHING, Attachment.DETACHED)
            return self.engine if detached else self.conn

    def begin_detach(self) -> bool:
        """The batch wants to commit without this handler: True if it has
        not used the session (from then on it never does through the batch)."""
        with self._lock:
            if self.state is not Attachment.PENDING:
                return False
            self.state = Attachment.DETACHING
            return True

    def end_detach(self) -> None:
        """The batch committed (or failed to): the handler's job is leased
        to it now, or lost with the batch — its own completion finds out."""
        with self._lock:
            self.state = Attachment.DETACHED
        self._detach_over.set()

    def wait_detached(self) -> None:
        """Until a detach under way is over (the batch's commit without
        this handler)."""
        self._detach_over.wait()

    def finish(self) -> Attachment:
        """The handler returned: the batch's (``ATTACHED``/``FINISHED``), or
        detached — then wait until the batch's commit without it is over."""
        with self._lock:
            if self.state in (Attachment.PENDING, Attachment.ATTACHED):
                attached = self.state is Attachment.ATTACHED
                self.state = Attachment.FINISHED
                return Attachment.ATTACHED if attached else Attachment.FINISHED
        self._detach_over.wait()
        return Attachment.DETACHED


class HandlerSession(Session):
    """The session a sync handler gets as ``ctx.session``: see the module
    notes.  ``gate``: a batched handler's (None: its own transaction on
    ``bind``)."""

    def __init__(self, bind: Engine | None = None, *, gate: Gate | None = None,
                 **kw: Any) -> None:
        super().__init__(bind=bind, join_transaction_mode="create_savepoint", **kw)
        self.gate = gate
        self.handler_runs = False
        # What the handler did against the rules (None: nothing).
        self.broke_rule: str | None = None
        # The connection its transaction runs on, once it has one, and
        # whether the handler sent a statement through the session: together
        # they say whether the job's own transaction was lost with its
        # connection (see connection_lost).
        self.own_connection: Connection | None = None
        self.handler_asked = False

    # --- where statements go -----------------------------------------------------

    def get_bind(self, mapper: Any = None, **kw: Any) -> Engine | Connection:
        if self.handler_runs:
            self.handler_asked = True
        if self.gate is not None:
            return self.gate.bind()
        return super().get_bind(mapper, **kw)

    # --- what a handler may not do -------------------------------------------------

    def _refuse(self, what: str) -> None:
        self.broke_rule = self.broke_rule or f"ctx.session.{what}"
        raise HandlerSessionError(f"ctx.session.{what}: {_RULE}")

    def commit(self) -> None:
        if self.handler_runs:
            self._refuse("commit()")
        super().commit()

    def rollback(self) -> None:
        if self.handler_runs:
            self._refuse("rollback()")
        super().rollback()

    def close(self) -> None:
        if self.handler_runs:
            self._refuse("close()")
        super().close()

    def reset(self) -> None:
        if self.handler_runs:
            self._refuse("reset()")
        super().reset()

    def invalidate(self) -> None:
        if self.handler_runs:
            self._refuse("invalidate()")
        super().invalidate()

    def begin(self, nested: bool = False) -> SessionTransaction:
        if self.handler_runs and not nested:
            self._refuse("begin()")
        return super().begin(nested=nested)

    # --- around the handler ----------------------------------------------------------

    def check_rules(self, conn: Connection | None = None) -> None:
        """After the handler returned: raise if it broke a rule (even one it
        caught the error of) or invalidated ``conn``, the connection its
        writes went to."""
        if self.broke_rule is not None:
            raise HandlerSessionError(f"{self.broke_rule}: {_RULE}")
        if conn is not None and conn.invalidated:
            raise HandlerSessionError(f"ctx.session's connection was invalidated: {_RULE}")

    def connection_lost(self) -> bool:
        """Whether the job's own transaction is gone with its connection:
        the handler's statements through the session never got one, or the
        one they ran on no longer answers.  Then nothing of the handler's
        writes can commit, whatever the handler raised.  Asked only when
        the handler raised an error saying the database is out of reach:
        it may have come from anything else the handler reaches."""
        conn = self.own_connection
        if conn is None:
            return self.handler_asked
        if conn.invalidated:
            return True
        # Not every driver's disconnect invalidates the connection (psycopg's
        # AdminShutdown, the server killed): ask it.  A transaction the
        # handler's own error aborted still answers, with that.
        try:
            conn.exec_driver_sql("SELECT 1")
        except Exception as exc:
            return unreachable(exc)
        return False

    def release(self, keep: bool) -> None:
        """A batched handler is done: keep its writes (release its
        savepoint) or undo them (roll back to it), and let the session go
        for the next handler.  Nothing to do if it never used the session."""
        self.handler_runs = False
        self.broke_rule = None  # the next handler's slate is clean
        self.own_connection, self.handler_asked = None, False
        if self.get_transaction() is not None:
            if keep:
                super().commit()
            else:
                super().rollback()
        super().close()


@event.listens_for(HandlerSession, "after_begin")
def _own_connection(session: HandlerSession, _transaction: SessionTransaction,
                    connection: Connection) -> None:
    """The connection the session's transaction got (the first: a savepoint
    runs on the same one)."""
    if session.own_connection is None:
        session.own_connection = connection
