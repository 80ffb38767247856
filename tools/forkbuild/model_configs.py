"""The configs of the hub models upstream's unit tests name, offline.

Upstream's scheduler and KV connector unit tests build a `ModelConfig` of a hub
model (`facebook/opt-125m`, ...) without loading its weights: vLLM reads the
model's `config.json` and nothing else. Upstream's runs are offline here
(`OFFLINE_ENV`), and no model is cached, so each of those tests failed on stock
and on the fork alike, and the comparison could not see the code the series
changes most (docs/upstream-tests.md, "Causes").

`tests/upstream/model-configs/<org>/<name>/config.json` holds, for each model
such a test names, that model's published config (the fields vLLM reads),
written by hand. `offline_hub` lays them out as a Hugging Face hub cache that
both runs point `HF_HUB_CACHE` at. The hub's directory name is a digest of the
configs, so it is also in the recorded environment: stock outcomes recorded
with other configs are recorded again, not compared.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

CONFIGS_DIR = Path("tests") / "upstream" / "model-configs"


def config_files(configs: Path) -> list[Path]:
    """Every `<org>/<name>/config.json` under `configs`, in a stable order."""
    return sorted(configs.glob("*/*/config.json"))


def configs_digest(configs: Path) -> str:
    digest = hashlib.sha256()
    for path in config_files(configs):
        digest.update(str(path.relative_to(configs)).encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


def offline_hub(configs: Path, cache: Path) -> Path:
    """A hub cache under `cache` holding one snapshot (config.json only) of each
    model under `configs`; built once per digest of the configs. Returns the
    directory to set as HF_HUB_CACHE."""
    digest = configs_digest(configs)
    hub = cache / "model-configs-hub" / digest[:16]
    if (hub / ".complete").is_file():
        return hub
    if hub.exists():
        shutil.rmtree(hub)
    revision = digest[:40]
    for path in config_files(configs):
        org, name = path.parent.parent.name, path.parent.name
        repo = hub / f"models--{org}--{name}"
        snapshot = repo / "snapshots" / revision
        snapshot.mkdir(parents=True)
        shutil.copyfile(path, snapshot / "config.json")
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(revision)
    hub.mkdir(parents=True, exist_ok=True)
    (hub / ".complete").write_text("")
    return hub
