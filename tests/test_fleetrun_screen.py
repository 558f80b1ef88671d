"""What `batchfleet run` leaves on a terminal: the real command in a pseudo-terminal (a private
redis-server, real workers on simulated GPUs), its output played into a small terminal model, and the
screen read at the end, after a Ctrl-C and after the export."""

from __future__ import annotations

import contextlib
import fcntl
import os
import pty
import re
import signal
import struct
import subprocess
import termios
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from producer.store import Store

from .fleet import write_prompts
from .test_fleetrun import BIN, check_export, run_env

pytestmark = pytest.mark.slow

BAR = "━"  # what rich draws a bar with; the plain progress line is `[####....]`
WIDTH = 160
_CSI = re.compile(r"\x1b\[([?0-9;]*)([A-Za-z])")


class Screen:
    """Just enough of a VT100 for what rich writes: text, CR, LF, cursor up/down, erase in line."""

    def __init__(self) -> None:
        self.rows: list[list[str]] = [[]]
        self.row = self.col = 0

    def feed(self, data: str) -> None:
        i = 0
        while i < len(data):
            ch = data[i]
            if ch == "\x1b":
                m = _CSI.match(data, i)
                if m is None:  # another kind of escape (none expected): skip the ESC alone
                    i += 1
                    continue
                args, cmd = m.groups()
                n = int(args) if args.isdigit() else 1
                if cmd == "A":
                    self.row = max(0, self.row - n)
                elif cmd == "B":
                    self.row += n
                elif cmd == "G":
                    self.col = n - 1
                elif cmd == "K":
                    self._line()[:] = [] if args == "2" else self._line()[:self.col]
                i = m.end()
                continue
            if ch == "\r":
                self.col = 0
            elif ch == "\n":
                self.row += 1
            elif ch == "\b":
                self.col = max(0, self.col - 1)
            elif ch >= " ":
                line = self._line()
                line.extend(" " * (self.col - len(line) + 1))
                line[self.col] = ch
                self.col += 1
            i += 1

    def _line(self) -> list[str]:
        while len(self.rows) <= self.row:
            self.rows.append([])
        return self.rows[self.row]

    def lines(self) -> list[str]:
        out = ["".join(r).rstrip() for r in self.rows]
        while out and not out[-1]:
            out.pop()
        return out


class Terminal:
    """`batchfleet run` on a pseudo-terminal of WIDTH columns; everything it writes is kept."""

    def __init__(self, cwd: Path, env: dict[str, str]) -> None:
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, WIDTH, 0, 0))
        self.master = master
        self.data = bytearray()
        self.proc = subprocess.Popen(
            [str(BIN / "batchfleet"), "run", "prompts.jsonl", "-o", "results.jsonl", "--gpus", "0-1", "--dry-run"],
            cwd=cwd, env={**env, "TERM": "xterm-256color", "COLUMNS": str(WIDTH)},
            stdin=slave, stdout=slave, stderr=slave, start_new_session=True)
        os.close(slave)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        while True:
            try:
                chunk = os.read(self.master, 65536)
            except OSError:  # EIO: every writer of the terminal has gone
                return
            if not chunk:
                return
            self.data += chunk

    def text(self) -> str:
        return bytes(self.data).decode(errors="replace")

    def screen(self) -> list[str]:
        s = Screen()
        s.feed(self.text())
        return s.lines()

    def wait(self, timeout_s: float) -> int:
        code = self.proc.wait(timeout_s)
        self.reader.join(10)
        os.close(self.master)
        return code

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(60)
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)


@pytest.fixture
def terminals() -> Iterator[list[Terminal]]:
    started: list[Terminal] = []
    yield started
    for t in started:
        t.stop()


def after_enqueue(lines: list[str]) -> list[str]:
    """The screen from the enqueue's summary line on (enqueue's own bar above it is complete, not stale)."""
    i = next(i for i, line in enumerate(lines) if "already finished" in line)
    return lines[i:]


def test_the_terminal_keeps_no_stale_bar_and_one_throughput_figure_after_ctrl_c_and_after_the_export(
        tmp_path: Path, terminals: list[Terminal]) -> None:
    n = 240  # long enough (~15 s of serving) that the Ctrl-C lands mid-run under load
    rows = write_prompts(tmp_path / "prompts.jsonl", n, max_tokens=48)
    env = run_env(tmp_path, SGLANG_SIM_TIME_SCALE="2", BATCHFLEET_WINDOW_DEFAULT="30", BATCHFLEET_WINDOW_MAX="30")
    first = Terminal(tmp_path, env)
    terminals.append(first)
    store_path = tmp_path / ".batchfleet" / "prompts.sqlite"

    def done() -> int:
        if not store_path.exists():
            return 0
        store = Store.open(store_path, run="prompts", readonly=True)
        try:
            with store.read():
                c = store.counts()
            return c["succeeded"] + c["failed"]
        finally:
            store.close()

    deadline = time.monotonic() + 180
    while not (BAR in first.text() and done() >= 10):  # the bar is up and the run under way
        assert first.proc.poll() is None, first.text()
        assert time.monotonic() < deadline, first.text()
        time.sleep(0.2)
    first.proc.send_signal(signal.SIGINT)
    assert first.wait(120) == 130, first.text()
    screen = after_enqueue(first.screen())
    assert not [line for line in screen if BAR in line], "\n".join(screen)  # no bar under the later lines
    (last_progress,) = [line for line in screen if re.match(r"\[[#.]{20}\] ", line)]  # its last state, once
    assert screen.index(last_progress) < screen.index(next(x for x in screen if x.startswith("interrupted")))
    assert screen[-1].startswith("stopped: ") and re.search(r"; [\d,]+ tok/s over \d+m\d\ds ", screen[-1]), screen

    second = Terminal(tmp_path, env)
    terminals.append(second)
    assert second.wait(300) == 0, second.text()
    screen = after_enqueue(second.screen())
    assert not [line for line in screen if BAR in line], "\n".join(screen)
    assert screen[-1].startswith(f"wrote {n} lines to results.jsonl ({n} succeeded, 0 failed); "), screen
    (last_progress,) = [line for line in screen if re.match(r"\[[#.]{20}\] ", line)]
    assert f"] {n}/{n} (100%)  ETA 0m00s  " in last_progress
    # One throughput figure, named the same on the progress line and in the closing line.
    on_progress = re.search(r"  ([\d,]+) tok/s  workers ", last_progress)
    in_summary = re.search(r"; ([\d,]+) tok/s over \d+m\d\ds \(completion tokens per wall-clock second\)$",
                           screen[-1])
    assert on_progress and in_summary, screen
    assert on_progress.group(1) == in_summary.group(1) and int(on_progress.group(1).replace(",", "")) > 0
    check_export(tmp_path, rows)
