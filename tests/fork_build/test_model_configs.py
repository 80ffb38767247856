"""The offline hub of model configs that upstream's unit tests read
(tools/forkbuild/model_configs.py): Hugging Face's own cache lookup finds each
config, offline, and the hub is named by the configs' contents."""

from __future__ import annotations

import json
from pathlib import Path

from huggingface_hub import try_to_load_from_cache

import fakefork  # noqa: F401  (unused: tools/ resolves from the repository root, tests/__init__.py)
from tools.forkbuild.model_configs import CONFIGS_DIR, offline_hub

ROOT = Path(__file__).resolve().parents[2]


def _configs(tmp_path: Path, hidden_size: int) -> Path:
    configs = tmp_path / "configs"
    model = configs / "some-org" / "tiny-model"
    model.mkdir(parents=True)
    (model / "config.json").write_text(
        json.dumps({"model_type": "opt", "hidden_size": hidden_size})
    )
    return configs


def test_huggingface_finds_every_config_in_the_hub(tmp_path: Path) -> None:
    hub = offline_hub(_configs(tmp_path, 64), tmp_path / "cache")
    found = try_to_load_from_cache("some-org/tiny-model", "config.json", cache_dir=hub)
    assert isinstance(found, str)
    assert json.loads(Path(found).read_text())["hidden_size"] == 64
    # A model the hub does not carry is not found (None), not someone else's config.
    missing = try_to_load_from_cache("other/model", "config.json", cache_dir=hub)
    assert missing is None


def test_changed_configs_get_another_hub(tmp_path: Path) -> None:
    first = offline_hub(_configs(tmp_path / "a", 64), tmp_path / "cache")
    again = offline_hub(_configs(tmp_path / "b", 64), tmp_path / "cache")
    changed = offline_hub(_configs(tmp_path / "c", 128), tmp_path / "cache")
    assert first == again  # same contents, same hub (the recorded environment)
    assert changed != first


def test_the_carried_configs_name_their_models() -> None:
    """Each carried config is valid JSON with an architecture and a model type."""
    configs = sorted((ROOT / CONFIGS_DIR).glob("*/*/config.json"))
    names = [f"{path.parent.parent.name}/{path.parent.name}" for path in configs]
    assert "facebook/opt-125m" in names and "Qwen/Qwen3-0.6B" in names
    for path in configs:
        config = json.loads(path.read_text())
        assert config["architectures"] and config["model_type"]
