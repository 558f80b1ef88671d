"""Input and output files by suffix: `.jsonl`, `.jsonl.gz` (stdlib gzip), `.jsonl.zst` (the
`zstandard` package: `pip install 'batchfleet[zstd]'`), and for export only `.parquet` (pyarrow:
`pip install 'batchfleet[parquet]'`). A missing optional package is a message naming the extra,
never an ImportError.

`Lines` reads an input as enqueue does: a UTF-8 byte order mark at its start is dropped (editors on
Windows write one), CRLF line ends are whitespace to JSON, and a line longer than any request may be
(`MAX_LINE_BYTES`) is never held whole: its first bytes and its length are enough to reject it.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from batchfleet.prompts import MAX_BODY_BYTES

__all__ = ["MAX_LINE_BYTES", "Lines", "MissingExtra", "compression_of", "input_problem", "open_input", "open_output"]

BOM = b"\xef\xbb\xbf"
MAX_LINE_BYTES = MAX_BODY_BYTES + 64 * 1024  # a request's body and its envelope: a longer line is no request
_SKIP = 1 << 20  # the rest of a too-long line is read and dropped this much at a time


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


class Lines:
    """The lines of an input file (`-`: stdin) as (line number, bytes, length in bytes). The bytes are
    the whole line, or its first MAX_LINE_BYTES when it is longer (then length > len(bytes))."""

    def __init__(self, path: str) -> None:
        self.name = "stdin" if path == "-" else path
        self.path = "stdin" if path == "-" else str(Path(path).absolute())
        plain = path != "-" and Path(path).is_file() and not compression_of(path)
        self.size = Path(path).stat().st_size if plain else None  # a compressed file's size is not the bytes read
        self.fh: IO[bytes] = sys.stdin.buffer if path == "-" else open_input(path)
        self.nbytes = 0  # read so far
        self._lineno = 0
        self._peeked: list[tuple[int, bytes, int]] = []

    def _read(self) -> tuple[int, bytes, int] | None:
        raw = self.fh.readline(MAX_LINE_BYTES)
        if not raw:
            return None
        length = len(raw)
        if length == MAX_LINE_BYTES and not raw.endswith(b"\n"):
            while more := self.fh.readline(_SKIP):
                length += len(more)
                if more.endswith(b"\n"):
                    break
        self.nbytes += length
        self._lineno += 1
        if self._lineno == 1 and raw.startswith(BOM):
            raw, length = raw[len(BOM):], length - len(BOM)
        return self._lineno, raw, length

    def has_prompt_line(self) -> bool:
        """Is there a line that is not blank? Reads up to it; those lines are still iterated."""
        while (line := self._read()) is not None:
            self._peeked.append(line)
            if line[1].strip():
                return True
        return False

    def __iter__(self) -> Iterator[tuple[int, bytes, int]]:
        while self._peeked:
            yield self._peeked.pop(0)
        while (line := self._read()) is not None:
            yield line

    def close(self) -> None:
        if self.fh is not sys.stdin.buffer:
            self.fh.close()

    def __enter__(self) -> Lines:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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
