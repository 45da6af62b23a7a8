"""Reading a user's YAML or JSON file (a run config, a workload, a task's task.yaml) into plain data.

Invariant: whatever is wrong with the file (missing, unreadable, larger than `MAX_DOCUMENT_BYTES` or
endless, not UTF-8, not valid YAML or JSON, a key given twice in one mapping, a value Python cannot
hold, nesting too deep to parse), the refusal is one line that names the file, never a traceback, and
comes before the file fills memory. What the data must look like is the caller's to check.
"""

from __future__ import annotations

import io
import json
import os
import re
import select
import stat
import sys
from pathlib import Path
from typing import BinaryIO

import yaml

from app.validation import MAX_DOCUMENT_BYTES, human_bytes


class DocumentError(ValueError):
    """The file cannot be read or parsed; the message is one line naming it."""


class TooLarge(ValueError):
    """The file holds more than the bytes its reader takes (`read_text_at_most`)."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"larger than {human_bytes(limit)}")
        self.limit = limit


def read_text_at_most(path: Path, limit: int) -> str:
    """The whole of `path` as UTF-8 text (a leading byte-order mark, which some Windows editors write,
    dropped), reading at most `limit` bytes of it: a larger file, or an endless one (/dev/zero, a pipe
    that never ends), raises `TooLarge` before it fills memory. Raises OSError and UnicodeDecodeError
    as `Path.read_text` does."""
    with open_input(path) as f:
        check_size(f, limit)
        data = f.read(limit + 1)
    if len(data) > limit:
        raise TooLarge(limit)
    return data.decode("utf-8-sig")


# How long a read of a pipe or device waits before it looks again whether a signal came.
POLL_S = 0.2


class _PolledReader(io.RawIOBase):
    """A pipe or character device read with `select` in slices of `POLL_S`. A Ctrl-C that lands
    after the interpreter last looked for signals but before a plain `read(2)` began is noted by
    Python's handler and then never acted on, since that read is not interrupted: `corral sim
    --workload <(slow)` then ignored the Ctrl-C until the writer wrote. Here the wait ends within
    `POLL_S`, and the interpreter raises the pending KeyboardInterrupt."""

    def __init__(self, fd: int) -> None:
        super().__init__()
        self._fd = fd

    def readable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._fd

    def readinto(self, buffer: bytearray | memoryview) -> int:  # type: ignore[override]
        while True:
            ready, _, _ = select.select([self._fd], [], [], POLL_S)
            if not ready:
                continue
            try:
                data = os.read(self._fd, len(buffer))
            except BlockingIOError:  # another reader of the same pipe took what was there
                continue
            buffer[: len(data)] = data
            return len(data)

    def close(self) -> None:
        if not self.closed:
            os.close(self._fd)
        super().close()


def open_input(path: Path) -> BinaryIO:
    """`path` opened to read as bytes. A pipe (`<(generate)`, a named FIFO) or a character device is
    opened without blocking and read through `_PolledReader`, so a Ctrl-C ends the wait for a writer
    or for data however it lands; a regular file is opened as usual. Raises OSError as `open` does."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        mode = 0  # let open() say why
    if not (stat.S_ISFIFO(mode) or stat.S_ISCHR(mode)):
        return path.open("rb")
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    return io.BufferedReader(_PolledReader(fd))


def check_size(f: BinaryIO, limit: int) -> None:
    """Raise `TooLarge` for an open regular file of more than `limit` bytes, before reading any."""
    status = os.fstat(f.fileno())
    if stat.S_ISREG(status.st_mode) and status.st_size > limit:
        raise TooLarge(limit)


class _DuplicateKey(ValueError):
    pass


class _BadValue(ValueError):
    pass


def _too_long(exc: ValueError) -> bool:
    """Python's refusal to read an integer of more than `sys.get_int_max_str_digits()` digits."""
    return "integer string conversion" in str(exc)


class _StrictLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (PyYAML keeps the last one, so a
    typo'd second `lanes:` silently replaced the first), and naming the line of a value its tag cannot
    build (a date 2025-13-45, `!!int x`, an integer too long for Python) instead of raising from it."""

    def construct_object(self, node: yaml.Node, deep: bool = False) -> object:
        try:
            return super().construct_object(node, deep=deep)
        except (_DuplicateKey, _BadValue):
            raise
        except (ValueError, TypeError, AttributeError, OverflowError) as exc:
            kind = node.tag.rsplit(":", 1)[-1]
            what = f"a {kind}"
            if isinstance(node, yaml.ScalarNode):
                shown = str(node.value)
                what = repr(shown if len(shown) <= 40 else shown[:37] + "...")
            why = ""
            if isinstance(exc, ValueError):
                why = f" (more than {sys.get_int_max_str_digits()} digits)" if _too_long(exc) else f" ({exc})"
            line = node.start_mark.line + 1
            raise _BadValue(f"line {line}: {what} is not a valid {kind}{why}") from None

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[object, object]:
        # The mapping's own scalar keys, by resolved tag and text (so 1 and "1" differ), before merge
        # keys (`<<: *anchor`) bring in pairs that the mapping's own keys may override.
        seen: set[tuple[str, str]] = set()
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = (key_node.tag, key_node.value)
            if key in seen:
                line = key_node.start_mark.line + 1
                raise _DuplicateKey(f"{key_node.value!r} is given twice in one mapping (line {line})")
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


# YAML 1.1, which PyYAML reads, takes `1e3` and `1.0e308` for strings (its floats need a dot and a signed
# exponent): `step_s: 1e3` was refused as "not a valid number". JSON and YAML 1.2 read them as numbers.
_StrictLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def _json_pairs(pairs: list[tuple[str, object]]) -> dict[str, object]:
    obj: dict[str, object] = {}
    for key, value in pairs:
        if key in obj:
            raise _DuplicateKey(f"{key!r} is given twice in one object")
        obj[key] = value
    return obj


def read_document(path: Path, what: str, json_suffix: bool = False) -> object:
    """Parse `path` as YAML (as JSON when `json_suffix` and its name ends in .json). `what` names the
    file in refusals, e.g. "workload w.yaml"."""
    try:
        text = read_text_at_most(path, MAX_DOCUMENT_BYTES)
    except UnicodeDecodeError as exc:
        raise DocumentError(f"{what} is not UTF-8 text (byte {exc.start})") from None
    except TooLarge as exc:
        raise DocumentError(f"{what} is {exc}; is it the right file?") from None
    except OSError as exc:
        raise DocumentError(f"cannot read {what}: {exc.strerror or exc}") from None
    as_json = json_suffix and path.suffix == ".json"
    try:
        return json.loads(text, object_pairs_hook=_json_pairs) if as_json else yaml.load(text, _StrictLoader)
    except (_DuplicateKey, _BadValue) as exc:
        raise DocumentError(f"{what}: {exc}") from None
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        detail = " ".join(str(exc).split())
        raise DocumentError(f"{what} is not valid {'JSON' if as_json else 'YAML'}: {detail}") from None
    except RecursionError:
        raise DocumentError(f"{what}: nested too deeply to read") from None
    except ValueError as exc:  # JSON: an integer longer than Python reads
        if not _too_long(exc):
            raise
        digits = sys.get_int_max_str_digits()
        raise DocumentError(f"{what}: a number has more than {digits} digits") from None
