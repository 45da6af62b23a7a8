"""Limits, parsers and one-line messages shared by every input schema (workloads, traces, run configs, the
CLI, the dashboard's forms).

Invariants: every number a user can type is finite, and every size has an upper bound stated here;
a refusal is one line that names the field as the user wrote it, without pydantic's "Value error,"
prefix or a "(top)" location. No I/O.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from collections.abc import Callable, Mapping
from typing import Any

from pydantic import ValidationError

# Longest duration of any phase, step or timeout (11.6 days): far beyond any harness cap, and small
# enough that virtual time keeps sub-millisecond resolution.
MAX_SECONDS = 1e6
# Shortest timeout of a task's phase (`task.yaml`): a shell command starts in milliseconds and an agent
# turn asks an engine over loopback HTTP; a denormal `agent_s` was taken, and every attempt timed out.
MIN_TASK_TIMEOUT_S = 0.1
# Most agent turns one attempt may take (the simulator holds every turn of a live attempt).
MAX_TURNS = 100_000
# Seeds key every random draw; any 64-bit value will do.
MAX_SEED = 2**63 - 1
# Simulator sizes.
MAX_BATCHES = 100_000
MAX_GROUPS_PER_BATCH = 10_000
MAX_GROUP_SIZE = 1_024
MAX_SURPLUS = 100_000
MAX_STALENESS = 1_000
MAX_RUN_STALENESS = 10_000  # K of a run created or changed through the API or the dashboard
MAX_SIM_ENGINES = 10_000
MAX_SLOTS = 1_000_000
MAX_CORES = 1_000_000
MAX_SWEEP_VALUES = 32
# `corral advise` without --workers: one simulation per CPU it may use, at most this many.
MAX_DEFAULT_WORKERS = 8
MAX_ADVICE_SEEDS = 10  # `corral advise --seeds`: each candidate is simulated this many times
# (B + S) × G: trajectories the simulator keeps live at once. `python -m benchmarks.scale` peaks at
# 62 MB above the import baseline with 10,000 short trajectories live, about 6 KB each.
MAX_TRAJECTORIES_IN_FLIGHT = 1_000_000
SIM_BYTES_PER_TRAJECTORY = 6_200
# Input files, read whole: a document (workload, run config, task.yaml) is a few KB, and PyYAML parses
# about 0.1 to 1 MB a second; a `corral run` report with its event stream is about 3 KB an attempt.
# Past these, it is the wrong file (or /dev/zero, a pipe that never ends), refused before it fills memory.
MAX_DOCUMENT_BYTES = 4_000_000
MAX_REPORT_BYTES = 2_000_000_000


_URL_PASSWORD = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://[^:/@]*):[^@/]*@")


def hide_password(url: str) -> str:
    """`url` as a message may show it: a password between `user:` and `@` becomes `***`."""
    return _URL_PASSWORD.sub(r"\1:***@", url)


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if n < 1000:
            return f"{n:.0f} {unit}"
        n /= 1000
    return f"{n:.0f} EB"


def in_flight_problem(groups: int, group_size: int, surplus: int) -> str | None:
    """Why (B + S) × G live trajectories are too many for the simulator, with what they would need."""
    live = (groups + surplus) * group_size
    if live <= MAX_TRAJECTORIES_IN_FLIGHT:
        return None
    need = human_bytes(live * SIM_BYTES_PER_TRAJECTORY)
    return (
        f"(B + S) × G = ({groups} + {surplus}) × {group_size} = {live:,} trajectories in flight would need "
        f"about {need} of memory (≈ {human_bytes(SIM_BYTES_PER_TRAJECTORY)} each); "
        f"the limit is {MAX_TRAJECTORIES_IN_FLIGHT:,}"
    )


# A live S that lets more than this × the trajectories in flight run must be confirmed as a large change
LARGE_CHANGE = 4


def large_surplus_change(groups: int, group_size: int, surplus: int, wanted: int, confirm: str) -> str | None:
    """Why a live change of S from `surplus` to `wanted` needs confirming (`confirm` says how): it lets
    more than `LARGE_CHANGE` times the trajectories run at once ((B + S)·G, and 64 more at least), each
    with its sandbox and engine turns. An S of 100,000 typed for 10 on a run of B = 2, G = 2 was applied
    at once and stalled the whole server (200,004 groups' trajectories admitted). None when it does not."""
    now, then = (groups + surplus) * group_size, (groups + wanted) * group_size
    if then <= max(LARGE_CHANGE * now, now + 64):
        return None
    return (
        f"surplus_groups (S): {wanted:,} lets up to {then:,} trajectories run at once, "
        f"{then / max(now, 1):,.0f}\u00d7 the {now:,} now, each with its sandbox and engine turns; nothing "
        f"was applied: {confirm} to make it"
    )


def parse_int(text: str, signed: bool = True) -> int:
    """`text` as an integer typed in ASCII digits, with an optional leading '-' when `signed`;
    ValueError otherwise (and for more digits than Python converts).

    For numbers typed as text (form fields, CLI lists, weight versions): `int()` alone also takes other
    scripts' digits ('٣', '３'), '_' between digits ('1_000'), a '+' and surrounding whitespace."""
    digits = text.removeprefix("-") if signed else text
    if not (digits.isascii() and digits.isdigit()):
        raise ValueError(f"not an integer: {text!r}")
    return int(text)


# A decimal number as typed in ASCII, with an optional '-' and exponent (as app.cli.common reads a number
# of seconds, which keeps its own: the CLI starts without pydantic; a '+' is refused, as `parse_int` does)
_DECIMAL = re.compile(r"-?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")


def parse_decimal(text: str) -> float:
    """`text` as a finite decimal number typed in ASCII (`2`, `0.5`, `-1`, `1e3`); ValueError otherwise.

    For numbers typed as text (form fields): `float()` alone also takes 'nan' and 'inf', '_' between
    digits, surrounding whitespace and other scripts' digits, and makes `1e400` inf."""
    if not _DECIMAL.fullmatch(text):
        raise ValueError(f"not a decimal number: {text!r}")
    number = float(text)
    if not math.isfinite(number):
        raise ValueError(f"out of range for a number: {text!r}")
    return number


def finite_problem(value: float, *, low: float, high: float) -> str | None:
    """Why `value` is not a finite number in [low, high], or None."""
    if not math.isfinite(value):
        return f"must be a finite number, not {value}"
    if not low <= value <= high:
        return f"must be between {low:g} and {high:g}, not {value:g}"
    return None


def describe(err: Mapping[str, Any]) -> str:
    """pydantic's message for one error, without its "Value error," prefix, with the value it got."""
    msg = str(err["msg"]).removeprefix("Value error, ").removeprefix("Assertion failed, ")
    value = err.get("input")
    if err.get("type") not in _SHOWS_INPUT:
        return msg
    if isinstance(value, bool | int | float) or value is None:
        shown = "NaN" if isinstance(value, float) and math.isnan(value) else json.dumps(value)
    elif isinstance(value, str) and len(value) <= 40:
        shown = repr(value)
    else:
        return msg
    return f"{msg}, not {shown}"


# Errors about a value's type or range: saying what was given helps (`true`, `2.0`, `.inf`).
_SHOWS_INPUT = frozenset(
    {
        "int_type",
        "int_from_float",
        "int_parsing",
        "float_type",
        "float_parsing",
        "finite_number",
        "bool_type",
        "string_type",
        "greater_than",
        "greater_than_equal",
        "less_than",
        "less_than_equal",
    }
)


def problems(exc: ValidationError, rename: Mapping[str, str] | None = None) -> str:
    """One line for every problem pydantic found: `field.path: message, not <value>`.

    `rename` maps a dotted field path to what the user typed (e.g. `surplus_groups` → `--surplus`).
    """
    parts = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"] if not str(p).startswith("function-"))
        where = (rename or {}).get(where, where)
        parts.append(f"{where}: {describe(err)}" if where else describe(err))
    return "; ".join(parts)


def _number(x: float) -> str:
    if isinstance(x, int):
        return f"{x:,}"
    return f"{x:,.0f}" if x.is_integer() else f"{x:g}"


def _range(p: Mapping[str, Any]) -> str | None:
    if "exclusiveMaximum" in p:
        below = f"< {_number(p['exclusiveMaximum'])}"
        if "minimum" in p:
            return f"≥ {_number(p['minimum'])}, {below}"
        return below
    if "maximum" not in p:
        return None
    high = _number(p["maximum"])
    if "exclusiveMinimum" in p:
        return f"> {_number(p['exclusiveMinimum'])}, ≤ {high}"
    if "minimum" in p:
        return f"{_number(p['minimum'])} … {high}"
    return f"≤ {high}"


def limit_rows(schema: Mapping[str, Any], skip: tuple[str, ...] = ()) -> list[str]:
    """Markdown rows `| field | range |` for every bounded number of a pydantic JSON schema.

    docs/limits.md holds these rows for the workload and the run config; `python -m app.validation`
    prints them again after a bound changes."""
    defs = schema.get("$defs", {})
    rows: list[str] = []

    def walk(node: Mapping[str, Any], prefix: str) -> None:
        for name, prop in node.get("properties", {}).items():
            key = prefix + name
            if skip and key.startswith(skip):
                continue
            options = prop.get("anyOf", [prop])
            ref = next((o["$ref"] for o in options if "$ref" in o), None)
            if ref is not None:
                walk(defs[ref.split("/")[-1]], key + ".")
                continue
            merged: dict[str, Any] = {}
            for option in options:
                merged.update(option)
            bounds = _range(merged)
            if bounds is not None:
                rows.append(f"| `{key}` | {bounds} |")

    walk(schema, "")
    return rows


DISTRIBUTIONS = tuple(
    f"trajectory.{f}" for f in ("reset_s", "turns", "llm_s", "tool_s", "validate_s", "cleanup_s")
)


def _print_tables() -> None:  # pragma: no cover - a documentation helper
    from app.runtime.config import LocalRunConfig
    from app.sim.workload import Workload

    print("Workload (`corral sim`, `corral bench`):\n")
    print("\n".join(limit_rows(Workload.model_json_schema(), DISTRIBUTIONS)))
    print("\nRun config (`corral run`):\n")
    print("\n".join(limit_rows(LocalRunConfig.model_json_schema())))


if __name__ == "__main__":
    _print_tables()


def int_between(minimum: int, maximum: int) -> Callable[[str], int]:
    """An argparse type: an integer in minimum..maximum, refused with a message that says so."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if not minimum <= value <= maximum:
            raise argparse.ArgumentTypeError(f"{value} is outside {minimum}..{maximum}")
        return value

    return parse
