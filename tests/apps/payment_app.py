"""The payment-style scenario's worker app (run as a separate process).

The handler charges a local test provider with ``ctx.idempotency_key``; on
its first attempt it then hangs, so the test can SIGKILL the worker after the
charge and before the completion.
"""

import json
import os
import time
import urllib.request
from typing import Any

import duebox

app = duebox.Duebox.from_env()


@app.task("pay", max_attempts=3)
def pay(payload: dict[str, Any], ctx: duebox.JobContext) -> None:
    request = urllib.request.Request(
        os.environ["PAYMENT_URL"] + "/charges",
        data=json.dumps({"amount": payload["amount"]}).encode(),
        headers={"Idempotency-Key": ctx.idempotency_key, "Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=5) as response:
        charge = json.loads(response.read())
    if ctx.attempt == 1:
        time.sleep(120)  # killed here: charged, not completed
    ctx.session.execute(
        duebox.metadata.tables["duebox_audit"].insert().values(
            id=ctx.job_id, at=ctx.due_at, operator="payment-app", action="charged",
            job_id=ctx.job_id, reason=charge["id"], details=None,
        )
    )
