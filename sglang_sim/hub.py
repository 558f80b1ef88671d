"""The model path as SGLang 0.5.23 resolves it: a directory that exists, else a Hugging Face hub id.

SGLang does not expand `~` or look at the path's shape: any `--model-path` that is not an existing
path goes to transformers as a hub id (`AutoConfig.from_pretrained` -> `hf_hub_download`), whose
`validate_repo_id` refuses one that cannot be an id. transformers 5.x re-raises that HFValidationError
as `OSError(str(e))` (upstream: transformers/utils/hub.py `cached_files`; huggingface_hub
utils/_validators.py `validate_repo_id`), in the launching process while it resolves the server's
arguments: a traceback and exit status 1. So `/models/x`, `./x`, `../x`, `~/x` that do not exist
fail, while `org/name` or `name` are taken for hub ids; the simulator, offline, serves those from
its profile as if downloaded.
"""

from __future__ import annotations

import os
import re

from .fatal import SITE_PACKAGES, MainProcessError

__all__ = ["check_model_path", "repo_id_error"]

# huggingface_hub's REPO_ID_REGEX: an optional namespace, a name of word chars, '-' and '.', <= 96
_REPO_ID = re.compile(r"^(\b[\w\-.]+\b/)?\b[\w\-.]{1,96}\b$")


def repo_id_error(repo_id: str) -> str | None:
    if repo_id.count("/") > 1:
        return (f"Repo id must be in the form 'repo_name' or 'namespace/repo_name': '{repo_id}'. "
                "Use `repo_type` argument if needed.")
    if not _REPO_ID.match(repo_id):
        return ("Repo id must use alphanumeric chars, '-', '_' or '.'. The name cannot start or end with '-' or "
                f"'.' and the maximum length is 96: '{repo_id}'.")
    if "--" in repo_id or ".." in repo_id:
        return f"Cannot have -- or .. in repo_id: '{repo_id}'."
    if repo_id.endswith(".git"):
        return f"Repo_id cannot end by '.git': '{repo_id}'."
    return None


def check_model_path(path: str) -> None:
    """Raise MainProcessError (traceback, exit 1) for a path that neither exists nor is a hub id."""
    if os.path.exists(path):
        return
    error = repo_id_error(path)
    if error is not None:
        raise MainProcessError(f"OSError: {error}", frames=(
            (f"{SITE_PACKAGES}/sglang/launch_server.py", 84, "<module>", "run_server(server_args)"),
            (f"{SITE_PACKAGES}/sglang/launch_server.py", 29, "run_server", "server_args.resolve_once()"),
            (f"{SITE_PACKAGES}/sglang/srt/utils/hf_transformers/config.py", 379, "get_config",
             "config = parser.parse("),
            (f"{SITE_PACKAGES}/transformers/utils/hub.py", 595, "cached_files", 'raise OSError(f"{e}") from e'),
        ))
