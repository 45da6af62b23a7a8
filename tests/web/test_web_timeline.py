import itertools
import math
import re
import xml.etree.ElementTree as ET
from dataclasses import replace
from html import escape

import pytest

from app.web.readmodel import GroupRow, view_from_events
from app.web.synthetic import synthetic_run
from app.web.timeline import (
    AXIS_H,
    DISCARD_REASONS,
    GUTTER,
    MAX_GROUPS,
    PHASE_STYLE,
    _LabelRow,
    discard_legend_html,
    legend_html,
    render_timeline,
)

SVG = "{http://www.w3.org/2000/svg}"


def make_view(**overrides):
    return view_from_events("run-1", synthetic_run(**overrides), source=overrides.pop("source", "replay"))


def with_queued(view, n):
    """`view` as a live run with `n` more open groups admitted one by one after it, none started yet."""
    queued = [GroupRow(10_000 + i, task="t", admitted=view.now + i) for i in range(n)]
    return replace(view, source="live", now=view.now + n, groups=view.groups + queued)


def test_every_span_is_a_rect_with_a_title_and_a_patterned_fill():
    view = make_view(groups=8, group_size=2, batch_groups=2)
    root = ET.fromstring(render_timeline(view))
    spans = [r for r in root.iter(f"{SVG}rect") if r.get("class") == "sp"]
    assert len(spans) == view.span_count
    assert all(r.find(f"{SVG}title") is not None for r in spans)
    fills = {r.get("fill") for r in spans}
    assert fills <= {f"url(#pat-{p})" for p in PHASE_STYLE}
    patterns = {p.get("id") for p in root.iter(f"{SVG}pattern")}
    assert {f"pat-{p}" for p in PHASE_STYLE} == patterns


def test_publications_batches_and_version_changes_are_marked():
    view = make_view(groups=8, group_size=2, batch_groups=2)
    svg = render_timeline(view)
    assert len(re.findall(r'class="pub"', svg)) == len(view.publications)
    assert len(re.findall(r'class="bat"', svg)) == len(view.batches)
    changes = sum(len(t.versions) - 1 for t in view.trajectories.values())
    assert changes > 0
    assert len(re.findall(r'class="ver"', svg)) == changes


def test_stragglers_and_discarded_groups_are_labelled():
    view = make_view(groups=10, group_size=2, batch_groups=4)  # 2 groups left over: discarded, cancelled
    svg = render_timeline(view)
    discarded = [g for g in view.groups if g.discarded]
    assert discarded
    assert svg.count("■ cancelled") == len(discarded)
    stragglers = [g for g in view.groups if g.straggler]
    assert svg.count("straggler") >= len(stragglers)


def test_zoom_stretches_time():
    view = make_view(groups=4, group_size=2, batch_groups=2)
    width = [float(ET.fromstring(render_timeline(view, zoom)).get("width")) for zoom in (1, 4)]
    assert width[1] > 3 * width[0] - 200


def test_live_trajectories_end_in_an_in_progress_span_up_to_now():
    events = synthetic_run(groups=4, group_size=2, batch_groups=2)
    cut = len(events) // 3  # the run as it was a third of the way through
    view = view_from_events("run-1", events[:cut], source="live")
    svg = render_timeline(view)
    open_trajs = [
        t for t in view.trajectories.values() if t.finished is None and max(s.end for s in t.spans) < view.now
    ]
    assert open_trajs
    assert svg.count("in progress since") == len(open_trajs)


def test_legend_names_every_phase():
    legend = legend_html()
    for p, (label, _, _) in PHASE_STYLE.items():
        if not p.startswith("group_"):
            assert label in legend


def test_a_large_run_shows_its_latest_groups_within_the_span_budget():
    view = make_view(groups=24, group_size=4, batch_groups=4)
    svg = render_timeline(view, max_spans=300)
    root = ET.fromstring(svg)
    shown = int(root.get("data-groups-shown"))
    assert 0 < shown < len(view.groups)
    spans = [r for r in root.iter(f"{SVG}rect") if r.get("class") == "sp"]
    assert len(spans) <= 300 + 60  # whole groups: the last one may cross the budget by its spans
    latest = [g.group_id for g, _ in view.rows()[-shown:]]
    assert [int(g.get("data-group")) for g in root.iter(f"{SVG}g")] == latest
    assert f"the latest {shown} of {len(view.groups)} groups" in svg
    assert min(float(r.get("x")) for r in spans) >= 150 - 1  # time starts at the first shown span


@pytest.mark.timeout(30)
@pytest.mark.parametrize("late", [1e9, 1e15, 1e308])
def test_a_replay_with_a_far_off_time_renders_an_axis_of_a_few_ticks(late):
    # The tick step was floored at 90 ns-per-px's worth: a run 1e15 s long drew 10,000 ticks, and 1e308
    # s never finished (a page of a loaded report hung its worker thread).
    view = make_view(groups=4, group_size=2, batch_groups=2)
    root = ET.fromstring(render_timeline(replace(view, now=late)))
    ticks = [t for t in root.iter(f"{SVG}text") if t.get("class") == "ax"]
    assert 2 <= len(ticks) <= 30


@pytest.mark.parametrize("zoom", [math.nan, math.inf, -math.inf])
def test_a_non_finite_zoom_is_refused(zoom):
    with pytest.raises(ValueError, match="zoom"):
        render_timeline(make_view(groups=4, group_size=2, batch_groups=2), zoom)


def test_queued_groups_are_capped_after_the_started_ones_and_counted():
    base = make_view(groups=8, group_size=2, batch_groups=2)
    view = with_queued(base, 100)
    svg = render_timeline(view, max_groups=20)
    root = ET.fromstring(svg)
    shown = [int(g.get("data-group")) for g in root.iter(f"{SVG}g")]
    started = [g.group_id for g in base.groups]
    # every group with spans, then the queued ones admitted first (the next to start)
    assert sorted(shown) == sorted(started + list(range(10_000, 10_012)))
    assert root.get("data-groups-shown") == "20"
    assert root.get("data-groups-left-out") == "88"
    assert re.search(
        r"the latest 20 of 108 groups, from \d+ s, 88 left out \(88 of them not started yet\)", svg
    )


def test_a_run_with_many_queued_groups_renders_at_most_max_groups():
    view = with_queued(make_view(groups=8, group_size=2, batch_groups=2), MAX_GROUPS + 500)
    root = ET.fromstring(render_timeline(view))
    assert len(list(root.iter(f"{SVG}g"))) == MAX_GROUPS
    assert root.get("data-groups-left-out") == str(len(view.groups) - MAX_GROUPS)


def test_the_group_cap_keeps_the_latest_groups_with_spans():
    view = make_view(groups=24, group_size=2, batch_groups=4)
    root = ET.fromstring(render_timeline(view, max_groups=5))
    latest = [g.group_id for g, _ in view.rows()[-5:]]
    assert [int(g.get("data-group")) for g in root.iter(f"{SVG}g")] == latest
    assert f"the latest 5 of {len(view.groups)} groups" in root.get("aria-label")


def _axis_labels(svg: str, prefix: str) -> list[tuple[float, str]]:
    root = ET.fromstring(svg)
    return [
        (float(t.get("x")), t.text)
        for t in root.iter(f"{SVG}text")
        if t.get("class") == "ax" and t.text and re.fullmatch(prefix + r"\d+", t.text)
    ]


@pytest.mark.parametrize("prefix", ["b", "v"])
def test_batch_and_version_labels_never_overlap_and_zooming_in_shows_more(prefix):
    view = make_view(groups=120, group_size=2, batch_groups=2)  # 60 batches across one screen width
    marks = len(view.batches) if prefix == "b" else len(view.publications)
    counts = []
    for zoom in (1, 64):
        svg = render_timeline(view, zoom, max_spans=10**6, max_groups=10**6)
        assert len(re.findall(r'class="bat"' if prefix == "b" else r'class="pub"', svg)) == marks
        labels = _axis_labels(svg, prefix)
        for (x1, t1), (x2, _) in itertools.pairwise(labels):
            assert x2 >= x1 + 6 * len(t1), f"{t1} at {x1} runs into the next label at {x2}"
        counts.append(len(labels))
    assert counts[0] < marks  # at one screen's width some labels had no room
    assert counts[1] > counts[0]


def _header_label_boxes(root: ET.Element) -> list[tuple[int, str, tuple[float, float, float, float]]]:
    """Each text drawn in the header, with its place among the SVG's elements and its box (left, top,
    right, bottom), as wide as the timeline reckons a label (`_LabelRow.CHAR_PX` a character) and as high
    as the 10 px font's digits and lower case (9 px above the baseline, 2 below)."""
    return [
        (i, el.text, (x, y - 9, x + _LabelRow.CHAR_PX * len(el.text), y + 2))
        for i, el in enumerate(root)
        if el.tag == f"{SVG}text" and el.text and el.get("class") == "ax"
        for x, y in [(float(el.get("x")), float(el.get("y")))]
        if y < AXIS_H
    ]


def _crosses(line: ET.Element, box: tuple[float, float, float, float]) -> bool:
    left, top, right, bottom = box
    x, y1, y2 = float(line.get("x1")), float(line.get("y1")), float(line.get("y2"))
    return left - 1 < x < right and y1 < bottom and y2 > top


def _covers(rect: ET.Element, box: tuple[float, float, float, float]) -> bool:
    left, top, right, bottom = box
    x, y = float(rect.get("x", 0)), float(rect.get("y", 0))
    w, h = float(rect.get("width")), float(rect.get("height"))
    return x <= left - 1 and x + w >= right and y <= top and y + h >= bottom


def test_a_long_run_s_header_labels_neither_overlap_nor_are_struck_through_by_its_marks():
    # 700 batches and as many publications across one screen width: the rows of labels were thinned,
    # but every batch and publication line was drawn over them, through the time ticks too, and the
    # header read as a wall of struck-through "b548 v548" (a user's screenshot).
    view = make_view(groups=1400, group_size=2, batch_groups=2)
    svg = render_timeline(view, max_spans=10**6, max_groups=10**6)
    root = ET.fromstring(svg)
    elements = list(root)
    assert sum(el.get("class") == "bat" for el in elements) == len(view.batches) == 700
    assert sum(el.get("class") == "pub" for el in elements) == len(view.publications) == 700
    labels = _header_label_boxes(root)
    texts = [text for _, text, _ in labels]
    ticks = [t for t in texts if t.endswith(" s")]
    assert len(ticks) >= 8  # one about every 90 px, every one of them written
    assert 10 < sum(t.startswith("b") for t in texts) < 700  # thinned, not dropped
    assert 10 < sum(t.startswith("v") for t in texts) < 700
    for (_, t1, (l1, t1_, r1, b1)), (_, t2, (l2, t2_, r2, b2)) in itertools.combinations(labels, 2):
        assert not (l1 < r2 and l2 < r1 and t1_ < b2 and t2_ < b1), f"{t1} overlaps {t2}"
    for i, text, box in labels:
        for j, line in enumerate(elements):
            if line.tag != f"{SVG}line" or not _crosses(line, box):
                continue
            covered = any(
                el.tag == f"{SVG}rect" and el.get("fill") not in (None, "none") and _covers(el, box)
                for el in elements[j + 1 : i]
            )
            assert covered, f"a line at x={line.get('x1')} strikes through {text}"


def test_a_cancelled_group_reads_apart_from_a_failed_one():
    # Every discarded group had a red band and a red ✗: an ended run's cancelled groups (a stop, the
    # run's end) looked like faults. Cancelled is grey with ■; failed and stale stay red with ✗.
    view = make_view(groups=4, group_size=2, batch_groups=2)
    cancelled, failed, stale = (
        replace(view.groups[i], outcome=o) for i, o in enumerate(("cancelled", "failed", "stale"))
    )
    view = replace(view, groups=[cancelled, failed, stale, *view.groups[3:]])
    root = ET.fromstring(render_timeline(view))
    bands = [r.get("fill") for r in root.iter(f"{SVG}rect") if r.get("fill") in ("#ececec", "#fde4e4")]
    assert bands == ["#ececec", "#fde4e4", "#fde4e4"]
    labels = {t.text: t.get("fill") for t in root.iter(f"{SVG}text") if t.text and t.text[:1] in "■✗"}
    assert labels == {"■ cancelled": "#555555", "✗ failed": "#a00000", "✗ stale": "#a00000"}


def _header_rows(svg: str) -> dict[str, list[tuple[float, str]]]:
    """The header's drawn labels by row (batches, versions, ticks), each with its left edge."""
    rows: dict[str, list[tuple[float, str]]] = {"b": [], "v": [], "s": []}
    for t in ET.fromstring(svg).iter(f"{SVG}text"):
        if t.get("class") == "ax" and t.text and float(t.get("y")) < AXIS_H:
            kind = "s" if t.text.endswith(" s") else t.text[0]
            rows[kind].append((float(t.get("x")), t.text))
    return rows


DEJAVU_DIGIT_PX = 6.36  # Chromium's default sans-serif on Linux: a digit or "b" is 0.636 em of 10 px


@pytest.mark.parametrize("zoom", [1, 2, 4, 8, 16, 32, 64])
def test_header_labels_never_overlap_and_keep_the_first_and_last_at_every_zoom(zoom):
    # A demo run of many batches at ×1: the labels were thinned from the left only, so the newest
    # batch's or version's label could be left out (or run past the SVG's right edge), and they were
    # reckoned 6 px a character, narrower than the browser's default font draws them.
    view = make_view(groups=150, group_size=2, batch_groups=2)
    svg = render_timeline(view, zoom, max_spans=10**6, max_groups=10**6)
    width = float(ET.fromstring(svg).get("width"))
    rows = _header_rows(svg)
    for labels in rows.values():
        for (x1, t1), (x2, _) in itertools.pairwise(labels):
            assert x2 >= x1 + DEJAVU_DIGIT_PX * len(t1) + 2, f"{t1} at {x1} runs into the next label at {x2}"
        assert all(x + DEJAVU_DIGIT_PX * len(t) <= width for x, t in labels)
    assert rows["b"][0][1] == "b0"
    assert rows["b"][-1][1] == f"b{view.batches[-1].index}"
    assert rows["v"][0][1] == f"v{view.publications[0][1]}"
    assert rows["v"][-1][1] == f"v{view.publications[-1][1]}"


def test_the_last_label_displaces_the_ones_it_would_run_into():
    row = _LabelRow(10, right=1000)
    for x, label in [(0, "b0"), (30, "b1"), (60, "b2"), (70, "b3")]:
        row.add(x, label)
    texts = re.findall(r">(b\d+)</text>", row.markup())
    assert texts == ["b0", "b1", "b3"]  # b2 had room, but b3 is the newest
    crowded = _LabelRow(10, right=1000)
    crowded.add(0, "b0")
    crowded.add(5, "b1")
    assert re.findall(r">(b\d+)</text>", crowded.markup()) == ["b0"]  # the first, when both cannot be


@pytest.mark.parametrize("width", [400, 1100, 1600, 3000])
def test_the_plot_fills_the_width_asked_for(width):
    # The page's box is wider than the 1,100 px the timeline was always drawn at, so the plot stopped
    # short of the box's right edge; the page now asks for its box's width.
    view = make_view(groups=8, group_size=2, batch_groups=2)
    root = ET.fromstring(render_timeline(view, width=width))
    assert float(root.get("width")) == width
    assert root.get("data-width") == str(width)
    last = max(s.end for t in view.trajectories.values() for s in t.spans)
    ends = [
        float(r.get("x")) + float(r.get("width")) for r in root.iter(f"{SVG}rect") if r.get("class") == "sp"
    ]
    # time runs from 0 at the gutter to the run's end 20 px short of the edge (a span is 0.8 px or more)
    assert max(ends) == pytest.approx(GUTTER + last / max(view.now, last) * (width - GUTTER - 20), abs=1)


def test_every_discard_reason_a_row_shows_is_in_the_legend():
    # An orphaned group (a server restarted under its run) showed "✗ orphaned", which the legend never
    # explained; so could a report's own reason.
    view = make_view(groups=8, group_size=2, batch_groups=2)
    reasons = ["stale", "failed", "cancelled", "zero_variance", "orphaned", "lost in transit"]
    groups = [replace(g, outcome=r) for g, r in zip(view.groups, reasons, strict=False)]
    view = replace(view, groups=groups + view.groups[len(reasons) :])
    shown = {
        t.text
        for t in ET.fromstring(render_timeline(view)).iter(f"{SVG}text")
        if t.text and t.text[:1] in "■✗"
    }
    assert len(shown) == len(reasons)
    legend = discard_legend_html([g.outcome for g in view.groups if g.discarded])
    for label in shown:
        assert f">{escape(label)}</b>" in legend
    assert set(DISCARD_REASONS) <= {label[2:] for label in shown}  # every reason Corral writes is known


def test_a_window_shows_the_groups_at_work_in_its_last_seconds_cut_at_its_start():
    """At one screen's width a long run squeezed its newest groups into slivers at the right edge, and
    the page opened at its oldest groups: an operator could not see the last few minutes."""
    view = make_view(groups=24, group_size=2, batch_groups=2)
    window = view.now / 4
    since = view.now - window
    root = ET.fromstring(render_timeline(view, window_s=window))
    at_work = [
        g.group_id
        for g, trajs in view.rows()
        if max((s.end for t in trajs for s in t.spans), default=0) >= since
    ]
    assert 0 < len(at_work) < len(view.groups)
    assert [int(g.get("data-group")) for g in root.iter(f"{SVG}g")] == at_work
    spans = [r for r in root.iter(f"{SVG}rect") if r.get("class") == "sp"]
    # time starts at the window's start: no span reaches into the gutter, and the plot spans the window
    assert min(float(r.get("x")) for r in spans) == pytest.approx(GUTTER, abs=0.1)
    assert int(root.get("width")) == 1100  # the window fits the width, as the whole run did
    texts = [t.text or "" for t in root.iter(f"{SVG}text") if t.get("class") == "ax"]
    ticks = [float(t[:-2]) for t in texts if t.endswith(" s")]
    assert ticks
    assert min(ticks) >= since
    assert f"last {window:.15g} s: {len(at_work)} of {len(view.groups)} groups" in root.get("aria-label")
    # a window longer than the run is the whole run
    assert render_timeline(view, window_s=view.now * 2) == render_timeline(view)


def test_a_live_run_s_groups_at_work_stay_in_its_window_and_the_svg_says_it_is_live():
    events = synthetic_run(groups=12, group_size=2, batch_groups=2)
    view = view_from_events("run-1", events[: len(events) // 2], source="live")
    root = ET.fromstring(render_timeline(view, window_s=10))
    open_groups = {g.group_id for g in view.groups if g.outcome in ("in flight", "ready")}
    assert open_groups
    assert open_groups <= {int(g.get("data-group")) for g in root.iter(f"{SVG}g")}
    assert root.get("data-live") == "1"
    assert ET.fromstring(render_timeline(make_view(groups=4))).get("data-live") == "0"


@pytest.mark.parametrize("window", [0.0, -5.0, math.nan, math.inf])
def test_a_window_that_is_no_length_of_time_is_refused(window):
    with pytest.raises(ValueError, match="window"):
        render_timeline(make_view(groups=4), window_s=window)


def test_batch_and_version_lines_too_close_to_read_stay_in_the_header():
    """A fast run's hundreds of batch and version lines at one screen's width striped every row; drawn
    in the header only, they come down into the rows once zoomed in far enough to tell them apart."""
    view = make_view(groups=60, group_size=2, batch_groups=2)
    marks = len(view.batches) + len(view.publications)
    narrow = ET.fromstring(render_timeline(view, width=400))
    wide = ET.fromstring(render_timeline(view, width=400, zoom=64))
    assert (
        (400 - GUTTER - 20) / marks < 8 < 64 * (400 - GUTTER - 20) / marks
    )  # the two cases, or this shows nothing
    for root, lines, bottom in ((narrow, "header", AXIS_H - 4), (wide, "rows", int(wide.get("height")))):
        assert root.get("data-lines") == lines
        drawn = [ln for ln in root.iter(f"{SVG}line") if ln.get("class") in ("bat", "pub")]
        assert len(drawn) == marks
        assert {float(ln.get("y2")) for ln in drawn} == {bottom}


def test_a_window_with_more_at_work_than_the_budget_starts_at_its_latest_groups():
    """With more spans at work in the window than the budget, the plot began at the window's start and
    its early part was left blank (the first span drawn 71 s into a 300 s window), as if nothing ran."""
    view = make_view(groups=40, group_size=2, batch_groups=2)
    window = view.now * 0.8
    root = ET.fromstring(render_timeline(view, window_s=window, max_spans=120))
    spans = [r for r in root.iter(f"{SVG}rect") if r.get("class") == "sp"]
    assert min(float(r.get("x")) for r in spans) == pytest.approx(GUTTER, abs=0.1)
    label = root.get("aria-label")
    assert f"the last {window:.15g} s, cut to its latest" in label
    started = float(re.search(r"from (\d+) s", label).group(1))
    assert started > view.now - window  # later than the window's start: the budget cut it


def test_a_window_of_a_million_seconds_or_more_is_written_whole():
    """'%g' wrote 1e+06, whose '+' a query string reads as a space: the links and every refresh were
    422s."""
    view = make_view(groups=4)
    assert "last 1234567 s" not in render_timeline(view, window_s=1_234_567)  # longer than the run
    from app.web.views import run_context

    context = run_context(view, window=1_234_567.0)
    from app.web.security import AccessConfig
    from app.web.views import Dashboard

    page = Dashboard(AccessConfig(None, None)).render("run.html", {**context, "csrf": "", "csrf_field": ""})
    assert 'data-window="1234567"' in page
    assert "window=1234567" in page
    assert "e+06" not in page
