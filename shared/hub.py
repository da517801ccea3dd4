"""Model paths that are Hugging Face Hub ids: resolved to a local snapshot before any process starts.

Owner: the launcher (`launch.py main`) and `hyssm.Engine` call `resolve_model` once, in their
preflight; every child process then gets `ServerArgs.model_path` as a local directory and never
looks at the Hub. Rules:
- `builtin` and any path that exists locally are used as they are;
- anything else that is a valid repo id (`org/name` or `name`) is fetched with
  `huggingface_hub.snapshot_download` (its cache layout, its progress bars, `HF_TOKEN`), only the
  files the loader reads (`LOADER_FILES`), at `--revision` into `--download-dir` (else the Hub's
  own cache: `HF_HUB_CACHE` / `HF_HOME`); with `HF_HUB_OFFLINE=1` only the local cache is consulted;
- a failure is one ConfigError line naming the id (unknown id, unknown revision, no network, not
  in the cache while offline).
The served model name of a Hub model defaults to its id (as vLLM and SGLang report it).
"""

from __future__ import annotations

import logging
import os

from shared.config import BUILTIN_MODEL, ConfigError, ServerArgs

logger = logging.getLogger(__name__)

LOADER_FILES = [
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "*.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
    "additional_chat_templates/*",
]
"""What `snapshot_download` fetches: the weights, config and tokenizer files the processes read."""

_TRUE = ("1", "true", "yes", "on")


def is_hub_id(model_path: str) -> bool:
    """True when `model_path` is not `builtin`, not an existing path, and a well-formed repo id."""
    if model_path == BUILTIN_MODEL or os.path.exists(model_path):
        return False
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(model_path)
    except HFValidationError:
        return False
    return True


def resolve_model(args: ServerArgs) -> ServerArgs:
    """`args` with `model_path` a local directory (module docstring); unchanged when it already is."""
    if not is_hub_id(args.model_path):
        return args
    local = download(args.model_path, args.revision, args.download_dir)
    logger.info("model %s%s is at %s", args.model_path, f"@{args.revision}" if args.revision else "", local)
    return args.replace(model_path=local, served_model_name=args.served_model_name or args.model_path)


def offline() -> bool:
    """HF_HUB_OFFLINE as set now (huggingface_hub reads it once, at its import)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def download(repo_id: str, revision: str = "", download_dir: str = "") -> str:
    """The local snapshot directory of `repo_id` (downloaded unless cached); ConfigError otherwise."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"--model-path {repo_id}" + (f" --revision {revision}" if revision else "")
    try:
        path = snapshot_download(repo_id, revision=revision or None, cache_dir=cache_dir(download_dir),
                                 allow_patterns=LOADER_FILES, local_files_only=offline())
    except GatedRepoError as e:
        raise ConfigError(f"{where}: the Hugging Face Hub model is gated: accept its terms and set HF_TOKEN "
                          f"({_first_line(e)})") from None
    except RepositoryNotFoundError:
        raise ConfigError(f"{where}: not a local directory, and no such model on the Hugging Face Hub "
                          "(a private one needs HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise ConfigError(f"{where}: the Hugging Face Hub model has no revision {revision!r}") from None
    except LocalEntryNotFoundError:
        if offline():
            raise ConfigError(f"{where}: not a local directory, and not in the Hugging Face Hub cache "
                              f"({cache_dir(download_dir)}) while HF_HUB_OFFLINE is set") from None
        raise ConfigError(f"{where}: not a local directory, and the Hugging Face Hub cannot be reached "
                          "(no network?) and the model is not in its cache") from None
    except (OSError, ValueError) as e:  # HTTP errors (HfHubHTTPError is an OSError), bad arguments
        raise ConfigError(f"{where}: cannot download from the Hugging Face Hub: {_first_line(e)}") from None
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(f"{where}: the Hugging Face Hub model has no config.json (not a transformers checkpoint)")
    return path


def cache_dir(download_dir: str = "") -> str:
    """--download-dir, else HF_HUB_CACHE, else HF_HOME/hub as set now, else huggingface_hub's default."""
    if download_dir:
        return download_dir
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return os.path.join(os.environ["HF_HOME"], "hub")
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
