"""Reading a user's YAML or JSON file (a run config, a workload, a task's task.yaml) into plain data.

Invariant: whatever is wrong with the file (missing, unreadable, not UTF-8, not valid YAML or JSON),
the refusal is one line that names the file, never a traceback. What the data must look like is the
caller's to check.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml


class DocumentError(ValueError):
    """The file cannot be read or parsed; the message is one line naming it."""


def read_document(path: Path, what: str, json_suffix: bool = False) -> object:
    """Parse `path` as YAML (as JSON when `json_suffix` and its name ends in .json). `what` names the
    file in refusals, e.g. "workload w.yaml"."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise DocumentError(f"{what} is not UTF-8 text (byte {exc.start})") from None
    except OSError as exc:
        raise DocumentError(f"cannot read {what}: {exc.strerror or exc}") from None
    as_json = json_suffix and path.suffix == ".json"
    try:
        return json.loads(text) if as_json else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        detail = " ".join(str(exc).split())
        raise DocumentError(f"{what} is not valid {'JSON' if as_json else 'YAML'}: {detail}") from None
