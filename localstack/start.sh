#!/usr/bin/env bash
# LocalStack's SQS on this host, without Docker, for duebox's tests and users.
#
#   localstack/start.sh [start]      install if needed, start, wait until SQS answers
#   localstack/start.sh stop         stop the instance this script started
#   localstack/start.sh restart      stop + start (LocalStack keeps nothing: queues are gone)
#   localstack/start.sh status       exit 0 if SQS answers
#   localstack/start.sh install      only create/refresh the virtual environment
#   localstack/start.sh queue NAME…  create duebox queues (PREFIX+NAME) in it
#
# Environment: LOCALSTACK_PORT (4566), LOCALSTACK_PYTHON (python3.11, else
# python3; must be 3.11+), LOCALSTACK_VENV (localstack/.venv),
# LOCALSTACK_RUN (localstack/.run: pid file, log, state), DUEBOX_SQS_PREFIX
# (duebox-, for `queue`).  The virtual environment is cached and rebuilt
# only when requirements.txt changes.  Nothing is downloaded but PyPI
# packages: the TLS-certificate download and the DNS server are switched off.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PORT="${LOCALSTACK_PORT:-4566}"
VENV="${LOCALSTACK_VENV:-$HERE/.venv}"
RUN="${LOCALSTACK_RUN:-$HERE/.run}"
PIDFILE="$RUN/localstack.pid"
LOG="$RUN/localstack.log"
ENDPOINT="http://127.0.0.1:$PORT"

pick_python() {
    if [[ -n "${LOCALSTACK_PYTHON:-}" ]]; then echo "$LOCALSTACK_PYTHON"; return; fi
    for py in python3.11 python3; do
        if "$py" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
            echo "$py"; return
        fi
    done
    echo "localstack/start.sh: needs Python 3.11+ (set LOCALSTACK_PYTHON)" >&2
    exit 1
}

install() {
    local stamp="$VENV/.requirements.sha256" want
    want="$(sha256sum "$HERE/requirements.txt" | cut -d' ' -f1)"
    # Several starts at once (each test worker starts a LocalStack of its
    # own) share one virtual environment: one builds it, the others wait for
    # it here and find it made.  Without the lock they removed each other's.
    mkdir -p "$(dirname "$VENV")"
    exec 9>"$VENV.lock"
    flock 9
    if [[ -x "$VENV/bin/python" && -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
        flock -u 9
        return
    fi
    local py; py="$(pick_python)"
    echo "localstack: creating $VENV with $("$py" -V 2>&1)" >&2
    rm -rf "$VENV"
    "$py" -m venv "$VENV"
    "$VENV/bin/pip" install -q --disable-pip-version-check -r "$HERE/requirements.txt"
    echo "$want" > "$stamp"
    flock -u 9
}

healthy() {
    "$VENV/bin/python" - "$ENDPOINT" <<'PY' 2>/dev/null
import json, sys, urllib.request
try:
    with urllib.request.urlopen(sys.argv[1] + "/_localstack/health", timeout=2) as r:
        state = json.load(r)["services"].get("sqs")
except Exception:
    sys.exit(1)
sys.exit(0 if state in ("available", "running") else 1)
PY
}

running_pid() {
    [[ -f "$PIDFILE" ]] || return 1
    local pid; pid="$(cat "$PIDFILE")"
    kill -0 "$pid" 2>/dev/null || return 1
    echo "$pid"
}

start() {
    install
    if healthy; then
        echo "localstack: SQS already answers at $ENDPOINT"
        return
    fi
    mkdir -p "$RUN"
    (
        cd "$RUN"
        GATEWAY_LISTEN="127.0.0.1:$PORT" SERVICES=sqs EAGER_SERVICE_LOADING=1 \
        SKIP_SSL_CERT_DOWNLOAD=1 DNS_ADDRESS=0 DISABLE_EVENTS=1 \
        OVERRIDE_IN_DOCKER=0 FILESYSTEM_ROOT="$RUN/filesystem" \
        SQS_ENDPOINT_STRATEGY=path LOCALSTACK_TELEMETRY=0 \
            nohup "$VENV/bin/python" -m localstack.runtime.main >"$LOG" 2>&1 &
        echo $! > "$PIDFILE"
    )
    for _ in $(seq 1 120); do
        if healthy; then
            echo "localstack: SQS ready at $ENDPOINT (pid $(cat "$PIDFILE"), log $LOG)"
            return
        fi
        if ! running_pid >/dev/null; then
            echo "localstack: exited during start-up; last lines of $LOG:" >&2
            tail -n 30 "$LOG" >&2 || true
            exit 1
        fi
        sleep 0.5
    done
    echo "localstack: SQS did not answer within 60 s; see $LOG" >&2
    exit 1
}

stop() {
    local pid
    if pid="$(running_pid)"; then
        kill "$pid"
        for _ in $(seq 1 40); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.25
        done
        kill -9 "$pid" 2>/dev/null || true
        echo "localstack: stopped (pid $pid)"
    fi
    rm -f "$PIDFILE"
}

queue() {
    install
    "$VENV/bin/python" - "$ENDPOINT" "${DUEBOX_SQS_PREFIX-duebox-}" "$@" <<'PY'
import sys
import boto3
endpoint, prefix, *names = sys.argv[1:]
sqs = boto3.client("sqs", endpoint_url=endpoint, region_name="us-east-1",
                   aws_access_key_id="test", aws_secret_access_key="test")
for name in names or ["default"]:
    attrs = {"MessageRetentionPeriod": "1209600", "VisibilityTimeout": "30"}
    if name.endswith(".fifo"):
        attrs.update(FifoQueue="true", ContentBasedDeduplication="false")
    print(sqs.create_queue(QueueName=prefix + name, Attributes=attrs)["QueueUrl"])
PY
}

case "${1:-start}" in
    start) start ;;
    stop) stop ;;
    restart) stop; start ;;
    status) install >/dev/null; healthy ;;
    install) install ;;
    queue) shift; queue "$@" ;;
    *) echo "usage: $0 [start|stop|restart|status|install|queue NAME...]" >&2; exit 2 ;;
esac
