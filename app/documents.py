"""Reading a user's YAML or JSON file (a run config, a workload, a task's task.yaml) into plain data.

Invariant: whatever is wrong with the file (missing, unreadable, not UTF-8, not valid YAML or JSON, a
key given twice in one mapping), the refusal is one line that names the file, never a traceback. What
the data must look like is the caller's to check.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml


class DocumentError(ValueError):
    """The file cannot be read or parsed; the message is one line naming it."""


class _DuplicateKey(ValueError):
    pass


class _StrictLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (PyYAML keeps the last one, so a
    typo'd second `lanes:` silently replaced the first)."""

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
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise DocumentError(f"{what} is not UTF-8 text (byte {exc.start})") from None
    except OSError as exc:
        raise DocumentError(f"cannot read {what}: {exc.strerror or exc}") from None
    as_json = json_suffix and path.suffix == ".json"
    try:
        return json.loads(text, object_pairs_hook=_json_pairs) if as_json else yaml.load(text, _StrictLoader)
    except _DuplicateKey as exc:
        raise DocumentError(f"{what}: {exc}") from None
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        detail = " ".join(str(exc).split())
        raise DocumentError(f"{what} is not valid {'JSON' if as_json else 'YAML'}: {detail}") from None
