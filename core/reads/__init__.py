"""The read side: one job as read models (``jobs``), the health report
(``status``), a job's result (``results``), waiting for a job's end
(``wait``), and the bounded queries behind the dashboard's pages
(``pages``)."""
