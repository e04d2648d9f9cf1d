"""Recurring schedules: cron rules in a time zone (``cron``), schedules
declared in code (``periodic``), the stored schedule (``rows``, ``put``),
code made to match the table (``sync``), the API behind ``app.schedules``
(``api``), and the due occurrences turned into jobs (``occurrences``)."""
