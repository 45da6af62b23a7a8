"""Dashboard rendering: the run page and a timeline update with about 2,000 spans.

Builds a run of `--spans` spans (the seeded synthetic stream of app.web.synthetic), then times, each
`--repeat` times, and prints the median and the max:
- `view`: the RunView from the envelopes (what every live refresh does first);
- `run page`: the whole run page (view, attribution, timeline SVG, charts, every panel) as HTML;
- `timeline update`: the timeline block alone, as htmx fetches it on a live tick or a zoom;
- `timeline update ×8 zoom`: the same at zoom 8 (the widest SVG the zoom buttons usually reach);
- `live stream tick`: the named blocks one SSE message carries (all panels but the timeline).
It also prints the HTML sizes. With `--browser`, it serves the same run as a replay and measures in
Debian's Chromium (headless, Playwright): the run page's load (navigation start to the load event)
and a zoom (click on "Zoom in"/"Zoom out" to the new timeline swapped in). It asserts
nothing about speed.

Run: `.venv/bin/python -m benchmarks.render [--spans 2000] [--repeat 20] [--browser]`.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from app.core.events import Envelope
from app.web.readmodel import view_from_events
from app.web.security import AccessConfig
from app.web.synthetic import synthetic_run
from app.web.views import LIVE_BLOCKS, Dashboard, run_context

CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


def _time(fn: Callable[[], object], repeat: int) -> tuple[float, float, object]:
    samples = []
    out: object = None
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples), max(samples), out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spans", type=int, default=2000)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--browser", action="store_true", help="also time the page in Chromium")
    args = parser.parse_args()
    if not 1 <= args.spans <= 1_000_000 or not 1 <= args.repeat <= 10_000:
        parser.error("--spans must be in 1..1000000 and --repeat in 1..10000")

    groups = 4
    while True:
        events = synthetic_run("bench", groups=groups, group_size=4, batch_groups=4)
        view = view_from_events("bench", events, source="live")
        if view.span_count >= args.spans:
            break
        groups = max(groups + 1, int(groups * args.spans / max(view.span_count, 1)))
    dash = Dashboard(AccessConfig("bench-operator-token"))
    base = {"csrf": "x" * 32, "csrf_field": "csrf_token", "operator": True, "view_protected": False}

    def page() -> str:
        v = view_from_events("bench", events, source="live")
        return dash.render("run.html", {**run_context(v), **base})

    def timeline(zoom: float) -> Callable[[], str]:
        def fn() -> str:
            v = view_from_events("bench", events, source="live")
            return dash.render("run.html", {**run_context(v, zoom), **base}, "timeline")

        return fn

    def tick() -> list[str]:
        v = view_from_events("bench", events, source="live")
        ctx = {**run_context(v), **base}
        return [dash.render("run.html", ctx, b) for b in LIVE_BLOCKS]

    print(
        f"run: {len(events)} events, {len(view.trajectories)} trajectories in {len(view.groups)} groups, "
        f"{view.span_count} spans; median and max of {args.repeat} repeats"
    )
    rows = [
        ("view", lambda: view_from_events("bench", events, source="live")),
        ("run page", page),
        ("timeline update", timeline(1.0)),
        ("timeline update ×8 zoom", timeline(8.0)),
        ("live stream tick", tick),
    ]
    print(f"{'':26} {'median ms':>10} {'max ms':>10} {'HTML kB':>9}")
    for name, fn in rows:
        med, worst, out = _time(fn, args.repeat)
        if isinstance(out, str | list):
            size = f"{(len(out) if isinstance(out, str) else sum(len(x) for x in out)) / 1000:.0f}"
        else:
            size = "—"
        print(f"{name:26} {med * 1000:10.1f} {worst * 1000:10.1f} {size:>9}")

    if args.browser:
        _browser(events, args.repeat)


def _browser(events: list[Envelope], repeat: int) -> None:
    import socket
    import threading

    import uvicorn
    from fastapi import FastAPI
    from playwright.sync_api import sync_playwright

    from app.web.views import mount_dashboard

    app = FastAPI()
    dash = Dashboard(AccessConfig("bench-operator-token"))
    run_id = dash.replays.add({"policy": "bench", "event_log": [e.to_dict() for e in events]}, "bench")
    mount_dashboard(app, dash)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    url = f"http://127.0.0.1:{port}/runs/{run_id}"
    loads, zooms = [], []
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            for _ in range(repeat):
                page.goto(url, wait_until="load")
                loads.append(page.evaluate("performance.getEntriesByType('navigation')[0].loadEventEnd"))
            page.evaluate(
                "window.__settled = 0; document.addEventListener('timeline:loaded', "
                "() => { window.__settled = performance.now(); })"
            )
            for i in range(repeat):
                name = "zoom in on time" if i % 2 == 0 else "zoom out on time"
                start = page.evaluate("performance.now()")
                page.get_by_role("link", name=name).click()
                page.wait_for_function("s => window.__settled > s", arg=start)
                zooms.append(page.evaluate("window.__settled") - start)
            browser.close()
    finally:
        server.should_exit = True
        thread.join(10)
    print(f"browser (Chromium, {repeat} repeats)   median ms     max ms")
    print(f"{'run page load':26} {statistics.median(loads):10.1f} {max(loads):10.1f}")
    print(f"{'timeline zoom (swap)':26} {statistics.median(zooms):10.1f} {max(zooms):10.1f}")


if __name__ == "__main__":
    from benchmarks import run_script

    run_script(main)
