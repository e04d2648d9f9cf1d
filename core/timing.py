"""The timing of a job's hand-over around its due time, in one place.

A job due at ``T`` travels relay → broker → worker → handler; each hop may
happen a little early so the next one is ready at ``T``, and none may run
the handler before ``T`` (invariant 1: the worker holds it to the due time,
on the app's clock).  From the furthest out to ``T``:

* :data:`NEAR_WINDOW_SECONDS` — the relay holds jobs due this soon in memory (still
  leased) and publishes them on its own timer, where the broker's delay is
  coarse or absent (``Capabilities.publish_lead``);
* :data:`EARLY_HOLD_SECONDS` — a message arriving at most this early is held by the
  worker, one further out goes back to the broker;
* :data:`HANDOVER_LEAD_SECONDS` — brokers without a precise delay hand a job over
  this early (the relay's publish for Kafka and RabbitMQ, Redis's mover);
* :data:`EXECUTOR_HOLD_MOST` — a job handed over at most this early goes to
  its executor at once, one further out first waits on the event loop;
* :data:`SQL_HANDOVER_LEAD` — a ``sql://`` worker hands a claimed job to
  its executor this early;
* :data:`REREAD_LEAD` — a job leased before its due time is read again this
  long before it (about a database round trip), so a cancel still wins.

Each number was measured (bench/RESULTS.md): shorter leads made jobs late,
longer ones only hold more threads.

One unit per constant, chosen by what its users compute with: a
``timedelta`` where it is added to or compared with an instant (a due time,
the clock's reading); float seconds, ``_SECONDS`` in the name, where it is a
setting or a field in seconds (``Capabilities.publish_lead``, the relay's
``near_window``, a rate's tokens) or compared with a number of seconds.
"""

from __future__ import annotations

from datetime import timedelta

# While the relay runs, jobs due within this many seconds are held in memory
# (still leased in the database) and published on a precise timer rather than
# through the broker's delay, whose granularity (TTL tiers, a mover's wake-up,
# a consumer's poll) makes them late by tens of milliseconds.  The lease of a
# held job covers the window, so a crashed relay's held jobs are recovered.
NEAR_WINDOW_SECONDS = 15.0

# A message that arrives this close (seconds) before its due time is held in
# the worker; further out it goes back to the broker.
EARLY_HOLD_SECONDS = 1.0

# How long (seconds) before its due time a backend without a precise delay of
# its own hands a job over: Kafka and RabbitMQ (``Capabilities.publish_lead``:
# the relay publishes this early) and Redis (its mover moves a parked job onto
# the stream this early).  The delivery and the worker's version-checked
# start fit in it; the worker holds the handler to the due time, so nothing
# runs early, and reads the job again just before, so a cancel still wins.
# At 100 jobs/s (bench/backends_trials.py lateness) leads of 2-5 ms started
# jobs 1.6-8 ms late at p50; 30 ms: p50 0.3-0.4 ms, p99 0.8-3 ms.
HANDOVER_LEAD_SECONDS = 0.030

# A hand-over ahead (Redis's mover, the relay's timer for held jobs,
# ``sql://``'s claimer, the batch lane's hold) also takes the jobs due within
# this much after the one it woke for: at a steady 500 jobs/s (one every
# 2 ms) one move or publish, one mark and one worker batch carry two or three
# jobs instead of one each (bench/RESULTS.md, "The trickle after the lane's
# hold").  Such a job is handed over at most HANDOVER_LEAD_SECONDS +
# HANDOVER_GATHER ahead; the worker holds it to its due time.
HANDOVER_GATHER = timedelta(milliseconds=5)

# A job handed over at most this long before its due time goes to its
# executor at once, which reads it again and waits out the rest; one further
# out (brokers hand over HANDOVER_LEAD_SECONDS ahead) first waits on the event loop,
# not in an executor thread.
EXECUTOR_HOLD_MOST = timedelta(milliseconds=6)

# A ``sql://`` worker hands a claimed job to its executor this long before its
# due time (it claims rows itself: no broker hop to absorb).
SQL_HANDOVER_LEAD = timedelta(milliseconds=5)

# The batch lane (consumers/runner.py) holds a delivery that arrives at most
# LANE_HOLD_MOST before its due time (brokers hand over HANDOVER_LEAD_SECONDS early),
# then locks its row, version-checked, LANE_LOCK_LEAD before that time and
# holds the handler to it in the executor thread: one transaction instead of
# the usual path's start, re-read and handler transactions.  A cancel
# committed before the lock wins, as one committed before the usual path's
# re-read (REREAD_LEAD) does; one after it waits and finds the job done.
LANE_LOCK_LEAD = timedelta(milliseconds=5)
LANE_HOLD_MOST = timedelta(seconds=2 * HANDOVER_LEAD_SECONDS)

# A job leased before its due time is read again this long before it: about
# a round trip to the database.
REREAD_LEAD = timedelta(milliseconds=3)

# A rate-limited claimer wakes when its bucket holds this many seconds' worth
# of tokens: small enough to keep the rate smooth, large enough to batch.
MIN_REFILL_SECONDS = 0.05

__all__ = ["EARLY_HOLD_SECONDS", "EXECUTOR_HOLD_MOST", "HANDOVER_GATHER",
           "HANDOVER_LEAD_SECONDS", "LANE_HOLD_MOST", "LANE_LOCK_LEAD", "MIN_REFILL_SECONDS",
           "NEAR_WINDOW_SECONDS", "REREAD_LEAD", "SQL_HANDOVER_LEAD"]
