"""Shared utilities: logging (one logger tree under ``megatron_pacs``)."""

from megatron_pacs.utils.logging import get_logger

__all__ = ["get_logger"]
