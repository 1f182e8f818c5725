"""Shared fixtures: the ../shared data folder (optional) and a locally built tokenizer."""

from pathlib import Path

import pytest

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """``../shared/data`` beside the checkout; tests that use it skip in a user's fresh clone."""
    if not (SHARED_DATA / "math500.jsonl").is_file():
        pytest.skip(f"{SHARED_DATA} is absent (the evaluation sets live beside the checkout in development only)")
    return SHARED_DATA


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory) -> Path:
    """A byte-level BPE tokenizer with a ChatML template, trained and saved locally."""
    from megatron_pacs.tiny import build_tokenizer

    path = tmp_path_factory.mktemp("tiny_tokenizer")
    build_tokenizer(vocab_size=512).save_pretrained(path)
    return path
