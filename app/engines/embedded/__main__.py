"""`corral engine --port N --cpus 0,1 ...` (also `python -m app.engines.embedded`): the embedded engine.

Invariant: bad command-line input (a malformed or unavailable CPU list, a size beyond its limit, a port
outside 1..65535 or already in use, an unreadable weights directory) ends the process with a one-line
message naming the flag and exit code 2, never a traceback. The port is checked before torch loads.
The process pins itself before torch is imported, so torch's thread pools start on the pinned CPUs.
"""

from __future__ import annotations

import argparse
import errno
import os
import socket
import sys
from collections.abc import Sequence
from typing import NoReturn

from app.engines.embedded.cpus import CpuListError, parse_cpu_list, pin_cpus
from app.runtime.config import MAX_ENGINE_SLOTS, MAX_HIDDEN, MAX_LAYERS, engines_memory_problem
from app.validation import MAX_SEED, int_between


def _cpu_list(text: str) -> list[int]:
    try:
        return parse_cpu_list(text)
    except CpuListError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


_port = int_between(1, 65535)
_seed = int_between(0, MAX_SEED)


class _OneLineParser(argparse.ArgumentParser):
    """Refusals are one line, `error: corral engine: --port: ...`, exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {self.prog}: {message.removeprefix('argument ')}\n")


def port_problem(host: str, port: int, host_from: str = "--host", port_from: str = "--port") -> str | None:
    """Why the engine could not listen on host:port, found by binding it now (before torch loads).
    `host_from` and `port_from` name where each came from (a flag, or a setting such as CORRAL_PORT)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        return f"{host_from} {host}: cannot resolve it ({exc.strerror})"
    except UnicodeError:  # the name's IDNA encoding failed: an empty label (`a..b`) or one over 63
        return f"{host_from} {host}: not a host name (a label of it is empty or longer than 63 characters)"
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
        try:
            sock.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return f"{port_from} {port}: {host}:{port} is already in use; pick another port"
            if exc.errno == errno.EACCES:
                return f"{port_from} {port}: permission denied (ports below 1024 need privileges)"
            return f"{host_from} {host} {port_from} {port}: cannot listen there ({exc.strerror})"
    return None


def build_parser(prog: str = "corral engine") -> argparse.ArgumentParser:
    parser = _OneLineParser(
        prog=prog,
        description="Corral's embedded engine: vLLM's HTTP surface over a small torch policy on the CPU.",
    )
    parser.add_argument("--port", type=_port, required=True, help="TCP port to listen on (1..65535)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument(
        "--cpus", type=_cpu_list, default=None, help="CPU list to pin to, e.g. '0,1' or '0-3'"
    )
    parser.add_argument(
        "--layers",
        type=int_between(1, MAX_LAYERS),
        default=2,
        help=f"GRU layers, 1..{MAX_LAYERS} (default 2)",
    )
    parser.add_argument(
        "--hidden",
        type=int_between(1, MAX_HIDDEN),
        default=64,
        help=f"hidden size, 1..{MAX_HIDDEN} (default 64)",
    )
    parser.add_argument("--seed", type=_seed, default=0, help="init and sampling seed (default 0)")
    parser.add_argument(
        "--sentinel", action="store_true", help="weight updates swap only the corral_sentinel tensor"
    )
    parser.add_argument("--weights-dir", default=None, help="safetensors directory to start from")
    parser.add_argument("--weight-version", type=_seed, default=0, help="version of the initial weights")
    parser.add_argument(
        "--max-batch",
        type=int_between(1, MAX_ENGINE_SLOTS),
        default=64,
        help=f"most sequences per decode step, 1..{MAX_ENGINE_SLOTS}",
    )
    parser.add_argument("--model-name", default="corral-embedded", help="served model name")
    parser.add_argument(
        "--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"]
    )
    return parser


def main(argv: Sequence[str] | None = None, prog: str = "corral engine") -> int:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    memory = engines_memory_problem(1, args.layers, args.hidden)
    if memory is not None:
        parser.error(f"--layers {args.layers} --hidden {args.hidden}: {memory}")
    if args.weights_dir is not None and not os.path.isdir(args.weights_dir):
        # Its contents are checked when torch loads them; a missing directory is refused before.
        parser.error(f"--weights-dir {args.weights_dir}: not a directory")
    problem = port_problem(args.host, args.port)
    if problem is not None:
        parser.error(problem)
    try:
        if args.cpus is not None:
            pin_cpus(args.cpus)
        print(
            f"{prog}: loading the model, then serving on http://{args.host}:{args.port} "
            "(OpenAI routes under /v1; ready when GET /health answers 200)",
            flush=True,
        )
        # Imported after pinning: torch's thread pools inherit the process's CPU mask.
        from app.engines.embedded.server import serve
        from app.engines.embedded.weights import WeightsError

        try:
            serve(
                args.port,
                args.cpus,
                host=args.host,
                layers=args.layers,
                hidden=args.hidden,
                seed=args.seed,
                sentinel=args.sentinel,
                weights_dir=args.weights_dir,
                weight_version=args.weight_version,
                max_batch=args.max_batch,
                model_name=args.model_name,
                log_level=args.log_level,
            )
        except WeightsError as exc:
            parser.error(f"--weights-dir: {exc}")
    except CpuListError as exc:
        parser.error(f"--cpus: {exc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
