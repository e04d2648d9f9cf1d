"""The processes behind the jobs: each relay's and worker's heartbeat row
(``heartbeat``), who is dead at once from its database session
(``liveness``), and a dead process's jobs taken over (``takeover``)."""
