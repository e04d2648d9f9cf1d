"""What tracing costs a producer (issue #22 item 9): ``app.new_job`` with
OpenTelemetry not imported, with the API imported but no SDK (a no-op
tracer), and with the SDK recording every span (a ``schedule`` span and the
``traceparent`` header per job).

    python bench/tracing.py              # 20,000 calls, best of 5, per mode
    python bench/tracing.py --calls 5000

Each mode runs in a fresh process (a tracer provider is set once per
process, and "not imported" must mean it).  The machine is shared: compare
the ratios to the first mode from one run, not the microseconds across runs;
CPU time per call is printed too, as it moves less with other load.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

MODES = ("off", "api", "sdk")

TRIAL = r"""
import json, sys, time, timeit
mode, calls = sys.argv[1], int(sys.argv[2])
if mode != "off":
    from opentelemetry import trace
if mode == "sdk":
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(InMemorySpanExporter()))
    trace.set_tracer_provider(provider)
import duebox
app = duebox.Duebox("sqlite://", "sql://")
app.task("t")(lambda p, c: None)
cpu0 = time.process_time()
best = min(timeit.repeat(lambda: app.new_job("t", {"a": 1}), number=calls, repeat=5))
cpu = (time.process_time() - cpu0) / (5 * calls)
stamped = "traceparent" in (app.new_job("t", None).headers or {})
print(json.dumps({"mode": mode, "us": best / calls * 1e6, "cpu_us": cpu * 1e6,
                  "stamped": stamped}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20_000)
    args = parser.parse_args()
    rows = []
    for mode in MODES:
        out = subprocess.run([sys.executable, "-c", TRIAL, mode, str(args.calls)],
                             capture_output=True, text=True, check=True).stdout
        rows.append(json.loads(out))
    base = rows[0]["us"]
    for r in rows:
        print(f"{r['mode']:>4}: {r['us']:6.1f} us/call ({r['us'] / base:4.2f}x), "
              f"cpu {r['cpu_us']:6.1f} us/call, traceparent stored: {r['stamped']}",
              file=sys.stderr)
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
