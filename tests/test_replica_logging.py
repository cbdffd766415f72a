"""The `tpserve` logger's operator lines reach a Serve replica's handlers and stderr
(deployments/replica_logging.py); the end-to-end check is in test_cli_serve.py."""

from __future__ import annotations

import io
import logging

import pytest

from deployments.replica_logging import ROUTED_LOGGERS, SERVE_LOGGER, TPSERVE_LOGGER, route_tpserve_logs


class Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def loggers():
    """The routed loggers and Serve's, restored afterwards (they are process-wide)."""
    saved = {name: (lg.level, list(lg.handlers), lg.propagate)
             for name in (*ROUTED_LOGGERS, SERVE_LOGGER) for lg in [logging.getLogger(name)]}
    for name in saved:
        logging.getLogger(name).handlers = []
    yield logging.getLogger(TPSERVE_LOGGER), logging.getLogger(SERVE_LOGGER)
    for name, (level, handlers, propagate) in saved.items():
        lg = logging.getLogger(name)
        lg.setLevel(level)
        lg.handlers = handlers
        lg.propagate = propagate


def test_info_lines_reach_serves_handlers_and_stderr_once(loggers):
    tpserve, serve = loggers
    replica_file = Collect()
    serve.addHandler(replica_file)
    stderr = io.StringIO()
    route_tpserve_logs(stderr=stderr)
    route_tpserve_logs(stderr=stderr)  # idempotent: nothing printed twice
    tpserve.info("KV cache: %d blocks", 7)
    tpserve.debug("not at INFO")
    assert replica_file.messages == ["KV cache: 7 blocks"]
    assert stderr.getvalue().count("KV cache: 7 blocks") == 1
    assert "not at INFO" not in stderr.getvalue()
    assert tpserve.propagate is False, "the root logger's handlers would print each line again"


def test_no_extra_stderr_handler_where_serve_already_logs_to_stderr(loggers, capsys):
    import sys

    tpserve, serve = loggers
    serve_console = logging.StreamHandler(sys.stderr)
    serve.addHandler(serve_console)
    ours = io.StringIO()
    route_tpserve_logs(stderr=ours)
    tpserve.info("Maximum concurrency for 256 tokens per request: 3.00x")
    assert ours.getvalue() == ""
    assert capsys.readouterr().err.count("Maximum concurrency") == 1


def test_the_load_time_kernel_choices_reach_the_replica_s_log_too(loggers):
    """workers.* INFO lines (which kernel serves which batches, timed per process) go where the
    tpserve lines go, through one stderr handler, each once."""
    _, serve = loggers
    replica_file = Collect()
    serve.addHandler(replica_file)
    stderr = io.StringIO()
    route_tpserve_logs(stderr=stderr)
    route_tpserve_logs(stderr=stderr)
    logging.getLogger("workers.cpu.linear").info("panel_linear takes %s batches", "every")
    logging.getLogger("workers.cpu.linear").debug("not at INFO")
    assert replica_file.messages == ["panel_linear takes every batches"]
    assert stderr.getvalue().count("panel_linear takes every batches") == 1
    assert "not at INFO" not in stderr.getvalue()
    assert logging.getLogger("workers").propagate is False


def test_a_tp_rank_s_kernel_choices_reach_its_stderr_with_its_rank(loggers):
    """A TP rank is a Ray actor of its own, outside the replica: workers.* INFO lines there went
    nowhere. route_rank_logs sends them to the actor's stderr (Ray's log file and the driver's
    terminal), once each, naming the rank."""
    from workers.executors.ray_worker import route_rank_logs

    stderr = io.StringIO()
    route_rank_logs(1, stderr)
    route_rank_logs(1, stderr)
    logging.getLogger("workers.cpu.linear").info("panel_linear takes %s batches", "every")
    logging.getLogger("workers.cpu.linear").debug("not at INFO")
    lines = stderr.getvalue().splitlines()
    assert len(lines) == 1 and "tpserve rank 1 -- panel_linear takes every batches" in lines[0]
