"""parse_command pulls one shell command out of model text; is_done spots the end marker."""

from __future__ import annotations

import pytest

from app.agent.parse import is_done, parse_command


@pytest.mark.parametrize(
    ("text", "command"),
    [
        ("Let me look.\n```bash\nls -la\n```\nthen more", "ls -la"),
        ("```sh\ncd src && make\n```", "cd src && make"),
        ("```\necho untagged\n```", "echo untagged"),
        ("```bash\nfor f in *; do\n  echo $f\ndone\n```", "for f in *; do\n  echo $f\ndone"),
        ("```console\n$ ls\nfile.txt\n$ cat file.txt\n```", "ls\ncat file.txt"),
        ("first\n```bash\necho one\n```\n```bash\necho two\n```", "echo one"),
        ("I will run <cmd>grep -n foo bar.py</cmd> now", "grep -n foo bar.py"),
        ("<CMD>\npwd\n</CMD>", "pwd"),
        ("Running:\n$ python3 check.py\n", "python3 check.py"),
        ("  $ wc -l access.log", "wc -l access.log"),
        ("```bash\necho fenced\n```\n$ echo dollar", "echo fenced"),
    ],
)
def test_extracts_command(text: str, command: str) -> None:
    assert parse_command(text) == command


@pytest.mark.parametrize(
    "text",
    [
        "",
        "I think the task is already complete.",
        "the price is $5 today",  # a `$` not followed by a space at line start
        "```bash\n\n```",
        "<cmd>  </cmd>",
        "```bash\n# done\n```",
        "<cmd>DONE</cmd>",
        "DONE",
        "<done/>",
    ],
)
def test_no_command(text: str) -> None:
    assert parse_command(text) is None


@pytest.mark.parametrize(
    ("text", "done"),
    [
        ("DONE", True),
        ("All tests pass.\nDONE\n", True),
        ("  done  ", True),
        ("# done", True),
        ("finished <done/>", True),
        ("<done />", True),
        ("I am not done yet", False),
        ("DONE_FLAG=1 make", False),
        ("```bash\nls\n```", False),
    ],
)
def test_is_done(text: str, done: bool) -> None:
    assert is_done(text) is done


def test_command_and_done_marker_together() -> None:
    text = "```bash\nmake install\n```\nDONE"
    assert parse_command(text) == "make install"
    assert is_done(text)
