"""hf_dsinfer's logger: a child of transformers' library logger.

``transformers.logging.set_verbosity_*()`` and ``TRANSFORMERS_VERBOSITY`` govern it, and its records go through
transformers' handler. Every module logs through ``from hf_dsinfer.log import logger`` (or ``get_logger()``).
"""

from __future__ import annotations

import logging

from transformers.utils import logging as hf_logging

LOGGER_NAME = "transformers.hf_dsinfer"


def get_logger() -> logging.Logger:
    """The ``transformers.hf_dsinfer`` logger (transformers' root library logger configured first)."""
    return hf_logging.get_logger(LOGGER_NAME)


logger = get_logger()

#: One line per served request (``hf-dsinfer serve``'s access log). A child of :data:`logger`: it follows transformers'
#: verbosity unless the server sets its own level (``serve`` turns it on at info; ``--disable-log-requests`` keeps it
#: at transformers' verbosity).
access_logger = hf_logging.get_logger(LOGGER_NAME + ".access")

_WARNED: set[str] = set()


def warn_once(message: str) -> None:
    """Log ``message`` as a warning once per process: a fallback or a piece of advice warns once, not on every load
    or call."""
    if message not in _WARNED:
        _WARNED.add(message)
        logger.warning(message)
