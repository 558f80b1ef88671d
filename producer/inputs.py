"""Input and output files by suffix: `.jsonl`, `.jsonl.gz` (stdlib gzip), `.jsonl.zst` (the
`zstandard` package: `pip install 'batchfleet[zstd]'`), and for export only `.parquet` (pyarrow:
`pip install 'batchfleet[parquet]'`). A missing optional package is a message naming the extra,
never an ImportError.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import os
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

__all__ = ["MissingExtra", "compression_of", "input_problem", "open_input", "open_output"]


class MissingExtra(Exception):
    """An optional package a suffix needs is not installed; the message says how to install it."""


def compression_of(path: Path | str) -> str:
    """'gz', 'zst', 'parquet' or '' (plain) from the file name."""
    name = str(path).lower()
    for suffix in ("gz", "zst", "parquet"):
        if name.endswith("." + suffix):
            return suffix
    return ""


def _zstandard() -> Any:
    try:
        import zstandard
    except ImportError:
        raise MissingExtra("reading or writing .zst needs the zstandard package: "
                           "pip install 'batchfleet[zstd]' (or pip install zstandard)") from None
    return zstandard


def input_problem(path: Path | str) -> str | None:
    """Why `path` cannot be read as an input file, or None ('-' is stdin: fine)."""
    if str(path) == "-":
        return None
    p = Path(path)
    if p.is_dir():
        return f"{p}: is a directory, not a JSONL file"
    if not p.exists():
        return f"{p}: no such file"
    if not os.access(p, os.R_OK):
        return f"{p}: not readable (permission denied)"
    if compression_of(p) == "parquet":
        return f"{p}: parquet is an export format; input is JSONL (.jsonl, .jsonl.gz, .jsonl.zst)"
    return None


def open_input(path: Path | str) -> IO[bytes]:
    """A binary reader of the decompressed lines."""
    kind = compression_of(path)
    if kind == "gz":
        return gzip.open(path, "rb")
    if kind == "zst":
        zstd = _zstandard()
        # the stream reader reads blocks only: a buffered reader on top gives lines
        reader = zstd.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True)  # noqa: SIM115
        return io.BufferedReader(reader)
    return open(path, "rb")


@contextlib.contextmanager
def open_output(fd: int, path: Path | str) -> Iterator[IO[bytes]]:
    """A binary writer on the open file descriptor `fd` (closed on exit, after an fsync) that
    compresses as `path`'s suffix says (parquet is written by producer.export)."""
    kind = compression_of(path)
    with os.fdopen(fd, "wb") as raw:
        if kind == "gz":
            with gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as gz:
                yield gz  # type: ignore[misc]
        elif kind == "zst":
            with _zstandard().ZstdCompressor().stream_writer(raw, closefd=False) as zst:
                yield zst
        else:
            yield raw
        raw.flush()
        os.fsync(raw.fileno())
