"""Benchmarks: each prints measured figures; none asserts a speed."""


def check_outputs(**paths: object) -> None:
    """Before any work, prove each output path (flag name → path or None; a name ending in "plot" must
    also be an image format) can be written, as `corral`'s commands do; exit 2 with one line if not."""
    from pathlib import Path

    import typer

    from app.cli.common import check_output, check_plot

    try:
        for flag, path in paths.items():
            if path is None:
                continue
            if flag.endswith("plot"):
                check_plot(Path(str(path)), f"--{flag.replace('_', '-')}")
            else:
                check_output(Path(str(path)), f"--{flag.replace('_', '-')}")
    except typer.Exit as exc:
        raise SystemExit(exc.exit_code) from None
