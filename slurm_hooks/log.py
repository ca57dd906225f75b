"""Logging for hooks and the collector: syslog, stderr (slurmd keeps it in its log at debug level)
and, when configured, a log file. Every hook line carries the job id and node."""

from __future__ import annotations

import logging
import logging.handlers
import os
import sys

_FORMAT = "gpuprof[%(process)d] %(levelname)s job=%(job)s node=%(node)s: %(message)s"


class _JobContext(logging.Filter):
    def __init__(self, job: str, node: str) -> None:
        super().__init__()
        self.job, self.node = job, node

    def filter(self, record: logging.LogRecord) -> bool:
        record.job = getattr(record, "job", self.job)
        record.node = getattr(record, "node", self.node)
        return True


def setup(component: str, job: str = "-", node: str = "-", log_file: str = "") -> logging.Logger:
    """A logger for one hook run or one collector; safe to call more than once."""
    logger = logging.getLogger(f"gpuprof.{component}")
    logger.setLevel(logging.INFO)
    logger.propagate = False
    for h in list(logger.handlers):
        logger.removeHandler(h)
        h.close()
    for f in list(logger.filters):
        logger.removeFilter(f)
    logger.addFilter(_JobContext(job, node))
    fmt = logging.Formatter(_FORMAT)
    stderr = logging.StreamHandler(sys.stderr)
    stderr.setFormatter(fmt)
    logger.addHandler(stderr)
    if os.path.exists("/dev/log"):
        try:
            syslog = logging.handlers.SysLogHandler(address="/dev/log")
        except OSError as e:
            logger.warning("syslog unavailable: %s", e)
        else:
            syslog.setFormatter(fmt)
            logger.addHandler(syslog)
    if log_file:
        try:
            fh = logging.FileHandler(log_file)
        except OSError as e:
            logger.warning("cannot open log file %s: %s", log_file, e.strerror)
        else:
            fh.setFormatter(logging.Formatter("%(asctime)s " + _FORMAT))
            logger.addHandler(fh)
    return logger
