"""batchfleet.redact: the one place that hides secrets (pure; the e2e proof is tests/test_e2e_security.py)."""

from __future__ import annotations

import logging
import os
import stat

import pytest

from batchfleet.config import Config
from batchfleet.connection import redacted
from batchfleet.records import WorkerStatus
from batchfleet.redact import (
    MASK,
    Scrubber,
    install_log_scrubbing,
    private_dir,
    private_file,
    redact_argv,
    redact_url,
    url_secrets,
)


@pytest.mark.parametrize(("url", "shown"), [
    ("redis://:pw@h:1/0", "redis://:***@h:1/0"),
    ("rediss://user:pw@h:1/0", "rediss://user:***@h:1/0"),
    ("redis://h:1/0?password=pw", "redis://h:1/0?password=***"),
    ("redis://u@h:1/0?db=2&Password=pw&ssl_ca_certs=/etc/ca.pem", "redis://u@h:1/0?db=2&Password=***&ssl_ca_certs=/etc/ca.pem"),
    ("redis://:p%40ss@h:1/0", "redis://:***@h:1/0"),
    ("redis://h:1/0", "redis://h:1/0"),
    ("unix:///run/redis.sock?password=pw", "unix:///run/redis.sock?password=***"),
])
def test_redact_url_hides_the_password_in_userinfo_and_query(url: str, shown: str) -> None:
    assert redact_url(url) == shown == redacted(url)


def test_url_secrets_gives_raw_and_decoded_forms() -> None:
    assert {"p%40ss", "p@ss", "q!x", "q%21x"} <= set(url_secrets("redis://:p%40ss@h/0?password=q%21x"))


def test_redact_argv_hides_every_secret_flag_in_both_spellings() -> None:
    argv = ["python", "-m", "sglang", "--api-key", "K1", "--admin-api-key=K2", "--ssl-keyfile-password", "K3",
            "--tokenizer-path", "t", "--max-total-tokens", "9", "--ssl-keyfile", "/k.pem"]
    assert redact_argv(argv) == ["python", "-m", "sglang", "--api-key", MASK, "--admin-api-key=***",
                                 "--ssl-keyfile-password", MASK, "--tokenizer-path", "t", "--max-total-tokens", "9",
                                 "--ssl-keyfile", "/k.pem"]


def test_config_scrubber_and_repr_know_every_secret() -> None:
    config = Config(redis_url="redis://u:pw-in-url@h:1/0?password=pw-in-query", server_api_key="key-1234",
                    server_args="--admin-api-key=adminkey --tp-size 1")
    scrub = Scrubber.for_config(config)
    text = "key-1234 pw-in-url pw-in-query adminkey tp"
    assert scrub(text) == "*** *** *** *** tp"
    assert scrub.bytes(text.encode()) == b"*** *** *** *** tp"
    shown = repr(config)
    for secret in ("key-1234", "pw-in-url", "pw-in-query", "adminkey"):
        assert secret not in shown
    assert Scrubber(["abc"])("abc") == "abc"  # too short to hide in free text (only where its place is known)


def test_a_status_record_never_holds_the_api_key() -> None:
    status = WorkerStatus(worker="w", host="h", queue="gpu0", gpu=0, state="serving",
                          server_flags=["--port", "1", "--api-key", "secret-key"])
    assert status.server_flags == ["--port", "1", "--api-key", MASK]
    assert b"secret-key" not in status.to_json()
    legacy = b'{"worker":"w","host":"h","queue":"gpu0","gpu":0,"state":"serving","server_flags":["--api-key=k3y!"]}'
    assert WorkerStatus.from_json(legacy).server_flags == ["--api-key=***"]


def test_log_scrubbing_covers_messages_args_and_tracebacks(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("batchfleet.test_redact")
    handler = logging.StreamHandler()
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        install_log_scrubbing(Scrubber(["hunter22"]), loggers=[""])
        install_log_scrubbing(Scrubber(["hunter22"]), loggers=[""])  # idempotent
        assert sum(1 for f in handler.filters if type(f).__name__ == "_ScrubFilter") == 1
        record = logger.makeRecord("x", logging.ERROR, __file__, 1, "connect %s failed", ("redis://:hunter22@h",), None)
        try:
            raise RuntimeError("password hunter22 refused")
        except RuntimeError:
            import sys
            record.exc_info = sys.exc_info()
        handler.filter(record)
        assert "hunter22" not in handler.format(record)
        assert "***" in record.getMessage() and "***" in (record.exc_text or "")
    finally:
        root.removeHandler(handler)


def test_private_dir_and_file_modes_whatever_the_umask(tmp_path) -> None:
    old = os.umask(0o002)
    try:
        d = private_dir(tmp_path / "a" / "b")
        with private_file(d / "log", "ab") as f:
            f.write(b"x")
        loose = d / "loose"
        loose.write_bytes(b"")
        loose.chmod(0o644)
        with private_file(loose, "ab"):
            pass
    finally:
        os.umask(old)
    for p in (tmp_path / "a", d):
        assert stat.S_IMODE(p.stat().st_mode) == 0o700
    for p in (d / "log", loose):
        assert stat.S_IMODE(p.stat().st_mode) == 0o600


def test_the_shipped_acl_example_is_what_the_generator_writes() -> None:
    from pathlib import Path

    from batchfleet.acl import acl_file

    shipped = Path(__file__).resolve().parents[1] / "docs" / "batchfleet.acl"
    assert shipped.read_text() == acl_file(), "regenerate: python -m batchfleet.acl > docs/batchfleet.acl"
    lines = shipped.read_text().splitlines()
    assert lines[0].startswith("user default off")
    assert all(" off nopass " in line for line in lines[1:])  # no known password ships
