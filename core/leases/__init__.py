"""A job's lease, from claim to end: which jobs are due and the statements
that lease them (``claims``, ``records``), a relay's dispatch marks
(``dispatch_marks``), the near-due hold (``holding``), a started job's
steps (``jobstore``, ``batch_sql``), queues read by your own consumer
(``own_queues``), and leases that ran out, put back (``recovery``)."""
