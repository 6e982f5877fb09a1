"""The package's loggers (``lp_decentral_nlp.*``) follow ``log_level`` as transformers' do.

transformers gives its own loggers a level (``logging.set_verbosity``, which Trainer sets from
``TrainingArguments.log_level``) and a handler. The package's loggers are not under transformers',
so without this their info lines (a resume, the best model's load, the run summary) never print:
Python's last-resort handler prints warnings only. Standard library only (the command lines set
it before torch is imported).
"""
from __future__ import annotations

import logging
import sys

#: the package's root logger; every module logs to a child of it (``logging.getLogger(__name__)``)
LIBRARY = "lp_decentral_nlp"


class _StderrUnlessConfigured(logging.StreamHandler):
    """stderr, as the message alone, for a record the application's own logging does not print:
    silent once the root logger has a handler (``logging.basicConfig``, pytest's capture), which
    then prints it by propagation, so nothing prints twice."""

    def emit(self, record: logging.LogRecord) -> None:
        if not logging.getLogger().handlers:
            self.stream = sys.stderr  # the current one (redirected or captured), as the last resort reads it
            super().emit(record)


def set_verbosity(level: int) -> None:
    """The package's loggers handle records of `level` (a :mod:`logging` level) and above: the
    trainer sets it from ``args.get_process_log_level()`` as Trainer sets transformers', and the
    recipes with their ``--log_level``."""
    logger = logging.getLogger(LIBRARY)
    if not any(isinstance(handler, _StderrUnlessConfigured) for handler in logger.handlers):
        logger.addHandler(_StderrUnlessConfigured())
    logger.setLevel(level)
