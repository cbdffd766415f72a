"""Stat loggers: the public import point.

- `StatLogger`, `StatLoggerFanout` (metrics.stat_logger): the interface and a fanout.
- `PrometheusStatLogger` (metrics.prometheus_logger): prometheus-client registry for GET /metrics.
- `RayStatLogger` (metrics.ray_logger): the same table through ray.util.metrics.
- `LoggingStatLogger` (metrics.logging_logger): the periodic progress line.

Both exporters share the stats-to-metric mapping of metrics.exporter and the one table of
metrics.definitions. Ray is imported only when a RayStatLogger is built.
"""

from metrics.exporter import MetricsExporter
from metrics.logging_logger import LoggingStatLogger, ProgressWindow, format_progress_line
from metrics.prometheus_logger import PrometheusStatLogger
from metrics.ray_logger import RayStatLogger
from metrics.stat_logger import StatLogger, StatLoggerFanout

__all__ = [
    "LoggingStatLogger",
    "MetricsExporter",
    "ProgressWindow",
    "PrometheusStatLogger",
    "RayStatLogger",
    "StatLogger",
    "StatLoggerFanout",
    "format_progress_line",
]
