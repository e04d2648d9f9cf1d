"""What a process tells its operator: one line per cause of trouble
(``trouble``, ``causes``), repeated lines collapsed (``logs``,
``collapsing``), the command's log format (``logformat``) and OpenTelemetry
tracing (``tracing``).  Prometheus metrics read the tables too and live
above the leases, in duebox.metrics."""
