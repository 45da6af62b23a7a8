"""A sink's overflow on local disk: envelopes its buffer cannot hold, kept in order until the sink takes
them again (`app.runtime.events`), and found again by the next process when this one died first.

A spill is a directory of append-only segment files (`events-000001.jsonl`, ...), one envelope per line
as `Envelope.to_dict()` JSON, and of backup copies (`backup-000001.jsonl`, ...) of what its owner still
holds in memory (`back_up`), which only `recover` reads. The copies are written, and removed, in the
order they were asked for, by a thread of the spill's own (`backed_up` waits for it); a copy file whose
envelopes the owner has written is removed (`forget_backups`). `append` writes at the end of the newest
segment and flushes it to the operating system at once (a kill -9 of the process keeps what was
appended; a power cut may not);
`read` takes envelopes from the front, in the order they were appended; a segment read to its end is
removed, and a spill read to its end is removed whole (`clear`).

Invariants:
- envelopes come back from `read` exactly once each, in the order `append` was given them;
- the files never hold more than `max_bytes` in all: an append that would pass it raises
  `SpillFullError` and writes nothing; an append the disk refuses (`OSError`) writes nothing either;
- `recover(directory)` reads what a dead process left, by sequence number, each seq once; a last line
  cut short by the death (or a corrupt one) is skipped and counted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from app.core.events import Envelope, envelope_from_dict

log = logging.getLogger(__name__)

SEGMENT_BYTES = 64 * 1024 * 1024  # a segment read to its end is removed: disk use falls as it drains
# A backup file takes copies until it holds this much; one whose copies the sink has written is removed
BACKUP_FILE_BYTES = 4 * 1024 * 1024
BACKUP_WAIT_S = 10.0  # the most a caller waits for the backup thread (a disk that hangs)
# `SpillFile.taking`: a spill within this share of its bound takes no more, as far as a run should count
# on it; a disk is probed (`PROBE_BYTES` written and removed) at most every `PROBE_S`
HEADROOM_SHARE = 0.1
PROBE_BYTES = 1 << 20
PROBE_S = 2.0
_SUFFIX = ".jsonl"
_to_json = json.JSONEncoder(allow_nan=False, separators=(",", ":")).encode


class SpillFullError(OSError):
    """The spill holds `max_bytes` already: the envelopes were not written."""


_FIELDS: dict[type, tuple[str, ...]] = {}


def encode(envelopes: Sequence[Envelope]) -> bytes:
    """One JSON line per envelope, `Envelope.to_dict()`'s (the field names looked up once per event
    class); a non-finite number raises `ValueError`."""
    lines = []
    for env in envelopes:
        ev = env.event
        names = _FIELDS.get(type(ev))
        if names is None:
            names = _FIELDS[type(ev)] = tuple(f.name for f in dataclasses.fields(ev))
        body: dict[str, Any] = {"run_id": env.run_id, "seq": env.seq, "t": env.t, "kind": ev.kind}
        for name in names:
            value = getattr(ev, name)
            body[name] = list(value) if isinstance(value, tuple) else value
        lines.append(_to_json(body))
    lines.append("")
    return "\n".join(lines).encode()


class SpillFile:
    """One sink's spill in `directory` (made on the first append), at most `max_bytes` on disk."""

    def __init__(
        self,
        directory: Path,
        max_bytes: int,
        segment_bytes: int = SEGMENT_BYTES,
        backup_file_bytes: int = BACKUP_FILE_BYTES,
    ) -> None:
        if max_bytes < 1 or segment_bytes < 1 or backup_file_bytes < 1:
            raise ValueError(f"spill {directory}: need max_bytes, segment_bytes and backup_file_bytes ≥ 1")
        self.directory = directory
        self.max_bytes = max_bytes
        self.segment_bytes = segment_bytes
        self.backup_file_bytes = backup_file_bytes
        self.unread = 0  # envelopes appended and not yet read back
        self.bytes = 0  # what the segment files hold now
        self._segments: list[tuple[Path, int]] = []  # (path, its size), oldest first
        self._next_index = 1
        self._writer: IO[bytes] | None = None
        self._reader: IO[bytes] | None = None  # on _segments[0]
        self._dir_lock = threading.Lock()  # the directory is made and removed by two threads
        # The backup thread's: what `back_up` wrote, and its files (path, size, last seq), oldest first
        self.backup_bytes = 0
        self._backups = 0
        self._backup_files: list[tuple[Path, int, int]] = []
        self._backup_writer: IO[bytes] | None = None
        self._backup_cond = threading.Condition()
        self._backup_queue: deque[tuple[str, Any]] = deque()  # its work, in order: write, forget, drop
        self._backup_running = False
        # When the disk last refused a write (monotonic), None once a write (or a probe) went through
        self.refused_at: float | None = None
        self._probed_at = float("-inf")

    @property
    def disk_bytes(self) -> int:
        """The spill's segments and its backup copies: what it holds on disk now."""
        return self.bytes + self.backup_bytes

    def append(self, envelopes: Sequence[Envelope]) -> int:
        """Write `envelopes` at the end, all or none; returns the bytes written. Raises `SpillFullError`
        past `max_bytes`, `OSError` when the disk refuses, `ValueError` for a non-finite number."""
        data = encode(envelopes)
        if self.disk_bytes + len(data) > self.max_bytes:
            raise SpillFullError(
                f"spill {self.directory} holds {self.disk_bytes:,} bytes of {self.max_bytes:,}"
            )
        if self._writer is None or self._segments[-1][1] >= self.segment_bytes:
            try:
                self._open_segment()
            except OSError:
                self.refused_at = time.monotonic()
                raise
        assert self._writer is not None
        path, size = self._segments[-1]
        try:
            self._writer.write(data)
            self._writer.flush()
        except OSError:
            self._writer.close()
            self._writer = None
            with open(path, "r+b") as f:  # what a full disk took in part would be read back cut short
                f.truncate(size)
            self.refused_at = time.monotonic()
            raise
        self.refused_at = None
        self._segments[-1] = (path, size + len(data))
        self.bytes += len(data)
        self.unread += len(envelopes)
        return len(data)

    def _open_segment(self) -> None:
        if self._writer is not None:
            self._writer.close()
        if self._next_index == 1:  # after any a dead process left here: those are not ours to read
            found = [int(p.stem.split("-")[1]) for p in segments(self.directory)]
            self._next_index = 1 + max(found, default=0)
        path = self.directory / f"events-{self._next_index:06d}{_SUFFIX}"
        self._next_index += 1
        with self._dir_lock:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._writer = open(path, "ab")  # noqa: SIM115 - held open across appends, closed by close()
        self._segments.append((path, 0))

    def read(self, n: int) -> list[Envelope]:
        """Up to `n` envelopes from the front, in the order they were appended."""
        out: list[Envelope] = []
        while len(out) < n and self.unread:
            if self._reader is None:
                self._reader = open(self._segments[0][0], "rb")  # noqa: SIM115 - closed below
            line = self._reader.readline()
            if not line:  # this segment is read to its end, and a newer one holds the rest
                if len(self._segments) == 1:
                    raise OSError(f"spill {self.directory}: {self.unread} envelopes missing from its file")
                self._reader.close()
                self._reader = None
                path, size = self._segments.pop(0)
                path.unlink(missing_ok=True)
                self.bytes -= size
                continue
            out.append(envelope_from_dict(json.loads(line)))
            self.unread -= 1
        if not self.unread:
            self.clear()
        return out

    def taking(self, now: float | None = None) -> bool:
        """Whether the spill can take envelopes, as far as a run should count on it: not within
        `HEADROOM_SHARE` of its bound, and its disk took the last write. The disk is probed (`PROBE_BYTES`
        written beside the segments, then removed) at most every `PROBE_S`, so a disk that filled since
        the last write, or was freed, is seen without an envelope at stake."""
        if self.disk_bytes >= self.max_bytes * (1 - HEADROOM_SHARE):
            return False
        now = time.monotonic() if now is None else now
        if now - self._probed_at >= PROBE_S:
            self._probed_at = now
            self._probe(now)
        return self.refused_at is None

    def _probe(self, now: float) -> None:
        probe = self.directory / "probe.tmp"
        try:
            with self._dir_lock:
                self.directory.mkdir(parents=True, exist_ok=True)
            try:
                with open(probe, "wb") as f:
                    f.write(bytes(min(PROBE_BYTES, self.max_bytes)))
                    f.flush()
                    os.fsync(f.fileno())  # a file system that takes pages it cannot keep refuses here
            finally:
                probe.unlink(missing_ok=True)
        except OSError:
            self.refused_at = now
        else:
            self.refused_at = None
        with self._dir_lock, contextlib.suppress(OSError):
            if not self._segments and not self._backup_files:
                self.directory.rmdir()  # an empty spill leaves no directory behind

    def back_up(self, envelopes: Sequence[Envelope]) -> None:
        """Queue a copy of `envelopes` (in seq order, after those queued before) for the backup thread,
        which appends it to the backup files beside the segments, for `recover` after a crash (`read`
        never returns them: they are still in the caller's memory). Within `max_bytes`, or not at all
        (logged). Returns at once: `backed_up` waits for the copy to be on disk."""
        if envelopes:
            self._queue_backup("write", list(envelopes))

    def forget_backups(self, written_seq: int) -> None:
        """Remove, on the backup thread, the backup files whose envelopes are all at or before
        `written_seq`: the sink has them, they need no copy."""
        self._queue_backup("forget", written_seq)

    def drop_backups(self) -> None:
        """Remove every backup file, on the backup thread (after what was queued before)."""
        with self._backup_cond:
            if not self._backup_running and not self._backup_files:
                return  # none: no thread to start
        self._queue_backup("drop", None)

    def backed_up(self, timeout_s: float = BACKUP_WAIT_S) -> bool:
        """Wait until what was queued is on disk (or failed, logged); False after `timeout_s`."""
        with self._backup_cond:
            return self._backup_cond.wait_for(lambda: not self._backup_running, timeout_s)

    def _queue_backup(self, what: str, arg: Any) -> None:
        with self._backup_cond:
            self._backup_queue.append((what, arg))
            if not self._backup_running:  # a thread runs while there is work queued, then ends
                self._backup_running = True
                threading.Thread(target=self._run_backups, name="spill-backup", daemon=True).start()

    def _run_backups(self) -> None:
        while True:
            with self._backup_cond:
                if not self._backup_queue:
                    if self._backup_writer is not None:
                        self._backup_writer.close()
                        self._backup_writer = None
                    self._backup_running = False
                    self._backup_cond.notify_all()
                    return
                what, arg = self._backup_queue.popleft()
            if what == "write":
                self._write_backup(arg)
                continue
            try:
                self._remove_backups(float("inf") if what == "drop" else arg)
            except OSError as exc:  # left on disk: the next start stores them again, which adds nothing
                log.warning("spill %s: backup copies not removed: %r", self.directory, exc)

    def _write_backup(self, envelopes: list[Envelope]) -> None:
        """Append `envelopes` to the newest backup file (a new one once it holds `backup_file_bytes`)."""
        try:
            data = encode(envelopes)
            if self.disk_bytes + len(data) > self.max_bytes:
                raise SpillFullError(f"{len(data):,} bytes would pass the spill's {self.max_bytes:,}")
            if not self._backup_files or self._backup_files[-1][1] >= self.backup_file_bytes:
                if self._backup_writer is not None:
                    self._backup_writer.close()
                    self._backup_writer = None
                self._backups += 1
                self._backup_files.append((self.directory / f"backup-{self._backups:06d}{_SUFFIX}", 0, -1))
            path, size, _ = self._backup_files[-1]
            if self._backup_writer is None:
                with self._dir_lock:
                    self.directory.mkdir(parents=True, exist_ok=True)
                    self._backup_writer = open(path, "ab")  # noqa: SIM115 - closed as its thread ends
            self._backup_writer.write(data)
            self._backup_writer.flush()
            self._backup_files[-1] = (path, size + len(data), envelopes[-1].seq)
            self.backup_bytes += len(data)
            self.refused_at = None
        except (OSError, ValueError) as exc:  # they are still in memory: only a crash would lose them
            if isinstance(exc, OSError):
                self.refused_at = time.monotonic()
            log.error("spill %s: no copy of %d buffered envelopes on disk: %r", self.directory,
                      len(envelopes), exc)  # fmt: skip

    def _remove_backups(self, written_seq: float) -> None:
        files = self._backup_files  # in seq order
        while files and files[0][2] <= written_seq:
            path, size, _ = files[0]
            if len(files) == 1 and self._backup_writer is not None:
                self._backup_writer.close()
                self._backup_writer = None
            if size:  # one never written to may have no directory to be in
                path.unlink(missing_ok=True)
            files.pop(0)
            self.backup_bytes -= size
        if not files:
            with self._dir_lock, contextlib.suppress(OSError):
                self.directory.rmdir()  # when the segments are gone too

    def clear(self) -> None:
        """Remove every segment and copy (what was unread is gone): the spill starts again empty. The
        copies go on the backup thread, after what was queued for it."""
        self.close(wait_s=0)
        for path, _ in self._segments:
            path.unlink(missing_ok=True)
        self._segments.clear()
        self.bytes = self.unread = 0
        with self._dir_lock, contextlib.suppress(OSError):
            self.directory.rmdir()  # at once when it holds no copies
        self.drop_backups()

    def close(self, wait_s: float = BACKUP_WAIT_S) -> None:
        """Close the files and keep them: a process that cannot drain them leaves them for the next.
        Waits up to `wait_s` for the copies queued for the backup thread."""
        for f in (self._writer, self._reader):
            if f is not None:
                f.close()
        self._writer = self._reader = None
        if wait_s > 0:
            self.backed_up(wait_s)


@dataclass
class Recovered:
    """What a dead process's spill held: its envelopes by seq, each once, and the lines skipped."""

    envelopes: list[Envelope]
    bad_lines: int
    bytes: int


def segments(directory: Path) -> list[Path]:
    """The segment files in `directory`, oldest first (none for a directory that is not there)."""
    return sorted(directory.glob(f"events-[0-9]*{_SUFFIX}"))


def files(directory: Path) -> list[Path]:
    """The segments and backup copies in `directory`: what `recover` reads."""
    return segments(directory) + sorted(directory.glob(f"backup-[0-9]*{_SUFFIX}"))


def recover(directory: Path) -> Recovered:
    """Read every segment and copy a spill left in `directory` (removes nothing)."""
    by_seq: dict[tuple[str, int], Envelope] = {}
    bad = size = 0
    for path in files(directory):
        data = path.read_bytes()
        size += len(data)
        for line in data.splitlines():
            try:
                env = envelope_from_dict(json.loads(line))
            except (ValueError, KeyError, TypeError):
                bad += 1
                continue
            by_seq.setdefault((env.run_id, env.seq), env)
    if bad:
        log.warning("spill %s: %d lines could not be read (cut short by a crash?) and are skipped",
                    directory, bad)  # fmt: skip
    return Recovered([by_seq[k] for k in sorted(by_seq)], bad, size)


def remove(directory: Path) -> None:
    """Remove a spill directory that has been recovered."""
    for path in files(directory):
        path.unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        os.rmdir(directory)
