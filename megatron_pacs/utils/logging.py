"""One logger tree for the project: ``megatron_pacs`` and its children, configured once."""

from __future__ import annotations

import logging
import os

_ROOT = "megatron_pacs"
_configured = False


def get_logger(name: str | None = None) -> logging.Logger:
    """Return ``megatron_pacs[.name]``, installing one stderr handler on first use.

    The level comes from ``MEGATRON_PACS_LOG_LEVEL`` (default INFO). Child loggers propagate to the root
    ``megatron_pacs`` logger, so applications may replace its handler.
    """
    global _configured
    root = logging.getLogger(_ROOT)
    if not _configured:
        _configured = True
        if not root.handlers:
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
            root.addHandler(handler)
        root.setLevel(os.environ.get("MEGATRON_PACS_LOG_LEVEL", "INFO").upper())
    if not name:
        return root
    return root.getChild(name.removeprefix(_ROOT + "."))
