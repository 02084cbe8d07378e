"""Models named by Hugging Face id (``org/name``), through ``huggingface_hub``'s cache.

A model argument that is not an existing path and reads as a repo id is resolved here: a snapshot
already in the cache (``HF_HUB_CACHE``, by default ``~/.cache/huggingface/hub``) is used as it is,
without the network; otherwise it is downloaded (``HF_TOKEN`` for gated or private repos), unless
``HF_HUB_OFFLINE`` is set, which is a :class:`HubError` naming what to do. Only what a checkpoint
needs is fetched (config, weights as safetensors, tokenizer and generation files), never pickled
weights. ``tokenmill pull`` downloads (or updates) ahead of time; ``tokenmill list`` shows the cache.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import huggingface_hub
from huggingface_hub import constants
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
CHECKPOINT_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
"""What a checkpoint folder needs (config, weights, tokenizer, chat template, generation config)."""


class HubError(ValueError):
    """A model id that cannot be resolved; the message says why and what to do."""


@dataclass(frozen=True)
class CachedModel:
    repo_id: str
    revisions: tuple[str, ...]  # commit hashes in the cache
    refs: tuple[str, ...]  # branch or tag names pointing at them
    size_bytes: int


def is_repo_id(model: str) -> bool:
    """True for ``org/name`` that is not a path on this machine."""
    return bool(REPO_ID.match(model)) and not Path(model).exists()


def resolve(repo_id: str, revision: str | None = None) -> Path:
    """The local snapshot folder of ``repo_id`` at ``revision`` (default branch when None): from
    the cache when there, else downloaded; HubError when neither can be had."""
    try:
        return Path(
            huggingface_hub.snapshot_download(
                repo_id, revision=revision, allow_patterns=CHECKPOINT_FILES, local_files_only=True
            )
        )
    except LocalEntryNotFoundError:
        if constants.HF_HUB_OFFLINE:
            at = f" at revision {revision}" if revision else ""
            raise HubError(
                f"model {repo_id!r}{at} is not a local folder and not in the Hugging Face cache "
                f"({constants.HF_HUB_CACHE}), and HF_HUB_OFFLINE is set: run `tokenmill pull {repo_id}` "
                "where the network is reachable (or unset HF_HUB_OFFLINE), or pass a local folder"
            ) from None
    return pull(repo_id, revision)


def pull(repo_id: str, revision: str | None = None) -> Path:
    """Download (or bring up to date) ``repo_id``'s checkpoint files into the cache; its folder."""
    try:
        return Path(huggingface_hub.snapshot_download(repo_id, revision=revision, allow_patterns=CHECKPOINT_FILES))
    except GatedRepoError:
        raise HubError(f"{repo_id} is gated: accept its terms on huggingface.co and set HF_TOKEN") from None
    except RepositoryNotFoundError:
        raise HubError(f"{repo_id} was not found on the Hugging Face Hub (or is private: set HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise HubError(f"{repo_id} has no revision {revision!r}") from None
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError) as exc:
        raise HubError(
            f"could not download {repo_id} from the Hugging Face Hub ({type(exc).__name__}: {exc}); "
            "check the network, or pass a local folder"
        ) from None


def cached_models() -> list[CachedModel]:
    """The models in the Hugging Face cache, by id (none when there is no cache)."""
    try:
        info = huggingface_hub.scan_cache_dir(constants.HF_HUB_CACHE)
    except huggingface_hub.CacheNotFound:
        return []
    return sorted(
        (
            CachedModel(
                repo.repo_id,
                tuple(sorted(r.commit_hash for r in repo.revisions)),
                tuple(sorted(ref for r in repo.revisions for ref in r.refs)),
                repo.size_on_disk,
            )
            for repo in info.repos
            if repo.repo_type == "model"
        ),
        key=lambda m: m.repo_id,
    )
