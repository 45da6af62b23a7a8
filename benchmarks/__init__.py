"""Benchmarks: each prints measured figures; none asserts a speed."""


def check_outputs(**paths: object) -> None:
    """Before any work, prove each output path (flag name → path or None; a name ending in "plot" must
    also be an image format) can be written, as `corral`'s commands do; exit 2 with one line if not."""
    from pathlib import Path

    import typer

    from app.cli.common import check_apart, check_output, check_plot

    outputs: dict[str, Path | None] = {}
    for name, given in paths.items():
        outputs[f"--{name.replace('_', '-')}"] = None if given is None else Path(str(given))
    try:
        for flag, path in outputs.items():
            if path is None:
                continue
            if flag.endswith("plot"):
                check_plot(path, flag)
            else:
                check_output(path, flag)
        check_apart(outputs, {})
    except typer.Exit as exc:
        raise SystemExit(exc.exit_code) from None
