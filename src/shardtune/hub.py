"""Hub repositories (a model id, a dataset's ``hf_hub_url``) brought into the Hugging Face cache once per node.

The launching host calls ``fetch_hub_repo`` before any rank starts; a rank finds the files in the cache and asks
no hub. Where no launcher went first (ranks started by another launcher, a node whose cache is shared), the first
process to take the repo's lock downloads while the others wait for it and then read the cache: never every rank
at once. huggingface_hub does the work and reads its own variables: ``HF_HOME`` / ``HF_HUB_CACHE`` (where),
``HF_ENDPOINT`` (which hub), ``HF_HUB_OFFLINE`` (cache only), ``HF_TOKEN``. Every failure is one line naming the id.
"""

from __future__ import annotations

from pathlib import Path

_DEFAULT_ENDPOINT = "https://huggingface.co"


class HubError(Exception):
    """A hub repository that cannot be brought into the cache: not reachable, not there, or offline. Its text is
    one line, which callers add to the problems they collect (a leaf module: no shardtune error types here)."""


def fetch_hub_repo(repo_id: str, *, repo_type: str = "model", revision: str | None = None,
                   allow_patterns: list[str] | None = None, ignore_patterns: list[str] | None = None, what: str,
                   refresh: bool = False) -> Path:
    """The cached snapshot folder of ``repo_id``, downloaded first when missing (or, with ``refresh``, when the
    hub has newer files for ``revision``). ``what``: the key and name for the message (``model_name_or_path``).
    Raises HubError with one line."""
    if not refresh:
        cached = cached_hub_repo(repo_id, repo_type=repo_type, revision=revision, allow_patterns=allow_patterns,
                                 ignore_patterns=ignore_patterns)
        if cached is not None:
            return cached
    from filelock import FileLock
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        cached = cached_hub_repo(repo_id, repo_type=repo_type, revision=revision, allow_patterns=allow_patterns,
                                 ignore_patterns=ignore_patterns)
        if cached is None:
            raise HubError(f"{what}: {repo_id} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and "
                           f"HF_HUB_OFFLINE=1 forbids downloading it; {download_remedy(repo_id, repo_type)}")
        return cached
    lock = Path(constants.HF_HUB_CACHE) / ".locks" / f"shardtune--{repo_type}s--{repo_id.replace('/', '--')}.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(lock)):
        cached = None if refresh else cached_hub_repo(repo_id, repo_type=repo_type, revision=revision,
                                                      allow_patterns=allow_patterns, ignore_patterns=ignore_patterns)
        return cached or _download(repo_id, repo_type, revision, (allow_patterns, ignore_patterns), what)


def cached_hub_repo(repo_id: str, *, repo_type: str = "model", revision: str | None = None,
                    allow_patterns: list[str] | None = None, ignore_patterns: list[str] | None = None
                    ) -> Path | None:
    """The cached snapshot of ``repo_id`` at ``revision`` holding the files the patterns pick, or None; never
    asks the hub."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        folder = Path(snapshot_download(repo_id, repo_type=repo_type, revision=revision, local_files_only=True,
                                        allow_patterns=allow_patterns, ignore_patterns=ignore_patterns))
    except (LocalEntryNotFoundError, OSError, ValueError):
        return None
    folders = [pattern.split("/*")[0] for pattern in allow_patterns or [] if "/*" in pattern]
    return folder if all((folder / part).is_dir() for part in folders) else None


def _download(repo_id: str, repo_type: str, revision: str | None,
              patterns: tuple[list[str] | None, list[str] | None], what: str) -> Path:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"HF_ENDPOINT {constants.ENDPOINT}" if constants.ENDPOINT != _DEFAULT_ENDPOINT else constants.ENDPOINT
    kind = "dataset" if repo_type == "dataset" else "model"
    try:
        return Path(snapshot_download(repo_id, repo_type=repo_type, revision=revision, allow_patterns=patterns[0],
                                      ignore_patterns=patterns[1]))
    except RevisionNotFoundError:
        raise HubError(f"{what}: revision '{revision}' of the {kind} {repo_id} does not exist on the hub ({where}); "
                       "give a branch, tag or commit it has") from None
    except GatedRepoError:
        raise HubError(f"{what}: the {kind} {repo_id} is gated on the hub ({where}); accept its terms on its page "
                       "and give a token (HF_TOKEN or `hf auth login`)") from None
    except RepositoryNotFoundError:
        raise HubError(f"{what}: the {kind} {repo_id} does not exist on the hub ({where}), or is private and needs "
                       "a token (HF_TOKEN or `hf auth login`); check the id") from None
    except LocalEntryNotFoundError as err:
        raise HubError(f"{what}: {repo_id} is not in the Hugging Face cache and the hub ({where}) did not answer "
                       f"({_reason(err)}); {download_remedy(repo_id, repo_type)}") from None
    except HfHubHTTPError as err:
        raise HubError(f"{what}: the hub ({where}) refused {repo_id} ({_reason(err)}); "
                       f"{download_remedy(repo_id, repo_type)}") from None


def download_remedy(repo_id: str, repo_type: str = "model") -> str:
    kind = " --repo-type dataset" if repo_type == "dataset" else ""
    local = "a local copy" if repo_type == "dataset" else "a local model folder"
    return (f"download it first with `hf download {repo_id}{kind}` where the hub is reachable (into the same "
            f"HF_HOME), or give {local}")


def _reason(err: BaseException) -> str:
    """The innermost cause's first line (the connection error behind huggingface_hub's message)."""
    while (behind := err.__cause__ or err.__context__) is not None and behind is not err:
        err = behind
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__
