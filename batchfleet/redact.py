"""Secrets are never written in clear: the one place that knows what a secret looks like.

Two secrets pass through batchfleet: the server API key (`BATCHFLEET_SERVER_API_KEY`, the server's
`--api-key`) and the Redis password (in the URL's userinfo, `redis://user:PASS@host`, or as a query
parameter, `?password=PASS`). Everything batchfleet writes — logs, the server log file, status
records and events in Redis, JSON output, error messages — goes through one of:

- `redact_url(url)`: a Redis URL with its password (userinfo and `password=` query) hidden;
- `redact_argv(argv)`: a command line with the value of every secret flag hidden (`--api-key K`,
  `--api-key=K`, `--admin-api-key`, `--ssl-keyfile-password`, ...);
- `Scrubber(secrets)`: free text (a log line, a log tail, an exception message) with every known
  secret value replaced; `Scrubber.for_config(config)` knows the configuration's secrets, and
  `install_log_scrubbing` puts one on every log handler of the process.

`private_dir` / `private_file` create what batchfleet keeps on disk: directories 0700, files 0600.
"""

from __future__ import annotations

import logging
import os
import re
import shlex
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import IO, Any
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit

__all__ = ["MASK", "Scrubber", "argv_secrets", "install_log_scrubbing", "is_secret_flag", "private_dir",
           "private_dir_problem", "private_file", "redact_argv", "redact_url", "url_secrets"]

MASK = "***"

# A flag whose value is a secret: `--api-key`, `--admin-api-key`, `--ssl-keyfile-password`, `--hf-token`...
_SECRET_FLAG = re.compile(r"--(?:[a-z0-9-]*-)?(?:api-key|password|passwd|secret|token)")
# URL query parameters that carry a password (redis-py reads `password`; the others are TLS key passwords).
_SECRET_QUERY = frozenset({"password", "ssl_password", "ssl_keyfile_password"})
# Free-text scrubbing replaces every occurrence of a secret's value; a value this short would mangle
# unrelated text, so it is only hidden where its place is known (URL, flag).
MIN_SCRUB_LEN = 4


def is_secret_flag(flag: str) -> bool:
    return _SECRET_FLAG.fullmatch(flag) is not None


def redact_argv(argv: Sequence[str]) -> list[str]:
    """`argv` with the value of every secret flag replaced by MASK (both `--flag V` and `--flag=V`)."""
    out: list[str] = []
    hide_next = False
    for token in argv:
        if hide_next:
            out.append(MASK)
            hide_next = False
            continue
        flag, eq, _value = token.partition("=")
        if is_secret_flag(flag):
            if eq:
                out.append(f"{flag}={MASK}")
            else:
                out.append(token)
                hide_next = True
            continue
        out.append(token)
    return out


def argv_secrets(argv: Sequence[str]) -> list[str]:
    """The values of the secret flags in `argv` (what `redact_argv` hides), for a Scrubber."""
    shown = redact_argv(argv)
    return [a for a, b in zip(argv, shown, strict=True) if a != b and b == MASK] + \
        [a.partition("=")[2] for a, b in zip(argv, shown, strict=True) if a != b and b != MASK]


def redact_url(url: str) -> str:
    """The URL with its password hidden: in the userinfo (`user:***@`) and in the query (`password=***`)."""
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:  # not a URL we can take apart: hide everything between scheme and host
        return re.sub(r"//[^@/]*@", f"//{MASK}@", url)
    out = url
    if password is not None:
        userinfo, _, hostport = parts.netloc.rpartition("@")
        user = userinfo.partition(":")[0]
        out = out.replace("//" + parts.netloc, f"//{user}:{MASK}@{hostport}", 1)
    if parts.query:
        pairs = parse_qsl(parts.query, keep_blank_values=True)
        if any(k.lower() in _SECRET_QUERY for k, _ in pairs):
            query = urlencode([(k, MASK if k.lower() in _SECRET_QUERY else v) for k, v in pairs], safe="*/")
            head, _, _ = out.partition("?")
            out = f"{head}?{query}" + (f"#{parts.fragment}" if parts.fragment else "")
    return out


def url_secrets(url: str) -> list[str]:
    """The secret values a URL carries (raw and percent-decoded), for a Scrubber."""
    out: list[str] = []
    try:
        parts = urlsplit(url)
        if parts.password:
            raw = parts.netloc.rpartition("@")[0].partition(":")[2]
            out += [raw, unquote(raw)]
        for k, v in parse_qsl(parts.query, keep_blank_values=True):
            if k.lower() in _SECRET_QUERY and v:
                out.append(v)
        raw_query = parts.query
        for piece in raw_query.split("&"):
            k, _, v = piece.partition("=")
            if unquote(k).lower() in _SECRET_QUERY and v:
                out.append(v)
    except ValueError:
        pass
    return out


class Scrubber:
    """Replaces every known secret value in text (str or bytes) with MASK."""

    def __init__(self, secrets: Iterable[str]) -> None:
        # Longest first, so a secret that contains another is hidden whole.
        self.secrets = sorted({s for s in secrets if s and len(s) >= MIN_SCRUB_LEN}, key=len, reverse=True)
        self._bytes = [s.encode() for s in self.secrets]

    @classmethod
    def for_config(cls, config: Any) -> Scrubber:
        """The secrets of a `batchfleet.config.Config`: the server API key, the Redis password and the
        API keys of `batchfleet serve`."""
        secrets = [getattr(config, "server_api_key", "") or "", *url_secrets(getattr(config, "redis_url", "")),
                   *(getattr(config, "api_keys", ()) or ())]  # `batchfleet serve`'s bearer keys
        secrets += argv_secrets(shlex.split(getattr(config, "server_args", "") or ""))
        return cls(secrets)

    def __bool__(self) -> bool:
        return bool(self.secrets)

    def __call__(self, text: str) -> str:
        for s in self.secrets:
            if s in text:
                text = text.replace(s, MASK)
        return text

    def bytes(self, data: bytes) -> bytes:
        for s in self._bytes:
            if s in data:
                data = data.replace(s, MASK.encode())
        return data


class _ScrubFilter(logging.Filter):
    def __init__(self, scrub: Scrubber) -> None:
        super().__init__()
        self.scrub = scrub

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a broken format string: leave it to the handler's own error path
            return True
        clean = self.scrub(message)
        if clean != message:
            record.msg, record.args = clean, None
        if record.exc_info and not record.exc_text:
            record.exc_text = self.scrub(logging.Formatter().formatException(record.exc_info))
        elif record.exc_text:
            record.exc_text = self.scrub(record.exc_text)
        return True


LOGGERS = ("", "rq", "rq.worker", "rq.job", "batchfleet")


def install_log_scrubbing(scrub: Scrubber, loggers: Iterable[str] = LOGGERS) -> None:
    """Put a scrubbing filter on every handler of these loggers (idempotent per handler), so no log
    line this process writes carries a known secret, whoever formatted it (RQ, redis-py, ours)."""
    if not scrub:
        return
    for name in loggers:
        for handler in logging.getLogger(name).handlers:
            if not any(isinstance(f, _ScrubFilter) for f in handler.filters):
                handler.addFilter(_ScrubFilter(scrub))


def private_dir(path: Path) -> Path:
    """Create `path` (and missing parents) with mode 0700; an existing directory is left as it is
    (the operator chose it). Returns `path`."""
    path = Path(path)
    missing = []
    p = path
    while not p.exists():
        missing.append(p)
        if p.parent == p:
            break
        p = p.parent
    for d in reversed(missing):
        try:
            d.mkdir(mode=0o700)
        except FileExistsError:
            continue
        os.chmod(d, 0o700)  # mkdir's mode is filtered by the umask; 0700 is never looser than it
    return path


def private_dir_problem(path: Path) -> str | None:
    """`private_dir(path)`, then a check that this process can write in it: None, or why not in the
    operating system's words (for a one-line error naming the setting)."""
    try:
        private_dir(path)
        if not os.access(path, os.W_OK | os.X_OK):
            raise PermissionError(13, "Permission denied")
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def private_file(path: Path, mode: str = "ab") -> IO[Any]:
    """Open `path` for writing, created 0600; an existing file of ours is tightened to 0600."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if "a" in mode else os.O_TRUNC)
    fd = os.open(path, flags, 0o600)
    try:
        os.fchmod(fd, 0o600)
        return os.fdopen(fd, mode)
    except BaseException:
        os.close(fd)
        raise
