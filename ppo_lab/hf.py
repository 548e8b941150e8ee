"""Small helpers around Hugging Face transformers that several modules share (chapter 7 loads
the four roles with them)."""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def quiet_transformers():
    """Silence transformers' loading progress bars and notices (they would flood notebooks)."""
    from transformers.utils import logging

    level = logging.get_verbosity()
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        logging.set_verbosity(level)
        logging.enable_progress_bar()
