"""The public API is a decision: this pins ``duebox.__all__``."""

import subprocess
import sys

import duebox


def test_public_names_are_pinned() -> None:
    assert sorted(duebox.__all__) == sorted([
        "DUPLICATE", "AccessRefusedError", "AmbiguousJobError", "Background", "BrokerError",
        "Classifier", "Clock",
        "ConfigurationError",
        "DatabaseClock",
        "DatabaseError", "Duebox", "DueboxError", "FailureClass", "FakeClock", "JobContext",
        "JobInfo", "JobMessage", "JobNotFoundError", "JobState", "JobStateError", "LeaseLostError",
        "MessageDecodeError", "MissingDependencyError", "NewJob", "NotDueError", "Periodic",
        "Permanent",
        "PermissionDeniedError",
        "RedisDedupeStore", "Relay", "RetryPolicy", "SQLDedupeStore", "Settings", "SystemClock",
        "TablesMissingError", "Task", "TaskHandle",
        "Throttled", "Transient", "UnknownTaskError", "ValidationError", "WaitTimeoutError",
        "Worker", "__version__",
        "dedupe", "metadata",
    ])
    for name in duebox.__all__:
        assert hasattr(duebox, name), name


def test_every_error_is_a_duebox_error() -> None:
    for name in duebox.__all__:
        obj = getattr(duebox, name)
        if isinstance(obj, type) and issubclass(obj, Exception):
            assert issubclass(obj, duebox.DueboxError), name


def test_import_loads_no_broker_driver() -> None:
    code = ("import sys, duebox, duebox.relay, duebox.consumers, duebox.cli.main; "
            "print(sorted(m for m in ('pika', 'boto3', 'aiokafka', 'redis') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_lazy_names_are_listed_and_loaded_on_first_use() -> None:
    lazy = ["DUPLICATE", "Background", "RedisDedupeStore", "Relay", "SQLDedupeStore", "Worker",
            "dedupe"]
    code = ("import sys, duebox; "
            "print(sorted(m for m in sys.modules if m.startswith(('duebox.relay', "
            "'duebox.consumers', 'duebox.cli')))); "
            f"print(sorted(n for n in {lazy!r} if n in dir(duebox)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded, listed = out.stdout.splitlines()
    assert loaded == "[]"  # `import duebox` stays light: core imports no upper floor
    assert listed == repr(sorted(lazy))
    assert set(lazy) <= set(dir(duebox))
    from duebox.cli.background import Background
    from duebox.consumers import Worker
    from duebox.relay import Relay

    assert (duebox.Worker, duebox.Relay, duebox.Background) == (Worker, Relay, Background)
