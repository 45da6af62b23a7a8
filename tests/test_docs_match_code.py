"""README.md and docs/*.md say what the code does.

Each check reads the docs and lists every drift it finds, one `doc:line: what` a line:
- the repository paths the docs cite exist, and so do the tests (`tests/x.py::test_y`, `test_y`) and
  modules (`app.engines.sglang.SGLangEngine`) they name; their relative links lead to files;
- each `CORRAL_*` variable they name is a setting or read by the code, and every setting is in
  docs/api.md's settings table, with the default the code has;
- the `corral` command lines they show use commands and flags `corral` takes, and their `python -m`
  lines modules that exist and flags those modules' parsers take;
- each HTTP route they show (`GET /api/runs/{id}`, a curl line) is served with that method by Corral's
  app or by its embedded engine, and takes the query parameters shown.

Nothing is run: the parsers and the apps are built and inspected. The last tests feed each check a doc
with a drift of its kind, so a check that stopped finding anything would fail too.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, NoReturn

import pytest
import typer.main
from fastapi import FastAPI
from pydantic_settings import BaseSettings
from starlette.routing import Match

ROOT = Path(__file__).resolve().parents[1]
DOCS = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))
SETTINGS_DOC = ROOT / "docs" / "api.md"

# Where the code that reads an environment variable lives.
CODE = ("app", "workers", "scripts", ".ci", "Makefile", "docker-compose.yml", "Dockerfile")
PATH_ROOTS = "app|workers|tests|docs|benchmarks|examples|templates|migrations|scripts"

# What the docs name on purpose without this repository having it; each says why.
OTHER_PROJECTS_PATHS = {
    # vLLM's repository: the sources docs/engines.md was written from
    "docs/training/async_rl.md",
    "docs/training/weight_transfer/README.md",
    "docs/training/weight_transfer/disk.md",
    "docs/serving/openai_compatible_server.md",
}
NOT_MODULES = {
    "app.conf",  # the file a built-in task edits (docs/tasks.md), not a module
}
NOT_OURS_ROUTES = {
    # SGLang's own server's routes, which app.engines.sglang calls (docs/engines.md); no Corral code
    # serves them
    "POST /pause_generation",
    "POST /continue_generation",
    "POST /update_weights_from_disk",
    "GET /get_weight_version",
    "POST /flush_cache",
}
UNDOCUMENTED_SETTINGS = {
    # set by `load_settings` when it generated the operator token, never by a user
    "CORRAL_OPERATOR_TOKEN_GENERATED",
}


# --- reading the docs ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Snippet:
    """A piece of a doc: an inline code span, a fenced code line, or a line of text."""

    where: str  # "docs/api.md:23"
    text: str


def _name(doc: Path) -> str:
    return str(doc.relative_to(ROOT)) if doc.is_relative_to(ROOT) else doc.name


def _blocks(doc: Path) -> Iterator[tuple[int, str, bool]]:
    """(first line number, text, fenced): the doc's paragraphs outside code fences, whole, and its
    fenced lines one by one, a line ending in a backslash joined to the next."""
    fenced = False
    start, paragraph = 0, list[str]()
    pending: tuple[int, str] | None = None
    for number, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
        elif fenced:
            first, text = pending or (number, "")
            text += line
            pending = (first, text[:-1]) if text.endswith("\\") else None
            if pending is None:
                yield first, text, True
            continue
        elif line.strip():
            start = start if paragraph else number
            paragraph.append(line)
            continue
        if paragraph:
            yield start, "\n".join(paragraph), False
            paragraph = []
    if paragraph:
        yield start, "\n".join(paragraph), False


INLINE_CODE = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.DOTALL)


@cache
def code(doc: Path) -> tuple[Snippet, ...]:
    """The doc's inline code spans (a span wrapped over two lines is one) and its fenced lines."""
    found = []
    for start, text, fenced in _blocks(doc):
        if fenced:
            found.append(Snippet(f"{_name(doc)}:{start}", text))
            continue
        for match in INLINE_CODE.finditer(text):
            line = start + text.count("\n", 0, match.start())
            found.append(Snippet(f"{_name(doc)}:{line}", " ".join(match.group(2).split())))
    return tuple(found)


@cache
def lines(doc: Path) -> tuple[Snippet, ...]:
    """Every line of the doc, fenced or not."""
    text = doc.read_text(encoding="utf-8")
    return tuple(Snippet(f"{_name(doc)}:{n}", line) for n, line in enumerate(text.splitlines(), 1))


# --- 1. paths ----------------------------------------------------------------------------------------

# A repository path from one of the top directories, with an optional `::test` selector, parameters and
# `:line` suffix; not part of a longer path or URL, nor a pattern (`docs/runs/<stop>/`, `tests/*.py`).
REPO_PATH = re.compile(
    r"(?<![\w./~$-])((?:" + PATH_ROOTS + r")/(?:[\w./-]|\{\w+(?:,\w+)+\})*+)"  # `a-{on,off}.yaml` too
    r"((?:::\w+)*)(?:\[[^\]\s]*\])?(?::\d+(?:-\d+)?)?(?![<{*$])"
)


def expand_braces(path: str) -> list[str]:
    """The paths a shell makes of `small-{on,off}.yaml`."""
    match = re.search(r"\{([^{}]*)\}", path)
    if match is None:
        return [path]
    return [
        expanded
        for choice in match.group(1).split(",")
        for expanded in expand_braces(path[: match.start()] + choice + path[match.end() :])
    ]


LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def selector_problem(path: Path, selector: str) -> str | None:
    """Why `path::selector` names no test (a function, a class or a class's method), or None."""
    scope: list[ast.stmt] = ast.parse(path.read_text(encoding="utf-8")).body
    for name in selector.strip(":").split("::"):
        found = [
            node
            for node in scope
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and node.name == name
        ]
        if not found:
            return f"no {name} in {path.relative_to(ROOT)}"
        scope = found[0].body if isinstance(found[0], ast.ClassDef) else []
    return None


def path_drift(docs: tuple[Path, ...]) -> list[str]:
    drift = []
    for doc in docs:
        for snippet in lines(doc):
            for match in REPO_PATH.finditer(snippet.text):
                selector = match.group(2)
                for cited in expand_braces(match.group(1).rstrip(".")):
                    path = ROOT / cited
                    if cited in OTHER_PROJECTS_PATHS:
                        continue
                    if not path.exists():
                        drift.append(f"{snippet.where}: {cited}: no such file or directory")
                    elif selector and (problem := selector_problem(path, selector)) is not None:
                        drift.append(f"{snippet.where}: {cited}{selector}: {problem}")
    return drift


@cache
def defined_names() -> frozenset[str]:
    """The tests' function names, and the names app's code uses (a task's `test_scripts` field)."""
    tests = "".join(path.read_text(encoding="utf-8") for path in (ROOT / "tests").rglob("*.py"))
    code = "".join(path.read_text(encoding="utf-8") for path in (ROOT / "app").rglob("*.py"))
    return frozenset(re.findall(r"\bdef (test_\w+)", tests) + re.findall(r"\w+", code))


def named_test_drift(docs: tuple[Path, ...]) -> list[str]:
    """A code span that is a test's name alone (`test_a_reset_..._leaves_no_container`) names a test."""
    return [
        f"{snippet.where}: {snippet.text}: no such test"
        for doc in docs
        for snippet in code(doc)
        if re.fullmatch(r"test_\w+", snippet.text) and snippet.text not in defined_names()
    ]


MODULE_NAME = re.compile(r"(?<![\w./-])((?:app|workers|benchmarks)(?:\.\w+)+)(?![\w/-])")


def resolves(name: str) -> bool:
    """Is `name` a module, or an attribute of one (`app.engines.sglang.SGLangEngine`)?"""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            found: object = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for part in parts[i:]:
            if not hasattr(found, part):
                return False
            found = getattr(found, part)
        return True
    return False


def module_drift(docs: tuple[Path, ...]) -> list[str]:
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(ROOT))  # `benchmarks` is not installed
        return [
            f"{snippet.where}: {name}: no such module or attribute"
            for doc in docs
            for snippet in code(doc)
            for name in MODULE_NAME.findall(snippet.text)
            if name not in NOT_MODULES and not resolves(name)
        ]


def link_drift(docs: tuple[Path, ...]) -> list[str]:
    drift = []
    for doc in docs:
        for snippet in lines(doc):
            for target in LINK.findall(snippet.text):
                if re.match(r"[a-z]+:", target) or target.startswith("#"):
                    continue  # another site, or a heading of this doc
                path = (doc.parent / target.split("#", 1)[0]).resolve()
                if not path.is_relative_to(ROOT) or not path.exists():
                    drift.append(f"{snippet.where}: link to {target}: no such file")
    return drift


# --- 2. environment variables ----------------------------------------------------------------------

ENV_NAME = re.compile(r"\bCORRAL_[A-Z0-9_]*[A-Z0-9]\b")


def settings_classes() -> list[type[BaseSettings]]:
    from app.settings import Settings
    from workers.celery_app import BrokerSettings

    return [Settings, BrokerSettings]


def setting_names() -> dict[str, Any]:
    """Each setting's variable and its default (None where it is computed)."""
    names = {}
    for cls in settings_classes():
        prefix = cls.model_config.get("env_prefix", "")
        for field, info in cls.model_fields.items():
            default = None if info.default_factory is not None else info.default
            names[f"{prefix}{field}".upper()] = default
    return names


def _strings(path: Path) -> Iterator[str]:
    """The text in which a file can read a variable: a Python file's string constants other than its
    docstrings (a name only a docstring mentions is read by nothing); any other file whole."""
    text = path.read_text(encoding="utf-8", errors="replace")
    if path.suffix != ".py":
        yield text
        return
    tree = ast.parse(text)
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            yield node.value


@cache
def variables_read() -> frozenset[str]:
    """Every `CORRAL_*` name the code can read: the settings', and those in its string constants."""
    found = set(setting_names())
    for top in CODE:
        path = ROOT / top
        files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
        for file in files:
            if file.suffix in (".pyc", ".png", ".json", ".jsonl") or "__pycache__" in file.parts:
                continue
            for text in _strings(file):
                found.update(ENV_NAME.findall(text))
    return frozenset(found)


def env_drift(docs: tuple[Path, ...]) -> list[str]:
    known = variables_read()
    return [
        f"{snippet.where}: {name}: neither a setting nor read by the code"
        for doc in docs
        for snippet in lines(doc)
        for name in ENV_NAME.findall(snippet.text)
        if name not in known
    ]


def settings_table(doc: Path) -> dict[str, tuple[str, str]]:
    """The doc's settings table: variable → (where, default as written), from rows whose first cell
    names variables (`CORRAL_HOST`, `CORRAL_PORT` with defaults `127.0.0.1`, `8000`)."""
    rows = {}
    for snippet in lines(doc):
        cells = [cell.strip() for cell in snippet.text.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].startswith("`CORRAL_"):
            continue
        names = ENV_NAME.findall(cells[0])
        defaults = re.findall(r"`([^`]*)`", cells[1])
        for i, name in enumerate(names):
            rows[name] = (snippet.where, defaults[i] if len(defaults) == len(names) else "")
    return rows


def same_default(written: str, default: Any) -> bool:
    """Does the table's default say the code's: a number, a boolean or a text as written (`60` for 60.0)."""
    if isinstance(default, bool):
        return written == str(default).lower()
    if isinstance(default, int | float):
        try:
            return math.isclose(float(written), default)
        except ValueError:
            return False
    if isinstance(default, str):
        return written == default
    return True  # computed (`$PWD/corral.db`) or unset: said in words, not compared


def settings_drift(doc: Path) -> list[str]:
    table = settings_table(doc)
    drift = []
    for name, default in setting_names().items():
        if name in UNDOCUMENTED_SETTINGS:
            continue
        if name not in table:
            drift.append(f"{_name(doc)}: {name}: a setting missing from the settings table")
            continue
        where, written = table[name]
        if default is not None and written and not same_default(written, default):
            drift.append(f"{where}: {name}: default `{written}`, the code's is {default!r}")
    return drift


# --- 3. command lines ------------------------------------------------------------------------------

# Where a shell command line ends: a pipe, a list, a redirection, a comment
COMMAND_END = {"|", "||", "&&", ";", "&", ">", ">>", "2>", "2>&1", "#", "<"}


def _words(text: str) -> list[str]:
    """The words of the command line starting `text`, up to where it ends."""
    words = []
    for word in text.split():
        if word in COMMAND_END or word.startswith("#"):
            break
        ended = word.endswith(";")
        words.append(word.rstrip(";"))
        if ended:
            break
    return words


def _flag(word: str) -> str | None:
    """The option a command line's word gives (`[--port` → `--port`, `--json=x` → `--json`), or None."""
    word = word.lstrip("[(")
    if not re.match(r"--?[a-zA-Z]", word) or re.search(r"[<{$]", word):
        return None
    return re.split(r"[=\]),.:'\"`]", word, maxsplit=1)[0]


@cache
def corral_command() -> Any:
    """`corral` as click has it (typer's own copy of click: its classes are not the `click` package's)."""
    from app.cli import app

    return typer.main.get_command(app)


def _options(command: Any) -> set[str]:
    return {"--help"} | {opt for param in command.params for opt in (*param.opts, *param.secondary_opts)}


def _parser_options(parser: argparse.ArgumentParser) -> set[str]:
    return {opt for action in parser._actions for opt in action.option_strings}


def corral_options(words: list[str]) -> tuple[str, set[str], list[str]] | str | None:
    """For `corral WORDS`: (the command, the options it takes, the words after its name), a problem,
    or None where the words are not a command line (`corral:` in a log)."""
    group = corral_command()
    path = ["corral"]
    while hasattr(group, "commands") and words and not words[0].startswith("-"):
        name = words[0].rstrip(")'\"`,.:;")
        if not re.fullmatch(r"[a-z][a-z-]*", name):
            return None
        if name not in group.commands:
            return f"`{' '.join(path)} {name}`: no such command"
        path.append(name)
        group, words = group.commands[name], words[1:]
    options = _options(group)
    if path == ["corral", "engine"]:
        # it passes the options it does not know to the embedded engine
        from app.engines.embedded.__main__ import build_parser

        options |= _parser_options(build_parser())
    return " ".join(path), options, words


class _Parsed(Exception):
    """Not an error: how a captured parser leaves main() before it runs anything."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


def _capture(parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> NoReturn:
    raise _Parsed(parser)


@cache
def script_options(module: str) -> frozenset[str] | str | None:
    """The options `python -m MODULE` takes: its argparse parser's, built by its main() up to where it
    parses the command line (stopped there); None when it parses none; a problem when it is no module."""
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(ROOT))  # as `python -m` from the repository: `benchmarks` is not installed
        try:
            spec = importlib.util.find_spec(module)
        except ModuleNotFoundError:
            spec = None
        if spec is None or spec.origin is None:
            return "no such module"
        if spec.submodule_search_locations is not None:
            return script_options(f"{module}.__main__")
        if "parse_args(" not in Path(spec.origin).read_text(encoding="utf-8"):
            return None
        patch.setattr(argparse.ArgumentParser, "parse_args", _capture)
        try:
            importlib.import_module(module).main()
        except _Parsed as parsed:
            return frozenset(_parser_options(parsed.parser))
    raise AssertionError(f"{module}.main() returned without parsing its command line")


# `corral` where a command line has it: first, after a shell operator, a quote or a `$ ` prompt, behind
# variable assignments or a directory (`.venv/bin/corral`); not in a message (`dead corral process 12`).
CORRAL = re.compile(
    r"(?:^|[('\"`]|&&|\|\||[;|])\s*(?:\$\s+)?(?:[A-Z_][A-Z0-9_]*=\S*\s+)*(?:[\w.~/-]*/)?corral\s+(\S.*)"
)
PYTHON = re.compile(
    r"(?<![\w-])(?:\S*/)?python3?\s+(?:-m\s+((?:app|benchmarks|workers|examples|scripts)(?:\.\w+)+)"
    r"|((?:app|benchmarks|workers|examples|scripts)/[\w/]+)\.py)\b(.*)"
)


def command_drift(docs: tuple[Path, ...]) -> list[str]:
    drift = []
    for doc in docs:
        for snippet in code(doc):
            for match in CORRAL.finditer(snippet.text):
                found = corral_options(_words(match.group(1)))
                if isinstance(found, str):
                    drift.append(f"{snippet.where}: {found}")
                elif found is not None:
                    name, options, words = found
                    unknown = [flag for w in words if (flag := _flag(w)) and flag not in options]
                    drift.extend(f"{snippet.where}: `{name} {flag}`: no such option" for flag in unknown)
            for match in PYTHON.finditer(snippet.text):
                module = match.group(1) or match.group(2).replace("/", ".")
                shown = f"python -m {module}" if match.group(1) else f"python {match.group(2)}.py"
                options = script_options(module)
                if isinstance(options, str):
                    drift.append(f"{snippet.where}: `{shown}`: {options}")
                elif options is not None:
                    flags = [flag for w in _words(match.group(3)) if (flag := _flag(w))]
                    drift.extend(
                        f"{snippet.where}: `{shown} {flag}`: no such option"
                        for flag in flags
                        if flag not in options | {"--help", "-h"}
                    )
    return drift


# --- 4. HTTP routes --------------------------------------------------------------------------------

METHOD_PATH = re.compile(r"\b(GET|POST|PUT|PATCH|DELETE)\s+(/(?:\{[^}\n]*\}|[^\s`|,;)\"'{}\\])*)")
CURL = re.compile(r"\bcurl\s(.*)")


def answer(app: FastAPI, method: str, path: str) -> Match:
    """How `app`'s routing takes `METHOD path`: FULL (served), PARTIAL (the path with another method)."""
    scope = {"type": "http", "method": method, "path": path, "root_path": "", "query_string": b""}
    return max((route.matches(scope)[0] for route in app.routes), key=lambda m: m.value, default=Match.NONE)


@cache
def corral_app(data: Path) -> FastAPI:
    """What `corral serve` serves: the app as the tests make it (its lifespan, which opens the store, not
    run)."""
    from app.api.app import create_app
    from app.settings import Settings

    settings = Settings(
        database_url=f"sqlite:///{data / 'corral.db'}", operator_token="docs-test-token", data_dir=data
    )
    return create_app(settings)


@cache
def engine_app() -> FastAPI:
    """What an embedded engine serves, with its test-only fault routes (`CORRAL_ENGINE_DEBUG=1`; their
    helper process not started)."""
    from app.engines.embedded import faults
    from app.engines.embedded.server import EmbeddedConfig, create_app

    app = create_app(EmbeddedConfig())
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(faults.EngineFaults, "start_child", lambda self: None)
        faults.install_faults(app)
    return app


def shown_routes(doc: Path) -> Iterator[tuple[str, str, str]]:
    """(where, method, path) of each route the doc shows: `METHOD /path` anywhere, and curl lines."""
    for snippet in lines(doc):
        for method, path in METHOD_PATH.findall(snippet.text):
            yield snippet.where, method, path
    for snippet in code(doc):
        for match in CURL.finditer(snippet.text):
            words = [w.strip("'\"") for w in _words(match.group(1))]
            url = next((w for w in words if re.match(r"(\$URL|localhost:|https?://)", w)), None)
            if url is None:
                continue
            path = re.sub(r"^(\$URL|https?://[^/]+|localhost:[^/]+)", "", url)
            given = [words[i + 1] for i, w in enumerate(words[:-1]) if w in ("-X", "--request")]
            data = any(w in ("-d", "--data", "--data-binary", "--json") for w in words)
            yield snippet.where, given[0] if given else ("POST" if data else "GET"), path or "/"


def query_parameters(app: FastAPI, method: str, path: str) -> set[str] | None:
    """The query parameters the schema gives `METHOD path`, or None where it has no such route."""
    for template, operations in app.openapi()["paths"].items():
        pattern = re.sub(r"\\\{[^}]*\\\}", "[^/]+", re.escape(template))
        if re.fullmatch(pattern, path) and method.lower() in operations:
            parameters = operations[method.lower()].get("parameters", [])
            return {p["name"] for p in parameters if p["in"] == "query"}
    return None


def route_drift(docs: tuple[Path, ...], data: Path) -> list[str]:
    """A route under /api is Corral's; any other may be the embedded engine's (docs/engines.md)."""
    ours, engine = corral_app(data), engine_app()
    drift = []
    for doc in docs:
        for where, method, shown in shown_routes(doc):
            path, _, query = shown.partition("?")
            path = path.rstrip(".:")
            if f"{method} {path}" in NOT_OURS_ROUTES:
                continue
            path = re.sub(r"\{[^}]*\}", "x", path)  # `{id}`: any one segment
            apps = [ours] if path.startswith("/api/") else [ours, engine]
            found = [(app, answer(app, method, path)) for app in apps]
            served = [app for app, match in found if match is Match.FULL]
            if not served:
                why = "not with that method" if any(m is Match.PARTIAL for _, m in found) else "no such route"
                drift.append(f"{where}: {method} {shown}: {why}")
                continue
            taken = query_parameters(served[0], method, path)
            given = re.findall(r"(?:^|&)(\w+)=", query)
            drift.extend(
                f"{where}: {method} {shown}: no query parameter {name}"
                for name in given
                if taken is not None and name not in taken
            )
    return drift


# A table of the workload family: its header, and the reports it cites within the lines above it.
FAMILY_HEADER = "| rung | default | design | cpu-scarce | ample-cpu | trace |"
FAMILY_REPORTS = ("docs/family-trainable.json", "docs/family.json")
LOWER_BOUND_ROWS = ("lower bound for `full`", "lower bound (full)")


def _family_report(text: list[str], header: int) -> str | None:
    """The report a family table gives its figures from: the nearest one named in the 15 lines above."""
    for line in reversed(text[max(0, header - 15) : header]):
        found = [name for name in FAMILY_REPORTS if name in line]
        if found:
            return found[0]
    return None


def _figure(cell: str) -> float | None:
    """A cell's figure: its first number (`**691.9** (797.8 without …)` → 691.9), None where it has none."""
    found = re.search(r"\d[\d,]*\.?\d*", cell.replace("**", ""))
    return float(found.group().replace(",", "")) if found else None


def _rungs(row: str) -> list[str]:
    """The rungs a row names: `areal / skyrl (no concurrency cap)` is both, each without a cap."""
    *heads, last = row.split(" / ")
    name, paren, variant = last.partition(" (")
    return [f"{head}{paren}{variant}" for head in heads] + [last] if heads else [name + paren + variant]


def figure_drift(docs: tuple[Path, ...], root: Path = ROOT) -> list[str]:
    """Each mean batch time in a family table is the report's it cites, rounded as shown."""
    drift = []
    for doc in docs:
        text = doc.read_text(encoding="utf-8").splitlines()
        for header, line in enumerate(text):
            cited = _family_report(text, header) if line.strip() == FAMILY_HEADER else None
            if cited is None:
                continue
            workloads = json.loads((root / cited).read_text(encoding="utf-8"))["workloads"]
            names = FAMILY_HEADER.strip("|").split("|")[1:]
            for number in range(header + 2, len(text)):
                cells = [c.strip() for c in text[number].strip().strip("|").split("|")]
                if not text[number].startswith("|") or any("%" in c for c in cells):
                    break
                rung = cells[0].replace("*", "")
                for workload, cell in zip((n.strip() for n in names), cells[1:], strict=False):
                    shown = _figure(cell)
                    if shown is None:
                        continue
                    rungs = workloads[workload]["rungs"]
                    if rung in LOWER_BOUND_ROWS:
                        wanted = [rungs["full"]["lower_bound_s"]]
                    else:
                        wanted = [rungs[r]["mean_s"] for r in _rungs(rung) if r in rungs]
                    where = f"{_name(doc)}:{number + 1}"
                    if not wanted:
                        drift.append(f"{where}: {rung}: no such rung in {cited}")
                    elif any(round(w, 1) != shown for w in wanted):
                        figures = ", ".join(f"{w:.1f}" for w in wanted)
                        drift.append(f"{where}: {rung} on {workload}: {shown}, {cited} has {figures}")
    return drift


# --- the checks ------------------------------------------------------------------------------------


# Each check over the real docs: (what it finds, the check given a scratch directory), by name.
CHECKS = {
    "paths": ("cited paths that do not exist", lambda data: path_drift(DOCS)),
    "tests": ("named tests that do not exist", lambda data: named_test_drift(DOCS)),
    "modules": ("named modules or attributes that do not exist", lambda data: module_drift(DOCS)),
    "links": ("links to nothing", lambda data: link_drift(DOCS)),
    "variables": ("variables nothing reads", lambda data: env_drift(DOCS)),
    "settings": ("settings drifted from docs/api.md's table", lambda data: settings_drift(SETTINGS_DOC)),
    "commands": ("command lines that would be refused", lambda data: command_drift(DOCS)),
    "routes": ("routes nobody serves", lambda data: route_drift(DOCS, data)),
    "figures": ("family table figures that are not their report's", lambda data: figure_drift(DOCS)),
}


@pytest.mark.parametrize("name", CHECKS)
def test_docs_match_code(name: str, tmp_path: Path) -> None:
    what, check = CHECKS[name]
    drift = check(tmp_path)
    assert not drift, f"{len(drift)} {what}:\n" + "\n".join(drift)


# --- each check finds drift ----------------------------------------------------------------------------


def _doc(tmp_path: Path, text: str) -> tuple[Path, ...]:
    doc = tmp_path / "drifted.md"
    doc.write_text(text, encoding="utf-8")
    return (doc,)


def test_each_check_finds_a_drift_of_its_kind(tmp_path: Path) -> None:
    doc = _doc(
        tmp_path,
        "See `app/no_such.py`, `tests/test_cli.py::no_such_test` and [the plan](no-such.md).\n"
        "Set `CORRAL_NO_SUCH_SETTING`.\n"
        "Run `corral sim --no-such-flag`, `corral no-such-command`,\n"
        "```\npython -m benchmarks.scale --no-such-flag \\\n  --json x.json\n```\n"
        "then `GET /api/no-such-route` and `DELETE /api/runs`, `GET /api/runs/{id}/timeline?no_such=1`.\n"
        "| variable | default | meaning |\n| --- | --- | --- |\n| `CORRAL_PORT` | `8001` | where |\n"
        "`test_no_such_test` shows it; `app.runtime.no_such_module` does it.\n"
        "`python -m benchmarks.no_such`\n",
    )
    assert path_drift(doc) == [
        "drifted.md:1: app/no_such.py: no such file or directory",
        "drifted.md:1: tests/test_cli.py::no_such_test: no no_such_test in tests/test_cli.py",
    ]
    assert link_drift(doc) == ["drifted.md:1: link to no-such.md: no such file"]
    assert env_drift(doc) == ["drifted.md:2: CORRAL_NO_SUCH_SETTING: neither a setting nor read by the code"]
    assert command_drift(doc) == [
        "drifted.md:3: `corral sim --no-such-flag`: no such option",
        "drifted.md:3: `corral no-such-command`: no such command",
        "drifted.md:5: `python -m benchmarks.scale --no-such-flag`: no such option",
        "drifted.md:13: `python -m benchmarks.no_such`: no such module",
    ]
    assert route_drift(doc, tmp_path) == [
        "drifted.md:8: GET /api/no-such-route: no such route",
        "drifted.md:8: DELETE /api/runs: not with that method",
        "drifted.md:8: GET /api/runs/{id}/timeline?no_such=1: no query parameter no_such",
    ]
    assert named_test_drift(doc) == ["drifted.md:12: test_no_such_test: no such test"]
    assert module_drift(doc) == [
        "drifted.md:12: app.runtime.no_such_module: no such module or attribute",
        "drifted.md:13: benchmarks.no_such: no such module or attribute",
    ]
    drift = settings_drift(doc[0])
    assert "drifted.md:11: CORRAL_PORT: default `8001`, the code's is 8000" in drift
    assert "drifted.md: CORRAL_DATABASE_URL: a setting missing from the settings table" in drift


def test_the_figures_check_finds_a_figure_its_report_lacks(tmp_path: Path) -> None:
    report = json.loads((ROOT / "docs" / "family.json").read_text(encoding="utf-8"))["workloads"]
    full = report["default"]["rungs"]["full"]["mean_s"]
    doc = _doc(
        tmp_path,
        "From `docs/family.json`:\n\n"
        f"{FAMILY_HEADER}\n| --- | --- | --- | --- | --- | --- |\n"
        f"| **full** | **{full:.1f}** | **1.0** | — | x | y |\n| no such rung | 1.0 | | | | |\n",
    )
    design = report["design"]["rungs"]["full"]["mean_s"]
    assert figure_drift(doc) == [
        f"drifted.md:5: full on design: 1.0, docs/family.json has {design:.1f}",
        "drifted.md:6: no such rung: no such rung in docs/family.json",
    ]
