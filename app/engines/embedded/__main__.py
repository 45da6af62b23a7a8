"""`python -m app.engines.embedded --port N --cpus 0,1 ...`: run the embedded engine server.

Invariant: bad command-line input (a malformed or unavailable CPU list, a bad size, an unreadable
weights directory) ends the process with a one-line message and exit code 2, never a traceback.
The process pins itself before torch is imported, so torch's thread pools start on the pinned CPUs.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from app.engines.embedded.cpus import CpuListError, parse_cpu_list, pin_cpus


def _cpu_list(text: str) -> list[int]:
    try:
        return parse_cpu_list(text)
    except CpuListError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer ≥ `minimum`, refused with a message that says so."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} must be >= {minimum}")
        return value

    return parse


_positive = _int_at_least(1)
_non_negative = _int_at_least(0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m app.engines.embedded",
        description="Corral's embedded engine: vLLM's HTTP surface over a small torch policy on the CPU.",
    )
    parser.add_argument("--port", type=_non_negative, required=True, help="TCP port to listen on")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument(
        "--cpus", type=_cpu_list, default=None, help="CPU list to pin to, e.g. '0,1' or '0-3'"
    )
    parser.add_argument("--layers", type=_positive, default=2, help="GRU layers (default 2)")
    parser.add_argument("--hidden", type=_positive, default=64, help="hidden size (default 64)")
    parser.add_argument("--seed", type=_non_negative, default=0, help="init and sampling seed (default 0)")
    parser.add_argument(
        "--sentinel", action="store_true", help="weight updates swap only the corral_sentinel tensor"
    )
    parser.add_argument("--weights-dir", default=None, help="safetensors directory to start from")
    parser.add_argument(
        "--weight-version", type=_non_negative, default=0, help="version of the initial weights"
    )
    parser.add_argument("--max-batch", type=_positive, default=64, help="most sequences per decode step")
    parser.add_argument("--model-name", default="corral-embedded", help="served model name")
    parser.add_argument(
        "--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"]
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.cpus is not None:
            pin_cpus(args.cpus)
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
            print(f"{parser.prog}: error: --weights-dir: {exc}", file=sys.stderr)
            return 2
    except CpuListError as exc:
        print(f"{parser.prog}: error: --cpus: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
