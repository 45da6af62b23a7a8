"""Small server-side SVG charts for the trainer panel and the wait attribution: bars, a histogram, a
line, and a stacked bar of phases. Each has a title and an accessible label; values are written on or
beside the marks, so none needs colour to be read.

A chart's size is bounded whatever the run: a per-step bar chart draws at most `MAX_BARS` bars and a
line at most `MAX_POINTS` points. A longer run's steps are bucketed, k consecutive steps a bar (k as
small as the series' buckets allow, app.web.series): the bar is their mean, a tick marks their max,
and the chart's title and axis say so (a 1,260-batch run drew 1,260 bars a quarter of a pixel wide,
377 kB in every live update)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from html import escape
from typing import Any

from app.core.attribution import PHASE_LABELS
from app.web.series import Bucket, Series

W, H = 360, 150
MAX_BINS = 24  # a histogram's bars at most: wider ranges are binned
MAX_BARS = 100  # a per-step bar chart's bars at most (three pixels each): longer runs are bucketed
MAX_POINTS = 100  # a line's points at most: longer lines are bucketed
PAD_L, PAD_R, PAD_T, PAD_B = 44, 10, 22, 26

# Attribution phases share the timeline's fills where the phase exists there.
PHASE_FILL = {
    "admission": "#f0e0a0",
    "handoff": "#dddddd",
    "restart": "#b00020",
    "update_pause": "#e0457b",
    "engine_outage": "#5a0010",
    "model_turn": "url(#pat-model_turn)",
    "engine_wait": "url(#pat-engine_wait)",
    "lane_queue": "url(#pat-lane_queue)",
    "agent_gate": "#e8c66a",
    "reset": "url(#pat-reset)",
    "tool_call": "url(#pat-tool_call)",
    "validate": "url(#pat-validate)",
    "cleanup": "url(#pat-cleanup)",
    "agent": "#f7f7f7",
}


def _head(title: str, w: int = W, h: int = H, note: str = "") -> str:
    """The chart's frame, its title and accessible label; `note` (how its marks were bucketed) goes in
    the title and the label, not in the title row, where there is no room for it beside a reference."""
    full = f"{title}: {note}" if note else title
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" role="img" aria-label="{escape(full)}" '
        f'width="{w}" height="{h}" class="chart"><title>{escape(full)}</title>'
        f'<text x="4" y="14" style="font:bold 12px sans-serif">{escape(title)}</text>'
    )


def _axis(top: float, unit: str, bottom: float = 0.0) -> str:
    """The axes, with 0 and the top value written level with the heights they mark (and a faint line
    at the top value), so a mark at the top reads as that value, not above it. With `bottom` below 0
    (a reward), the axis runs from it, written at the foot, and 0 is a line across the chart."""
    y0, y1 = H - PAD_B, PAD_T
    parts = [
        f'<line x1="{PAD_L}" y1="{y1}" x2="{W - PAD_R}" y2="{y1}" stroke="#e6e6e6"/>',
        f'<line x1="{PAD_L}" y1="{y0}" x2="{W - PAD_R}" y2="{y0}" stroke="#444"/>',
        f'<line x1="{PAD_L}" y1="{y0}" x2="{PAD_L}" y2="{y1}" stroke="#444"/>',
        f'<text x="{PAD_L - 4}" y="{y1 + 3.5}" {_SMALL_END}>{_num(top)}{unit}</text>',
    ]
    if bottom < 0:
        zero = y0 - (0 - bottom) / (top - bottom) * (y0 - y1)
        parts += [
            f'<line x1="{PAD_L}" y1="{zero:.1f}" x2="{W - PAD_R}" y2="{zero:.1f}" stroke="#444"/>',
            f'<text x="{PAD_L - 4}" y="{zero + 3.5:.1f}" {_SMALL_END}>0{unit}</text>',
            f'<text x="{PAD_L - 4}" y="{y0 + 3.5}" {_SMALL_END}>{_num(bottom)}{unit}</text>',
        ]
    else:
        parts.append(f'<text x="{PAD_L - 4}" y="{y0 + 3.5}" {_SMALL_END}>0{unit}</text>')
    return "".join(parts)


_SMALL_END = 'text-anchor="end" style="font:10px sans-serif"'
# a white outline under a label drawn over the bars, so it reads on blue as on white
_HALO = 'stroke="#fff" stroke-width="3" paint-order="stroke"'
_SMALL_MID = 'text-anchor="middle" style="font:10px sans-serif"'


def _label_width(text: str) -> float:
    """About how wide `text` is in the charts' 10 px sans-serif (0.56 em a character)."""
    return 5.6 * len(text)


def _mid_x(x: float, text: str, char_px: float = 5.6) -> float:
    """Where a middle-anchored label centred at `x` goes so that it stays inside the chart: the last
    step's label at the right edge was cut (`1079` for `10989`)."""
    half = char_px * len(text) / 2
    return min(max(x, half + 1), W - half - 1)


def _num(v: float) -> str:
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"


def _empty(title: str, note: str = "no data yet") -> str:
    """A chart with nothing to draw says so: `note` is "no data yet" for a run that may still bring
    some, or why it never will (a replayed report that does not carry it)."""
    text = f'<text x="{PAD_L}" y="{H / 2}" style="font:11px sans-serif">{escape(note)}</text>'
    return _head(title) + text + "</svg>"


def _x_label(text: str) -> str:
    """What the horizontal axis counts, under its tick labels."""
    if not text:
        return ""
    x = PAD_L + (W - PAD_L - PAD_R) / 2
    return (
        f'<text x="{x:.1f}" y="{H - 3}" text-anchor="middle" style="font:10px sans-serif" fill="#444">'
        f"{escape(text)}</text>"
    )


def _per_bucket(n: int, most: int) -> int:
    """How many consecutive items go in a bucket so that `n` items make at most `most` buckets."""
    return max(1, math.ceil(n / most))


def bar_chart(
    title: str,
    labels: Sequence[str] | Series,
    values: Sequence[float] = (),
    unit: str = "",
    reference: float | None = None,
    reference_label: str = "",
    x_label: str = "",
    empty: str = "no data yet",
    max_bars: int = MAX_BARS,
    items: str = "steps",
    hover: Callable[[Bucket], str] | None = None,
) -> str:
    """Bars of `values`, one a label, or of a series' first value (`labels` a `Series`), labelled underneath,
    every n-th bar where all would not fit side by side (a long run's trainer steps: past 24 bars none was
    labelled); `x_label` says what the labels are (a trainer step, a staleness). Past `max_bars` items, k
    consecutive ones (`items`, k as small as the series' buckets allow) make a bar: their mean, with a tick at
    their max, labelled with the first one's label; the title and `x_label` say so. `hover` of a bar's bucket
    replaces what a bar of one item says on hover, and is added to what a bar of several says. A value below 0
    (a reward) hangs below a 0 line, and the axis runs down to the least bar."""
    series = labels if isinstance(labels, Series) else _series(zip(labels, values, strict=True))
    if not len(series):
        return _empty(title, empty)
    k, bars = series.marks(max_bars)
    note = f"a bar is the mean of {k} {items}, its tick their max" if k > 1 else ""
    if k > 1:
        x_label = f"{x_label} ({k} a bar: the mean; a tick at the max)".lstrip()
    means = [b.stats[0].total / b.stats[0].n for b in bars]
    maxes = [b.stats[0].most for b in bars]
    firsts = [str(b.first) for b in bars]
    bottom = min(0.0, *means)
    top = max([*maxes, reference or 0.0, 0.0])
    if top == bottom:
        top = bottom + 1.0
    span_w = (W - PAD_L - PAD_R) / len(bars)
    every = math.ceil((max(_label_width(label) for label in firsts) + 4) / span_w)
    plot_h = H - PAD_T - PAD_B
    parts = [_head(title, note=note), _axis(top, unit, bottom), _x_label(x_label)]

    def y_of(v: float) -> float:
        return H - PAD_B - (v - bottom) / (top - bottom) * plot_h

    for i, (label, bar, v, most) in enumerate(zip(firsts, bars, means, maxes, strict=True)):
        y, h = y_of(max(v, 0.0)), abs(v) / (top - bottom) * plot_h
        x = PAD_L + i * span_w + 1
        w = max(span_w - 2, 1)
        if bar.n == 1:
            said = escape(hover(bar)) if hover is not None else f"{escape(label)}: {_num(v)}{unit}"
        else:
            said = f"{escape(label)}–{escape(str(bar.last))}: mean {_num(v)}{unit}, max {_num(most)}{unit}"
            if hover is not None:
                said += escape(hover(bar))
        parts.append(
            f'<rect x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{h:.1f}" '
            f'fill="#4a78b5"><title>{said}</title></rect>'
        )
        if most > v:
            y = y_of(most)
            parts.append(
                f'<line x1="{x:.1f}" y1="{y:.1f}" x2="{x + w:.1f}" y2="{y:.1f}" stroke="#1b3a66" '
                f'stroke-width="1.5"/>'
            )
        if i % every == 0:
            parts.append(
                f'<text x="{_mid_x(x + span_w / 2, label, 5.04):.1f}" y="{H - PAD_B + 11}" '
                f'text-anchor="middle" style="font:9px sans-serif">{escape(label)}</text>'
            )
    if reference is not None:
        # The line crosses the bars; its label goes in the title row, after a sample of the line, where
        # no bar reaches it (drawn beside the line it sat on the last bars).
        y = y_of(reference)
        label = escape(reference_label)
        parts.append(
            f'<line x1="{PAD_L}" y1="{y:.1f}" x2="{W - PAD_R}" y2="{y:.1f}" stroke="#b00020" '
            f'stroke-dasharray="5 3" stroke-width="1.5"><title>{label}</title></line>'
            f'<text x="{W - PAD_R}" y="14" text-anchor="end" style="font:10px sans-serif" '
            f'fill="#b00020">{label}</text>'
            f'<line x1="{W - PAD_R - _label_width(reference_label) - 22}" y1="10.5" '
            f'x2="{W - PAD_R - _label_width(reference_label) - 4}" y2="10.5" stroke="#b00020" '
            f'stroke-dasharray="5 3" stroke-width="1.5"/>'
        )
    return "".join(parts) + "</svg>"


def _series(items: Iterable[tuple[Any, ...]]) -> Series:
    """A series of (label, value, ...) items."""
    series = Series()
    for label, *values in items:
        series.add(label, *values)
    return series


def _bin_width(lo: int, hi: int) -> int:
    """The smallest 1-2-5 width (1, 2, 5, 10, 20, ...) that covers `lo`..`hi` in `MAX_BINS` bins."""
    magnitude = 1
    while True:
        for mult in (1, 2, 5):
            width = magnitude * mult
            if (hi // width - lo // width) + 1 <= MAX_BINS:
                return width
        magnitude *= 10


def histogram(
    title: str,
    counts: Mapping[int, int],
    x_label: str = "",
    empty: str = "no data yet",
    from_zero: bool = True,
) -> str:
    """How many of each whole number (a staleness), on an axis that runs evenly from 0 (or the least, if
    below; with `from_zero` False, the least: durations that all run long would crowd the right) to the
    largest: a bar a number, labelled under its middle, while that is at most `MAX_BINS`
    bars, else a bar for each run of numbers of a 1-2-5 width, labelled with its first number at its
    left edge (0 to 116: 24 bars of five, "0, 10, 20, ..."). Every n-th bar is labelled, n as small as
    keeps the labels apart. (As a bar chart of the numbers present, 0 to 116 drew ~30 bars a pixel
    wide, the 3 tallest at the far left, and, past 24 bars, no label at all.)"""
    if not counts:
        return _empty(title, empty)
    lo, hi = min(0, *counts) if from_zero else min(counts), max(counts)
    width = _bin_width(lo, hi)
    first = lo // width
    bins = [0] * (hi // width - first + 1)
    for value, n in counts.items():
        bins[value // width - first] += n
    starts = [(first + i) * width for i in range(len(bins))]
    top = max(bins) or 1
    span_w = (W - PAD_L - PAD_R) / len(bins)
    every = math.ceil((max(_label_width(str(a)) for a in starts) + 4) / span_w)
    plot_h, y0 = H - PAD_T - PAD_B, H - PAD_B
    parts = [_head(title), _axis(top, ""), _x_label(x_label)]
    for i, (start, n) in enumerate(zip(starts, bins, strict=True)):
        h = n / top * plot_h
        x = PAD_L + i * span_w
        span = str(start) if width == 1 else f"{start}–{start + width - 1}"
        parts.append(
            f'<rect x="{x + 1:.1f}" y="{y0 - h:.1f}" width="{max(span_w - 2, 1):.1f}" height="{h:.1f}" '
            f'fill="#4a78b5"><title>{span}: {n:,}</title></rect>'
        )
        if i % every:
            continue
        if width > 1:
            parts.append(f'<line x1="{x:.1f}" y1="{y0}" x2="{x:.1f}" y2="{y0 + 3}" stroke="#444"/>')
        at = x + span_w / 2 if width == 1 else x
        parts.append(f'<text x="{_mid_x(at, str(start)):.1f}" y="{y0 + 11}" {_SMALL_MID}>{start}</text>')
    return "".join(parts) + "</svg>"


def line_chart(
    title: str,
    points: Sequence[tuple[float, float]] | Series,
    unit: str = "",
    top: float | None = None,
    x_label: str = "",
    empty: str = "no data yet",
    max_points: int = MAX_POINTS,
    items: str = "points",
) -> str:
    """A line over time (seconds from 0, marked at both ends) of `points` (time, value), or of a series
    labelled by time, its values (time, value); `x_label` says what the time is. Past `max_points` points, k
    consecutive ones (`items`) make a point: their mean time and mean value, its hover naming their span and
    max; the title and `x_label` say so."""
    series = points if isinstance(points, Series) else _series((t, t, v) for t, v in points)
    if not len(series):
        return _empty(title, empty)
    top = top if top is not None else (max(b.stats[1].most for b in series) or 1.0)
    t_max = max(b.stats[0].most for b in series) or 1.0
    plot_w, plot_h = W - PAD_L - PAD_R, H - PAD_T - PAD_B
    k, marks_of = series.marks(max_points)
    note = f"a point is the mean of {k} {items}" if k > 1 else ""
    if k > 1:
        x_label = f"{x_label} (a point: the mean of {k})".lstrip()

    def xy(t: float, v: float) -> str:
        return f"{PAD_L + t / t_max * plot_w:.1f},{H - PAD_B - v / top * plot_h:.1f}"

    marks: list[tuple[float, float, str]] = []  # t, v, hover
    for p in marks_of:
        t, v = p.stats[0].total / p.n, p.stats[1].total / p.n
        if p.n == 1:
            marks.append((t, v, f"{t:.1f} s: {_num(v)}{unit}"))
            continue
        most = p.stats[1].most
        said = f"{p.first:.1f}–{p.last:.1f} s: mean {_num(v)}{unit}, max {_num(most)}{unit}"
        marks.append((t, v, said))
    path = " ".join(xy(t, v) for t, v, _ in marks)
    dots = "".join(
        f'<circle cx="{xy(t, v).split(",")[0]}" cy="{xy(t, v).split(",")[1]}" r="2.5" fill="#4a78b5">'
        f"<title>{said}</title></circle>"
        for t, v, said in marks
    )
    return (
        _head(title, note=note)
        + _axis(top, unit)
        + f'<polyline points="{path}" fill="none" stroke="#4a78b5" stroke-width="2"/>'
        + dots
        + f'<text x="{PAD_L}" y="{H - PAD_B + 11}" {_SMALL_MID}>0 s</text>'
        + f'<text x="{W - PAD_R}" y="{H - PAD_B + 11}" {_SMALL_END}>{t_max:.0f} s</text>'
        + _x_label(x_label)
        + "</svg>"
    )


def phase_bar(phases: dict[str, float], width: int = 720, title: str = "where the wait went") -> str:
    """One stacked horizontal bar of phase shares, labelled in place when wide enough."""
    total = sum(phases.values())
    if total <= 0:
        return ""
    x = 0.0
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" role="img" aria-label="{escape(title)}" '
        f'width="{width}" height="26" viewBox="0 0 {width} 26" class="phase-bar">'
    ]
    for phase, s in sorted(phases.items(), key=lambda ps: -ps[1]):
        if s <= 0:
            continue
        w = s / total * width
        label = f"{PHASE_LABELS[phase]} {s / total:.0%}"
        parts.append(
            f'<rect x="{x:.1f}" y="2" width="{w:.1f}" height="22" fill="{PHASE_FILL[phase]}" stroke="#222" '
            f'stroke-width="0.5"><title>{escape(label)} ({s:.1f} s)</title></rect>'
        )
        if w > 7 * len(label):
            parts.append(
                f'<text x="{x + 4:.1f}" y="17" style="font:bold 11px sans-serif" fill="#000" '
                f'stroke="#fff" stroke-width="3" paint-order="stroke">{escape(label)}</text>'
            )
        x += w
    return "".join(parts) + "</svg>"
