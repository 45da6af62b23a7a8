"""Pull a shell command, or an end-of-episode marker, out of a model's free text.

Recognised forms, first match wins:
1. a fenced block tagged bash/sh/shell/console (or untagged): its body is the command;
2. a `<cmd>...</cmd>` tag: its body;
3. a line starting with `$ `: the rest of that line.

A done marker is a line that is exactly `DONE` or `# done` (any case), or a `<done/>` tag anywhere.
`parse_command` never returns a done marker as a command: text that holds only a done marker yields
None, and `is_done` tells the caller the episode is over. Both functions are pure.
"""

from __future__ import annotations

import re

_FENCE = re.compile(r"```[ \t]*(bash|sh|shell|console|zsh)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
_CMD_TAG = re.compile(r"<cmd>(.*?)</cmd>", re.DOTALL | re.IGNORECASE)
_DOLLAR = re.compile(r"^[ \t]*\$ (.+)$", re.MULTILINE)
_DONE_TAG = re.compile(r"<done\s*/>", re.IGNORECASE)
_DONE_LINES = frozenset({"done", "# done"})


def is_done(text: str) -> bool:
    """True when `text` (model output or a chosen candidate) says the episode is over."""
    if _DONE_TAG.search(text):
        return True
    return any(line.strip().lower() in _DONE_LINES for line in text.splitlines())


def parse_command(text: str) -> str | None:
    """The shell command in `text`, or None when it holds none (or only a done marker)."""
    command: str | None = None
    fence = _FENCE.search(text)
    tag = _CMD_TAG.search(text)
    dollar = _DOLLAR.search(text)
    if fence is not None:
        body = fence.group(2)
        # A console transcript inside a fence: keep only the prompted lines.
        prompted = [m.group(1) for m in _DOLLAR.finditer(body)]
        command = "\n".join(prompted) if prompted and fence.group(1) == "console" else body
    elif tag is not None:
        command = tag.group(1)
    elif dollar is not None:
        command = dollar.group(1)
    if command is None:
        return None
    command = command.strip()
    if _only_done(command):
        return None
    return command


def _only_done(command: str) -> bool:
    """True for a command that is blank or nothing but done markers."""
    rest = _DONE_TAG.sub("", command)
    return all(not line.strip() or line.strip().lower() in _DONE_LINES for line in rest.splitlines())
