"""Hugging Face hub model ids as ``model.path`` (``Qwen/Qwen2.5-7B-Instruct``), resolved through the Hugging Face
cache as transformers, vLLM and verl do: ``HF_HOME`` / ``HF_HUB_CACHE`` say where the cache is, ``HF_HUB_OFFLINE=1``
forbids the network, ``model.revision`` pins a branch, tag or full commit hash (default: the cached ``main``).

The command line resolves a run's model once, in the driver process, before anything is allocated
(:func:`with_local_model`): the returned config's ``model.path`` is the snapshot directory
(``<cache>/models--Org--Name/snapshots/<commit>``), so every reader after it (the actor ranks, the vLLM engines,
the tokenizer, the SFT stage, the checkpoint sidecars and converters) gets a local directory and none of them
resolves, or downloads, on its own. A model already in the cache is used without asking the hub (no network on a
compute node; a new ``main`` on the hub is picked up by downloading it or pinning ``model.revision``). A missing
model is downloaded into the cache by ``train`` / ``eval`` / ``sft`` / ``demos`` unless ``HF_HUB_OFFLINE`` is set
(one process, with huggingface_hub's file locks); ``validate --preflight`` (the sbatch script's check on the
allocation) never downloads: it refuses a model that is not cached, with the ``hf download`` command to run where
there is network.

:func:`cached_snapshot` is the one place a hub id becomes a directory; :func:`megatron_gigpo.models.specs.hf_config_for`
(layout checks, memory plan) and the preflight read the cache through it too.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import shlex
from pathlib import Path
from typing import Any, TypeVar

__all__ = ["ALLOW_PATTERNS", "ModelNotCachedError", "cached_snapshot", "fetch_command", "hub_snapshot", "is_hub_id",
           "missing_message", "with_local_model"]

log = logging.getLogger(__name__)

#: The files of a model repository a run reads (config, generation config, tokenizer, chat template, safetensors
#: weights); a download fetches only these, not the ``*.bin`` / ``*.gguf`` / ``*.onnx`` copies some repositories add.
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja"]

# "name" or "org/name": the hub's own repo id rule (huggingface_hub.utils.validate_repo_id) is applied on top.
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")

C = TypeVar("C")


class ModelNotCachedError(FileNotFoundError):
    """A hub model id is not in the Hugging Face cache (and was not, or could not be, downloaded). The message
    names ``model.path``, the revision, the cache searched, the offline state and the command that fetches it."""


def is_hub_id(path: str) -> bool:
    """Whether ``model.path`` names a hub repository (``Org/Name`` or ``Name``) rather than a local directory
    (an existing path, or one written as a path: absolute, ``./``, ``~``, ``$VAR``, more than one ``/``) or a
    ``builtin:`` model."""
    if path.startswith(("builtin:", "/", ".", "~", "$")) or not _REPO_ID.fullmatch(path):
        return False
    if Path(path).exists():  # a local directory of that name wins, as with transformers' from_pretrained
        return False
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(path)
    except HFValidationError:
        return False
    return True


def cache_dir() -> Path:
    """The Hugging Face hub cache huggingface_hub reads (``HF_HUB_CACHE``, else ``$HF_HOME/hub``)."""
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def offline() -> bool:
    """``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) as huggingface_hub reads it."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def fetch_command(repo_id: str, revision: str | None) -> str:
    """The shell command that puts ``repo_id`` at ``revision`` into the cache searched here."""
    words = ["hf", "download", repo_id, *(["--revision", revision] if revision else []), "--cache-dir", str(cache_dir())]
    return shlex.join(words)


def missing_message(repo_id: str, revision: str | None, why: str = "") -> str:
    """Why ``repo_id`` cannot be used and how to fetch it (for :class:`ModelNotCachedError` and the preflight)."""
    pinned = f"model.revision={revision}" if revision else "revision main (model.revision unset)"
    state = "HF_HUB_OFFLINE=1" if offline() else "HF_HUB_OFFLINE unset"
    return (f"model.path '{repo_id}' ({pinned}) is not in the Hugging Face cache {cache_dir()} ({state}){why}; "
            f"fetch it on a machine with network, into the cache the run reads (HF_HOME / HF_HUB_CACHE, on a "
            f"filesystem every node sees): `{fetch_command(repo_id, revision)}`; or set model.path to a local "
            f"directory with config.json")


def cached_snapshot(repo_id: str, revision: str | None) -> Path | None:
    """The cached snapshot directory of ``repo_id`` at ``revision`` (a branch or tag through ``refs/``, or a
    full commit hash), or None when it is not cached or is incomplete. Never uses the network."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, revision=revision, local_files_only=True,
                                      allow_patterns=ALLOW_PATTERNS))
    except LocalEntryNotFoundError:
        return None


def hub_snapshot(repo_id: str, revision: str | None, *, download: bool) -> Path:
    """The local snapshot directory of hub model ``repo_id`` at ``revision``: the cached one; else, when
    ``download`` and not offline, downloaded into the cache (:data:`ALLOW_PATTERNS`).

    Raises:
        ModelNotCachedError: not cached, and no download allowed or the download failed (the message says which).
    """
    found = cached_snapshot(repo_id, revision)
    if found is not None:
        return found
    if not download or offline():
        raise ModelNotCachedError(missing_message(repo_id, revision))
    from huggingface_hub import snapshot_download

    log.info("model.path %s is not in the Hugging Face cache %s: downloading it (revision %s) ...", repo_id,
             cache_dir(), revision or "main")
    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=ALLOW_PATTERNS))
    except Exception as exc:  # hub errors (no network, unknown repo, gated, bad revision) and OSError: one message
        raise ModelNotCachedError(missing_message(repo_id, revision, f", and downloading it failed: "
                                                  f"{type(exc).__name__}: {str(exc).splitlines()[0]}")) from None


def with_local_model(cfg: C, *, download: bool) -> C:
    """``cfg`` (a recipe: anything with a ``model`` section) whose ``model.path`` is a local directory: a hub id
    is replaced by its snapshot directory (:func:`hub_snapshot`) and ``model.revision`` cleared (the commit is in
    the path); a local directory or ``builtin:`` model is returned unchanged.

    Raises:
        ModelNotCachedError: as :func:`hub_snapshot`.
    """
    m: Any = cfg.model  # type: ignore[attr-defined]
    if not is_hub_id(m.path):
        return cfg
    snapshot = hub_snapshot(m.path, m.revision, download=download)
    log.info("model.path %s (revision %s): %s", m.path, m.revision or "main", snapshot)
    return dataclasses.replace(cfg, model=dataclasses.replace(m, path=str(snapshot), revision=None))  # type: ignore[type-var]

