"""Models by Hub repo id: `Org/Name` or `Org/Name@revision`, fetched by huggingface_hub into its standard cache.

Only what the engine reads is fetched: safetensors weights (and their index), config.json,
generation_config.json and the tokenizer's files; never a pickle (`*.bin`, `*.pt`, `*.pth`, `*.ckpt`), which
loading could execute. huggingface_hub reads its own settings: HF_TOKEN (gated and private repos), HF_HOME or
HF_HUB_CACHE (where the cache is), HF_HUB_OFFLINE (the cache alone), HF_ENDPOINT (a mirror). A file is written
to a part file (`<etag>.<id>.incomplete`) and renamed once whole, so a snapshot never holds half a file; a
connection that breaks is resumed from the bytes already written (an HTTP Range request, huggingface_hub's own
retries). A worker killed mid-file leaves its part, which huggingface_hub never reuses (a part belongs to one
process): the next fetch of the repo deletes those no process is writing (drop_stale_parts) and fetches that
file again. Every failure is one HubError line: a name the Hub does not know, a gated
repo without a token, no network with nothing cached.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from inference.config import CheckpointError

log = logging.getLogger(__name__)

# What a checkpoint folder holds that the engine reads (inference/checkpoint.py, inference/tokenizer.py)
CHECKPOINT_FILES = [
    "*.safetensors",
    "*.safetensors.index.json",
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
]
# A Hub id: an owner and a name of letters, digits, `-`, `_`, `.`; a revision is a branch, a tag or a commit.
PROGRESS_EVERY_S = 1.0

# (bytes done, bytes in all) while a download runs
Progress = Callable[[int, int], None]


class HubError(CheckpointError):
    """A repo id that cannot be served: what is wrong, in one line."""


def fetch(repo_id: str, revision: str | None = None, progress: Progress | None = None) -> Path:
    """The snapshot folder of `repo_id` at `revision` (default: main), downloaded into the HF cache as needed.
    `progress` hears the bytes fetched so far and the total, at most once every PROGRESS_EVERY_S."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import DryRunError, HfHubHTTPError, LocalEntryNotFoundError

    where = f"{repo_id}@{revision}" if revision else repo_id
    common = {"repo_id": repo_id, "revision": revision, "allow_patterns": CHECKPOINT_FILES}
    with _hub_errors(where):
        counter = _ByteCounter(where, 0, progress)
        try:
            plan = snapshot_download(**common, dry_run=True, tqdm_class=counter.progress_class())
        except (DryRunError, LocalEntryNotFoundError) as exc:
            if isinstance(exc.__cause__, HfHubHTTPError):  # the Hub answered: no such repo, gated, ...
                raise exc.__cause__ from None
            # offline (HF_HUB_OFFLINE, no network): the cache alone
            try:
                path = Path(snapshot_download(**common, local_files_only=True))
            except LocalEntryNotFoundError:
                raise HubError(
                    f"{where}: not in the HF cache ({_cache_dir()}) and the Hub cannot be reached (no network, or "
                    "HF_HUB_OFFLINE=1); download it once with the network up"
                ) from None
            log.info("%s: from the HF cache, offline (%s)", where, path)
            return _checked(path, where)
        weights = [f for f in plan if f.filename.endswith(".safetensors")]
        if not weights:
            raise HubError(
                f"{where}: has no safetensors weights (a pickled checkpoint, *.bin or *.pt, is never loaded here)"
            )
        drop_stale_parts(repo_id)
        counter.total = sum(f.file_size or 0 for f in plan if f.will_download)
        if counter.total:
            log.info("downloading %s: %s into %s", where, _size(counter.total), _cache_dir())
        path = Path(snapshot_download(**common, tqdm_class=counter.progress_class()))
        counter.report(force=True)
    return _checked(path, where)


def drop_stale_parts(repo_id: str) -> None:
    """Delete the repo's part files left by a killed download: those whose blob's lock (the one huggingface_hub
    holds while it writes that blob) is free, so that no process is writing them now."""
    from filelock import Timeout
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name
    from huggingface_hub.utils import WeakFileLock

    folder = repo_folder_name(repo_id=repo_id, repo_type="model")
    for part in (Path(constants.HF_HUB_CACHE) / folder / "blobs").glob("*.incomplete"):
        etag = part.name.split(".", 1)[0]
        try:
            with WeakFileLock(Path(constants.HF_HUB_CACHE) / ".locks" / folder / f"{etag}.lock", timeout=0.5):
                part.unlink(missing_ok=True)
                log.info("%s: removed %s, a part a stopped download left", repo_id, part.name)
        except Timeout:
            continue  # another process is fetching that file right now


def resolve_cache_folder(folder: Path) -> Path:
    """An HF cache's folder for a repo (`.../models--Org--Name`) -> the snapshot its refs/main names, found by
    huggingface_hub from the cache alone."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    repo_id = folder.name.removeprefix("models--").replace("--", "/")
    try:
        return Path(snapshot_download(repo_id, cache_dir=folder.parent, local_files_only=True))
    except LocalEntryNotFoundError:
        raise CheckpointError(
            f"{folder}: an HF cache folder whose refs/main names no snapshot it holds; give the snapshot's folder "
            "(.../snapshots/<revision>)"
        ) from None


def _checked(path: Path, where: str) -> Path:
    if not (path / "config.json").is_file():
        raise HubError(f"{where}: the repository has no config.json ({path})")
    return path


class _hub_errors:
    """huggingface_hub's exceptions (several lines, a URL, a request id) as one HubError line each."""

    def __init__(self, where: str):
        self.where = where

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, traceback):
        if exc is None or isinstance(exc, HubError):
            return False
        from huggingface_hub.errors import (
            GatedRepoError,
            HfHubHTTPError,
            OfflineModeIsEnabled,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )

        where = self.where
        if isinstance(exc, GatedRepoError):
            why = ("a gated repository: accept its terms on the Hub, then set HF_TOKEN to a token of that account"
                   if not os.environ.get("HF_TOKEN") else "a gated repository that HF_TOKEN's account may not read yet "
                   "(accept its terms on the Hub)")  # fmt: skip
        elif isinstance(exc, RevisionNotFoundError):
            why = "no such revision (branch, tag or commit) in the repository"
        elif isinstance(exc, RepositoryNotFoundError):
            why = "no such model repository on the Hub (a private one needs HF_TOKEN)"
        elif isinstance(exc, OfflineModeIsEnabled | ConnectionError | TimeoutError):
            why = f"the Hub cannot be reached ({type(exc).__name__})"
        elif isinstance(exc, HfHubHTTPError):
            status = getattr(getattr(exc, "response", None), "status_code", "?")
            why = f"the Hub answered HTTP {status}"
        elif type(exc).__module__.startswith(("httpx", "huggingface_hub")):
            why = f"the download failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        else:
            return False
        raise HubError(f"{where}: {why}") from None


class _ByteCounter:
    """Turns huggingface_hub's progress bars into (done, total) reports and a log line every few seconds."""

    def __init__(self, where: str, total: int, progress: Progress | None):
        self.where, self.total, self.progress = where, total, progress
        self.done = 0
        self.last = 0.0
        self.logged = 0.0

    def add(self, n: int) -> None:
        self.done += n
        self.report()

    def report(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self.last < PROGRESS_EVERY_S:
            return
        self.last = now
        if self.progress is not None:
            self.progress(min(self.done, self.total), self.total)
        if self.total and (force or now - self.logged >= 5 * PROGRESS_EVERY_S):
            self.logged = now
            done = min(self.done, self.total)
            log.info("downloading %s: %s / %s", self.where, _size(done, self.total), _size(self.total))

    def progress_class(self):
        from huggingface_hub.utils import tqdm

        counter = self

        class CountingBar(tqdm):
            """The snapshot's bar of bytes written counts into `counter`; the others count nothing here."""

            def __init__(self, *args, **kwargs):
                self.counts = kwargs.get("name") == "huggingface_hub.snapshot_download"
                kwargs["disable"] = True  # the worker's log says it, not a terminal bar
                super().__init__(*args, **kwargs)

            def update(self, n=1):
                if self.counts and n:
                    counter.add(int(n))
                return super().update(n)

        return CountingBar


def _size(size: int, scale: int | None = None) -> str:
    """`size` bytes in GB, or MB below one GB (`scale`: the size whose unit to take, without writing it)."""
    unit, factor = ("GB", 1e9) if (scale or size) >= 1e9 else ("MB", 1e6)
    return f"{size / factor:.1f}" + ("" if scale else f" {unit}")


def _cache_dir() -> str:
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE
