"""The group timeline as server-side SVG: one row per trajectory, clustered by group, groups in
completion order.

- spans are filled by phase with a colour *and* a pattern (stripes, dots, hatching, outline), so
  phases stay distinguishable without hue; the legend uses the same fills;
- a trajectory's policy version is marked where it changes (`v3` above the turn that first used it);
- weight publications are dashed vertical lines, batch deliveries solid ones, both labelled on the axis
  (in the header only where they would be closer than `MIN_LINE_GAP_PX` on average: they striped every
  row);
  the header's labels (batches, weight versions, time ticks) are each in a row of their own, thinned so
  that none runs into another, and drawn after every line over the header's colour, so however many
  marks cross the header no line strikes through a label;
- straggler groups get an amber band and a label; discarded groups a red band and their reason;
- a trajectory still running in a live run ends in a grey "in progress" span up to now;
- every span has an SVG <title>, so hovering shows its details.

Time zooms by `zoom` (pixels per second = zoom × the fit-to-width scale, 1 ≤ zoom ≤ 64; a non-finite
zoom is refused) and scrolls in the page's scroll container. The SVG's size is bounded whatever the
run: at most `MAX_SPANS` spans (whole groups) and `MAX_GROUPS` groups, and it says how many groups it
left out. Built as one string with no per-span template logic: 2,000 spans render in milliseconds
(benchmarks/render.py).
"""

from __future__ import annotations

import math
from html import escape
from urllib.parse import quote

from app.web.readmodel import GroupRow, RunView, Trajectory

GUTTER = 150
ROW_H = 11
ROW_GAP = 2
GROUP_GAP = 7
AXIS_H = 46  # three label rows: batches (y 10), weight versions (y 21), then the time ticks (y 34)
HEADER_FILL = "#f4f4f4"
BASE_WIDTH = 1100
MIN_WIDTH, MAX_WIDTH = 400, 8000  # the widths a page may ask for (its box's, at zoom 1)
MAX_SPANS = 6000  # beyond this, the latest groups only: the SVG stays a few hundred kB
MAX_GROUPS = 1000  # and at most this many groups: queued ones (no span yet) have no span to count
MAX_ZOOM = 64.0
MIN_WINDOW_S, MAX_WINDOW_S = 10.0, 31_536_000.0  # a window of the last so many seconds: 10 s to a year
MAX_TICKS = 1000  # the axis of the widest zoom has about 700
MIN_LINE_GAP_PX = 8.0  # batch and version lines closer than this on average are drawn in the header only

# phase -> (label, colour, pattern kind)
PHASE_STYLE: dict[str, tuple[str, str, str]] = {
    "reset": ("reset", "#7b4f9d", "diagonal"),
    "model_turn": ("model turn", "#2f6fbf", "solid"),
    "engine_wait": ("engine-slot wait", "#9cc3ee", "dots"),
    "tool_call": ("tool call", "#d9822b", "vertical"),
    "lane_queue": ("lane queue wait", "#c8c8c8", "cross"),
    "agent_gate": ("agent-phase gate wait", "#e8c66a", "dots"),
    "validate": ("validate", "#2e8b57", "grid"),
    "cleanup": ("cleanup", "#6b6b6b", "horizontal"),
    "group_running": ("group running", "#2f6fbf", "solid"),
    "group_ready": ("group ready", "#9fd4a8", "diagonal"),
    "in_progress": ("in progress", "#e4e4e4", "diagonal-back"),
}


def _pattern(phase: str) -> str:
    _, colour, kind = PHASE_STYLE[phase]
    ink = "#ffffff" if kind not in ("cross", "diagonal-back", "dots") else "#555555"
    marks = {
        "solid": "",
        "diagonal": f'<path d="M0,6 L6,0" stroke="{ink}" stroke-width="1.6"/>',
        "diagonal-back": f'<path d="M0,0 L6,6" stroke="{ink}" stroke-width="1"/>',
        "vertical": f'<path d="M3,0 L3,6" stroke="{ink}" stroke-width="1.4"/>',
        "horizontal": f'<path d="M0,3 L6,3" stroke="{ink}" stroke-width="1.4"/>',
        "grid": f'<path d="M0,0 L6,6 M6,0 L0,6" stroke="{ink}" stroke-width="0.9"/>',
        "cross": f'<path d="M0,0 L6,6 M6,0 L0,6" stroke="{ink}" stroke-width="0.7"/>',
        "dots": f'<circle cx="3" cy="3" r="1.2" fill="{ink}"/>',
    }[kind]
    return (
        f'<pattern id="pat-{phase}" patternUnits="userSpaceOnUse" width="6" height="6">'
        f'<rect width="6" height="6" fill="{colour}"/>{marks}</pattern>'
    )


DEFS = "<defs>" + "".join(_pattern(p) for p in PHASE_STYLE) + "</defs>"
STYLE = (
    "<style>"
    ".sp{stroke:#222;stroke-width:0.4}.sp:hover{stroke:#000;stroke-width:1.5}"
    ".lbl{font:10px sans-serif;fill:#222}.ax{font:10px sans-serif;fill:#333}"
    ".note{font:9px sans-serif;fill:#555}"
    ".ver{font:bold 8px sans-serif;fill:#000}.pub{stroke:#b00020;stroke-width:1.2;stroke-dasharray:4 3}"
    ".bat{stroke:#111;stroke-width:1}.tag{font:bold 10px sans-serif}"
    ".glink{fill:#1a56a8;text-decoration:underline}"
    "</style>"
)


def legend_html(phases: tuple[str, ...] | None = None) -> str:
    """Swatches with the timeline's fills and their labels, each item on its own so that the legend
    wraps at the page's width instead of scrolling."""
    names = phases or tuple(p for p in PHASE_STYLE if not p.startswith("group_"))
    svg = '<svg xmlns="http://www.w3.org/2000/svg" width="{}" height="14" aria-hidden="true">{}</svg>'
    items = [
        svg.format(22, f'<rect x="0" y="1" width="22" height="12" fill="url(#pat-{p})" class="sp"/>')
        + escape(PHASE_STYLE[p][0])
        for p in names
    ]
    for kind, label in (("pub", "weights published"), ("bat", "batch delivered")):
        items.append(svg.format(8, f'<line x1="4" y1="0" x2="4" y2="14" class="{kind}"/>') + label)
    defs = f'<svg xmlns="http://www.w3.org/2000/svg" class="legend-defs">{DEFS}{STYLE}</svg>'
    return defs + "".join(f'<span class="legend-item">{item}</span>' for item in items)


# Every reason a group is discarded with (app.core.scheduler.DiscardReason, and `orphaned` from
# app.service.recorder), as the timeline writes it on the group's row, and what it means.
DISCARD_REASONS: dict[str, str] = {
    "stale": "more than K versions behind, or could no longer meet K",
    "failed": "an attempt failed (its error in the row's hover)",
    "zero_variance": "every attempt got the same reward",
    "orphaned": "left open by a server that stopped, closed as the run resumed",
    "cancelled": "the run ended or was stopped (no fault)",
}


def discard_mark(reason: str) -> str:
    """The mark a discarded group's row carries: grey ■ for a cancelled one, red ✗ for the rest."""
    return "■" if reason == "cancelled" else "✗"


def discard_legend_html(reasons: list[str]) -> str:
    """Legend items for every discard reason, and for any other one in `reasons` (a report's rows can
    carry one Corral never writes), each as its row shows it."""
    extra = sorted({r for r in reasons if r not in DISCARD_REASONS})
    items = [*DISCARD_REASONS.items(), *((r, "as the report gives it") for r in extra)]
    return "".join(
        f'<span class="legend-item"><span><b style="color:{"#555555" if r == "cancelled" else "#a00000"}">'
        f"{discard_mark(r)} {escape(r)}</b>: {escape(meaning)}</span></span>"
        for r, meaning in items
    )


def _tick_step(duration: float, px_per_s: float) -> float:
    target = 90 / px_per_s  # about one tick per 90 px, however long the run (a replay's times are any)
    magnitude = 10 ** math.floor(math.log10(max(target, 1e-9)))
    for mult in (1, 2, 5, 10):
        if magnitude * mult >= target:
            return float(magnitude * mult)
    return float(magnitude * 10)


class _LabelRow:
    """One row of the header's labels (batches, weight versions, or time ticks) that never overlap: a
    label that would run into the one drawn before it is left out, and its line keeps the hover title
    that names it. The first and the last label are kept whenever they do not meet each other: the last
    displaces the drawn labels it would run into. A label's box is `ASCENT_PX` above its baseline to
    `DESCENT_PX` below; the rows' baselines are 11 px or more apart, so labels of different rows never
    meet either."""

    CHAR_PX = 6.4  # a digit of the axis font at its widest default (DejaVu Sans: 0.636 em of 10 px)
    GAP_PX = 4.0
    ASCENT_PX = 9
    DESCENT_PX = 2

    def __init__(self, y: int, right: float, fill: str = "") -> None:
        self.y = y
        self._right = right  # the SVG's width: a label at the right edge is drawn left of its mark
        # a style, not a fill attribute: the .ax class's fill outranks an attribute
        self._fill = f' style="fill:{fill}"' if fill else ""
        self._marks: list[tuple[float, str]] = []

    def add(self, x: float, label: str) -> None:
        """`label` for the mark at `x`; marks come left to right."""
        self._marks.append((min(x + 2, self._right - 1 - self.CHAR_PX * len(label)), label))

    def _end(self, left: float, label: str) -> float:
        return left + self.CHAR_PX * len(label) + self.GAP_PX

    def markup(self) -> str:
        """The labels that have room, each backed by the header's colour: drawn after the marks, it hides
        those that would cross it (hundreds of them on a long run at one screen's width) and leaves its
        own, just left of it, in view."""
        drawn: list[tuple[float, str]] = []
        for left, label in self._marks:
            if not drawn or left >= self._end(*drawn[-1]):
                drawn.append((left, label))
        if self._marks and drawn[-1] != self._marks[-1]:
            last = self._marks[-1]
            while len(drawn) > 1 and last[0] < self._end(*drawn[-1]):
                drawn.pop()
            if last[0] >= self._end(*drawn[-1]):
                drawn.append(last)
        h = self.ASCENT_PX + self.DESCENT_PX
        return "".join(
            f'<rect x="{_f(left - 1)}" y="{self.y - self.ASCENT_PX}" '
            f'width="{_f(self.CHAR_PX * len(label) + 2)}" height="{h}" fill="{HEADER_FILL}"/>'
            f'<text x="{_f(left)}" y="{self.y}" class="ax"{self._fill}>{escape(label)}</text>'
            for left, label in drawn
        )


def _f(x: float) -> str:
    return f"{x:.1f}"


def _waiting(row: tuple[GroupRow, list[Trajectory]]) -> bool:
    """An open group with no span yet (queued, or its first step still running)."""
    return row[0].outcome == "in flight" and not any(t.spans for t in row[1])


def _last_seen(row: tuple[GroupRow, list[Trajectory]]) -> float:
    """When a group was last seen at work: never done while it runs or waits to be delivered (inf),
    else its end, or its last span's if later."""
    group, trajs = row
    if group.outcome in ("in flight", "ready"):
        return math.inf
    return max([group.ended or 0.0, *(s.end for t in trajs for s in t.spans)])


def _latest(
    view: RunView, max_spans: int, max_groups: int, since: float | None = None
) -> tuple[list[tuple[GroupRow, list[Trajectory]]], int, int]:
    """The groups to draw, in the view's order (completion order, open ones last), how many of the
    waiting ones (`_waiting`) were left out, and how many groups there were to choose from: the last
    groups with spans that fit in `max_spans` spans and `max_groups` groups (at least one), then, in the
    groups left, the waiting ones, earliest admitted first (the next to start). With `since`, only the
    groups at work at or after it (`_last_seen`)."""
    rows = view.rows()
    if since is not None:
        rows = [row for row in rows if _last_seen(row) >= since]
    waiting = [i for i, row in enumerate(rows) if _waiting(row)]
    skip = set(waiting)
    kept: list[int] = []
    spans = 0
    for i in reversed(range(len(rows))):
        if i in skip:
            continue
        spans += sum(len(t.spans) for t in rows[i][1])
        if kept and (spans > max_spans or len(kept) >= max_groups):
            break
        kept.append(i)
    room = max(max_groups - len(kept), 0)
    kept += waiting[:room]
    return [rows[i] for i in sorted(kept)], len(waiting) - min(room, len(waiting)), len(rows)


def render_timeline(
    view: RunView,
    zoom: float = 1.0,
    width: int = BASE_WIDTH,
    max_spans: int = MAX_SPANS,
    max_groups: int = MAX_GROUPS,
    window_s: float | None = None,
) -> str:
    """The timeline SVG for `view`; `zoom` stretches time (the page scrolls it), clamped to [1, 64];
    a non-finite zoom is a ValueError. A run with more than `max_spans` spans or `max_groups` groups
    shows its latest groups only (waiting ones, earliest admitted first, in the groups left), from the
    earliest start among them, and says how many it left out. With `window_s`, the last `window_s`
    seconds up to now only: the groups at work in them, their spans cut at its start (the whole run when
    it is shorter)."""
    if not math.isfinite(zoom) or (window_s is not None and not (math.isfinite(window_s) and window_s > 0)):
        raise ValueError(f"zoom and window: must be finite numbers, window above 0, got {zoom}, {window_s}")
    zoom = min(max(zoom, 1.0), MAX_ZOOM)
    since = None if window_s is None or view.now <= window_s else view.now - window_s
    rows, waiting_left_out, candidates = _latest(view, max_spans, max_groups, since)
    shown = [t for _, trajs in rows for t in trajs]
    last = max((s.end for t in shown for s in t.spans), default=0.0)
    t_from = 0.0
    total = len(view.groups) + view.dropped_groups
    partial = len(rows) < total
    starts = [s.start for t in shown for s in t.spans] + [
        g.admitted for g, _ in rows if g.admitted is not None
    ]
    # a window with more at work in it than the span and group budgets allow shows its latest groups,
    # from the earliest start among them: from the window's start, its early part was left blank
    capped = since is not None and len(rows) < candidates
    if since is not None:
        t_from = max(since, min(starts, default=since)) if capped else since
    elif partial:
        t_from = min(starts, default=0.0)
    duration = max(max(view.now, last) - t_from, 1.0)
    px_per_s = (width - GUTTER - 20) / duration * zoom
    plot_w = duration * px_per_s
    total_w = int(GUTTER + plot_w + 20)
    x0 = GUTTER - t_from * px_per_s  # x of time 0

    out: list[str] = []
    y = AXIS_H
    pages = f"/runs/{quote(view.run_id, safe='')}/groups/"
    for group, trajs in rows:
        lines = trajs or [Trajectory(group.group_id, 0)]
        y = _group(out, group, lines, y, px_per_s, x0, view.now, plot_w, view.source == "live", t_from, pages)
        y += GROUP_GAP
    height = max(y, AXIS_H + 20)

    axis: list[str] = [f'<rect x="0" y="0" width="{total_w}" height="{AXIS_H - 4}" fill="{HEADER_FILL}"/>']
    step = _tick_step(duration, px_per_s)
    first = math.ceil(t_from / step)
    tick_labels = _LabelRow(AXIS_H - 12, total_w)
    # Counted, not summed: a step far below the run's times' resolution would never move `t` on.
    for i in range(min(math.floor((t_from + duration + 1e-9) / step) - first, MAX_TICKS) + 1):
        t = (first + i) * step
        x = x0 + t * px_per_s
        axis.append(f'<line x1="{_f(x)}" y1="{AXIS_H - 10}" x2="{_f(x)}" y2="{height}" stroke="#e6e6e6"/>')
        tick_labels.add(x, f"{t:g} s")
    batches = [b for b in view.batches if b.delivered >= t_from]
    publications = [(t, v) for t, v in view.publications if t >= t_from]
    # A long live run's view keeps its newest batches' rows (readmodel.BATCHES_KEPT): lines from before
    # the oldest kept are not drawn, and the timeline says from when it draws them.
    kept_from = max(
        view.batches[0].delivered if view.batches_dropped and view.batches else -math.inf,
        view.publications[0][0] if view.publications_dropped and view.publications else -math.inf,
    )
    lines_note = f"batch and version lines from {kept_from:.0f} s" if kept_from > t_from else ""
    # Lines closer than MIN_LINE_GAP_PX on average striped every row (a fast run's hundreds of batches
    # and versions at one screen's width): they stay in the header then, and zooming in brings them down.
    dense = plot_w / max(len(batches) + len(publications), 1) < MIN_LINE_GAP_PX
    line_end = AXIS_H - 4 if dense else height
    batch_labels = _LabelRow(10, total_w)
    for b in batches:
        x = x0 + b.delivered * px_per_s
        axis.append(
            f'<line x1="{_f(x)}" y1="2" x2="{_f(x)}" y2="{line_end}" class="bat">'
            f"<title>batch {b.index} delivered at {b.delivered:.1f} s after {b.wait_s:.1f} s of trainer wait"
            f"</title></line>"
        )
        batch_labels.add(x, f"b{b.index}")
    version_labels = _LabelRow(21, total_w, fill="#b00020")
    for t_pub, version in publications:
        x = x0 + t_pub * px_per_s
        axis.append(
            f'<line x1="{_f(x)}" y1="12" x2="{_f(x)}" y2="{line_end}" class="pub">'
            f"<title>weights v{version} published at {t_pub:.1f} s</title></line>"
        )
        version_labels.add(x, f"v{version}")
    live = view.source == "live" and view.outcome is None  # a run that goes on: the page follows its edge
    if view.source == "live":
        x = x0 + view.now * px_per_s
        axis.append(f'<line x1="{_f(x)}" y1="0" x2="{_f(x)}" y2="{height}" stroke="#000" stroke-width="2"/>')
    # drawn after every line, so that no line runs through a label
    axis += [row.markup() for row in (tick_labels, batch_labels, version_labels)]
    note = ""
    if partial or since is not None:
        which = "latest"
        if since is not None:
            which = f"last {window_s:.15g} s, cut to its latest" if capped else f"last {window_s:.15g} s:"
        left = total - len(rows)
        note = f"; the {which} {len(rows)} of {total} groups, from {t_from:.0f} s, {left} left out"
        if waiting_left_out:
            note += f" ({waiting_left_out} of them not started yet)"
        # In the gutter, a line each, so it never runs into the axis labels (the label keeps it whole)
        gutter = [
            f"{which} {len(rows)} of {total} groups",
            f"from {t_from:.0f} s; {total - len(rows)} left out",
        ]
        if waiting_left_out:
            gutter.append(f"({waiting_left_out} not started yet)")
        if lines_note:
            gutter.append(lines_note)
        for i, line in enumerate(gutter):
            axis.append(f'<text x="4" y="{9 + 10 * i}" class="note">{escape(line)}</text>')
    if lines_note:
        note += f"; {lines_note}"
    head = (
        f'<svg xmlns="http://www.w3.org/2000/svg" id="timeline-svg" role="img" '
        f'aria-label="group timeline: {len(view.trajectories)} trajectories, {view.span_count} spans{note}" '
        f'width="{total_w}" height="{height}" data-width="{width}" data-spans="{view.span_count}" '
        f'data-trajectories="{len(view.trajectories)}" data-groups-shown="{len(rows)}" '
        f'data-groups-left-out="{total - len(rows)}" data-live="{int(live)}" '
        f'data-lines="{"header" if dense else "rows"}">'
    )
    return head + DEFS + STYLE + "".join(axis) + "".join(out) + "</svg>"


def _group(
    out: list[str],
    group: GroupRow,
    trajs: list[Trajectory],
    y: int,
    px_per_s: float,
    x0: float,
    now: float,
    plot_w: float,
    live: bool,
    t_from: float,
    pages: str,
) -> int:
    """Draw `group`'s rows from `y`; its label links to its page (`pages` + its id). The next row's y."""
    h = len(trajs) * (ROW_H + ROW_GAP)
    status = group.outcome
    # A group cancelled because the run ended (or a stop) lost nothing to a fault: grey, not red.
    cancelled = group.outcome == "cancelled"
    if group.discarded:
        band = "#ececec" if cancelled else "#fde4e4"
        out.append(f'<rect x="0" y="{y - 1}" width="{GUTTER + plot_w}" height="{h + 1}" fill="{band}"/>')
    elif group.straggler:
        out.append(f'<rect x="0" y="{y - 1}" width="{GUTTER + plot_w}" height="{h + 1}" fill="#fff1c9"/>')
    tags = []
    if group.straggler:
        tags.append("straggler")
    if group.held_batch is not None:
        tags.append(f"held b{group.held_batch}")
    title = (
        f"group {group.group_id} ({escape(group.task)}): {escape(status)}"
        + (f" in batch {group.batch}" if group.batch is not None else "")
        + (f", staleness {group.staleness}" if group.staleness is not None else "")
        + (f" — {escape(group.detail)}" if group.detail else "")
    )
    out.append(
        f'<g class="grp" data-group="{group.group_id}"><title>{title}</title>'
        f'<a href="{pages}{group.group_id}"><text x="4" y="{y + ROW_H - 2}" class="lbl tag glink">'
        f"g{group.group_id}</text></a>"
    )
    if tags:
        colour = "#8a5a00"
        out.append(
            f'<text x="40" y="{y + ROW_H - 2}" class="lbl" fill="{colour}">{escape(", ".join(tags))}</text>'
        )
    if group.discarded:
        colour = "#555555" if cancelled else "#a00000"
        label = f"{discard_mark(group.outcome)} {escape(group.outcome)}"
        out.append(f'<text x="4" y="{y + 2 * ROW_H}" class="lbl tag" fill="{colour}">{label}</text>')
    for i, traj in enumerate(trajs):
        ry = y + i * (ROW_H + ROW_GAP)
        out.append(f'<text x="{GUTTER - 22}" y="{ry + ROW_H - 2}" class="lbl">a{traj.attempt}</text>')
        last_end = None
        for s in traj.spans:
            if s.end < t_from:  # before a window's start
                continue
            x = x0 + max(s.start, t_from) * px_per_s
            w = max((s.end - max(s.start, t_from)) * px_per_s, 0.8)
            out.append(
                f'<rect class="sp" x="{_f(x)}" y="{ry}" width="{_f(w)}" height="{ROW_H}" '
                f'fill="url(#pat-{s.phase})"><title>{PHASE_STYLE[s.phase][0]} '
                f"{s.start:.2f}–{s.end:.2f} s ({s.end - s.start:.2f} s), g{traj.group_id} a{traj.attempt}"
                f"{': ' + escape(s.detail) if s.detail else ''}</title></rect>"
            )
            last_end = s.end if last_end is None else max(last_end, s.end)
        if live and traj.finished is None and not group.discarded and group.ended is None:
            begin = last_end if last_end is not None else (traj.started or group.admitted or now)
            begin = max(begin, t_from)
            if now > begin:
                x = x0 + begin * px_per_s
                out.append(
                    f'<rect class="sp" x="{_f(x)}" y="{ry}" width="{_f((now - begin) * px_per_s)}" '
                    f'height="{ROW_H}" fill="url(#pat-in_progress)"><title>in progress since {begin:.2f} s '
                    f"(g{traj.group_id} a{traj.attempt})</title></rect>"
                )
        for n, (t_v, version) in enumerate(traj.versions):
            if n == 0 or t_v < t_from:
                continue
            x = x0 + t_v * px_per_s
            out.append(
                f'<path d="M{_f(x)},{ry} l3,-4 l-6,0 z" fill="#000"/>'
                f'<text x="{_f(x + 3)}" y="{ry + 1}" class="ver">v{version}</text>'
            )
    out.append("</g>")
    return y + h
