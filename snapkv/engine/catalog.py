"""The models that can be used here, found on disk only: the embedded one, GGUF files installed in the snapkv home,
the local Hugging Face cache and GGUF files converted before. No network is involved."""

import json
from dataclasses import dataclass
from pathlib import Path

from snapkv.base.errors import ModelNotFoundError
from snapkv.base.paths import models_dir
from snapkv.base.supported import SUPPORTED_MODEL_TYPES
from snapkv.engine.conversion import EMBEDDED_NAME, gguf_folder, embedded_gguf_path


@dataclass(frozen=True)
class ModelEntry:
    name: str             # what to pass to --model ("" for the default)
    kind: str             # "embedded", "gguf file", "hugging face cache", "converted gguf"
    path: str
    size_bytes: int
    context: int | None   # positions the model was trained for
    model_type: str | None

    @property
    def supported(self) -> bool:
        return self.model_type in SUPPORTED_MODEL_TYPES


def _config(folder: Path) -> dict:
    try:
        return json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return {}


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _embedded() -> list[ModelEntry]:
    try:
        gguf = embedded_gguf_path()
    except ModelNotFoundError:
        return []
    config = _config(gguf_folder(gguf))
    return [ModelEntry("", "embedded (default)", str(gguf), gguf.stat().st_size,
                       config.get("max_position_embeddings", 8192), config.get("model_type", "llama"))]


def _hugging_face_cache() -> list[ModelEntry]:
    try:
        from huggingface_hub import scan_cache_dir

        cache = scan_cache_dir()
    except Exception:  # no cache folder, or one it cannot read: nothing to list
        return []
    found = []
    for repo in sorted(cache.repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model" or not repo.revisions:
            continue
        latest = max(repo.revisions, key=lambda revision: revision.last_modified)
        config = _config(latest.snapshot_path)
        if config:
            found.append(ModelEntry(repo.repo_id, "hugging face cache", str(latest.snapshot_path),
                                    repo.size_on_disk, config.get("max_position_embeddings"),
                                    config.get("model_type")))
    return found


def installed_gguf(name: str) -> Path | None:
    """The GGUF file installed in the snapkv home under this name (`<home>/models/<name>.gguf`: what
    scripts/registry_models.py installs, or a file a user put there), or None."""
    if not name or "/" in name or "\\" in name or name.startswith("."):
        return None
    path = models_dir() / f"{name}.gguf"
    return path if path.is_file() else None


def _gguf_files() -> list[ModelEntry]:
    """GGUF files installed in the snapkv home, read in their own blocks (their metadata read, nothing converted)."""
    from snapkv.base.errors import SnapKVError
    from snapkv.modeling.gguf_file import GGUFFile

    found = []
    for path in sorted(models_dir().glob("*.gguf")) if models_dir().is_dir() else []:
        try:
            metadata = GGUFFile(path).metadata
        except SnapKVError:  # damaged: listed, so that the user sees it, with no family
            metadata = {}
        architecture = metadata.get("general.architecture")
        found.append(ModelEntry(path.stem, "gguf file", str(path), path.stat().st_size,
                                metadata.get(f"{architecture}.context_length"), architecture))
    return found


def _converted() -> list[ModelEntry]:
    embedded = {str(gguf_folder(Path(entry.path))) for entry in _embedded()}
    found = []
    for folder in sorted(models_dir().glob("*")) if models_dir().is_dir() else []:
        if not folder.is_dir() or folder.name.endswith("-config"):  # a GGUF's config and tokenizer, not a model
            continue
        config = _config(folder)
        if config and str(folder) not in embedded:
            found.append(ModelEntry(str(folder), "converted gguf", str(folder), _size(folder),
                                    config.get("max_position_embeddings"), config.get("model_type")))
    return found


def available_models() -> list[ModelEntry]:
    """Every model snapkv can load here, the default first."""
    return _embedded() + _gguf_files() + _hugging_face_cache() + _converted()


EMBEDDED = EMBEDDED_NAME
