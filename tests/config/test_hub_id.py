"""``--hf-model`` takes a hub id found in the local Hugging Face cache (HF_HUB_CACHE / HF_HOME), offline: resolved to
its snapshot folder before the checks and everything that reads the model; an id the cache does not hold is refused
naming the command that downloads it; a folder that exists is never taken for an id."""

import pytest
from helpers.tiny_folders import make_model

from megatron_pacs.config import parse_config
from megatron_pacs.data.tokenizer import load_checked_tokenizer
from megatron_pacs.train import main

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory):
    """A cache holding ``tiny-org/tiny-qwen`` as ``huggingface_hub`` lays it out: snapshots/<commit>/ and refs/main."""
    cache = tmp_path_factory.mktemp("hub")
    repo = cache / "models--tiny-org--tiny-qwen"
    make_model(repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return cache


def test_a_cached_hub_id_resolves_to_its_snapshot_before_the_checks(hub_cache, monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # even where downloads are allowed, a run never downloads
    cfg = parse_config(["--hf-model", "tiny-org/tiny-qwen", "--train-data", "d.jsonl"])
    cfg.model.resolve_hub_id()
    snapshot = hub_cache / "models--tiny-org--tiny-qwen" / "snapshots" / COMMIT
    assert cfg.model.hf_model == str(snapshot)
    assert len(load_checked_tokenizer(cfg.model.hf_model)) > 100  # the tokenizer is read from there too
    assert main(["--hf-model", "tiny-org/tiny-qwen", "--train-data", "d.jsonl", "--dry-run"]) == 0  # config.json
    assert "layout" in capsys.readouterr().out.lower()
    (tmp_path / "run.yaml").write_text("model:\n  hf_model: tiny-org/tiny-qwen\nrun:\n  dry_run: true\n")
    assert main(["--config", str(tmp_path / "run.yaml"), "--world-size", "2"]) == 0  # a run file takes an id too
    assert "layout" in capsys.readouterr().out.lower()


def test_hf_home_locates_the_cache_too(hub_cache, monkeypatch, tmp_path):
    home = tmp_path / "hf_home"
    home.mkdir()
    (home / "hub").symlink_to(hub_cache)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(home))
    cfg = parse_config(["--hf-model", "tiny-org/tiny-qwen"])
    cfg.model.resolve_hub_id()
    assert cfg.model.hf_model.endswith(f"models--tiny-org--tiny-qwen/snapshots/{COMMIT}")


def test_an_id_not_in_the_cache_is_refused_naming_the_download_command(hub_cache, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache))
    with pytest.raises(ValueError, match=r"--hf-model: .*Qwen/Qwen2.5-0.5B.*`hf download Qwen/Qwen2.5-0.5B`"):
        parse_config(["--hf-model", "Qwen/Qwen2.5-0.5B"]).model.resolve_hub_id()
    assert not list(hub_cache.glob("models--Qwen*"))  # nothing was fetched


def test_an_existing_folder_is_kept_even_when_it_looks_like_an_id(hub_cache, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny-org" / "tiny-qwen").mkdir(parents=True)
    cfg = parse_config(["--hf-model", "tiny-org/tiny-qwen"])
    cfg.model.resolve_hub_id()
    assert cfg.model.hf_model == "tiny-org/tiny-qwen"
