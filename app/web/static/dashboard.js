// The timeline: zoom, window and live refresh fetch the SVG and swap it in directly (no htmx swap: for
// a 2,000-span SVG that halves the time). The scroll position is read as the new SVG arrives, not when
// it was asked for, so scrolling during a fetch is kept; a box at its right or bottom edge stays there
// (it follows a live run's newest time and groups), else the time under the box's centre stays put.
(function () {
  var busy = false, queued = null, first = true;
  var EDGE = 4;  // px from an edge that still counts as at it

  function box() { return document.getElementById("tl-scroll"); }
  function holder() { return document.getElementById("timeline"); }

  // The timeline's width at zoom 1: the box's, so that the plot fills it (the server's bounds).
  function width() { return Math.min(Math.max(Math.floor(box().clientWidth), 400), 8000); }

  // The links keep the zoom and window they do not change, and the current window is marked.
  function setControls(zoom, win) {
    var label = document.getElementById("zoom-label");
    if (label) label.textContent = "Zoom \u00d7" + zoom;
    var next = { "in": Math.min(zoom * 2, 64), "out": Math.max(zoom / 2, 1), "fit": 1 };
    document.querySelectorAll("a[data-zoom], a[data-window]").forEach(function (a) {
      var url = new URL(a.href);
      url.searchParams.set("zoom", a.dataset.zoom ? next[a.dataset.zoom] : zoom);
      var w = a.dataset.window !== undefined ? a.dataset.window : win;
      if (w) url.searchParams.set("window", w); else url.searchParams.delete("window");
      a.href = url.toString();
      if (a.dataset.window !== undefined) {
        var current = a.dataset.window === win;
        a.classList.toggle("current", current);
        if (current) a.setAttribute("aria-current", "true"); else a.removeAttribute("aria-current");
      }
    });
  }

  // Where the box is, as the new SVG arrives: at an edge, or the time under its centre.
  function place(b) {
    var svg = holder().querySelector("svg");
    var total = svg ? svg.width.baseVal.value : 1;
    return {
      right: b.scrollLeft + b.clientWidth >= b.scrollWidth - EDGE && b.scrollWidth > b.clientWidth,
      bottom: b.scrollTop + b.clientHeight >= b.scrollHeight - EDGE && b.scrollHeight > b.clientHeight,
      centre: (b.scrollLeft + b.clientWidth / 2) / total,
      top: b.scrollTop,
    };
  }

  function restore(b, at, fresh, follow) {
    if (at.right || follow) b.scrollLeft = b.scrollWidth;
    else b.scrollLeft = Math.max(0, at.centre * fresh.width.baseVal.value - b.clientWidth / 2);
    b.scrollTop = at.bottom || follow ? b.scrollHeight : at.top;
  }

  // A load asked for while one is under way waits for it: a click's zoom and window replace a queued
  // refresh's (which would draw the old ones), a refresh never replaces a queued click's.
  function load(zoom, win, follow, refresh) {
    var h = holder(), b = box();
    if (!h || !b) return;
    if (busy) {
      if (!refresh || !queued) queued = [zoom, win, follow, refresh];
      return;
    }
    busy = true;
    var url = h.dataset.src + "?zoom=" + zoom + "&width=" + width() + (win ? "&window=" + win : "");
    fetch(url, { headers: { "HX-Request": "true" }, credentials: "same-origin" })
      .then(function (r) { return r.ok ? r.text() : Promise.reject(r.status); })
      .then(function (html) {
        var at = place(b);
        h.innerHTML = html;
        h.dataset.zoom = zoom;
        h.dataset.window = win;
        setControls(zoom, win);
        var fresh = h.querySelector("svg");
        if (fresh) {
          var counts = document.getElementById("tl-counts");
          if (counts) counts.textContent = fresh.dataset.trajectories + " trajectories, " + fresh.dataset.spans + " spans";
          restore(b, at, fresh, follow);
        }
        h.dispatchEvent(new CustomEvent("timeline:loaded", { bubbles: true }));
      })
      .catch(function () {})
      .finally(function () {
        busy = false;
        if (queued) { var q = queued; queued = null; load(q[0], q[1], q[2], q[3]); }
      });
  }

  function reload() { var h = holder(); if (h) load(Number(h.dataset.zoom), h.dataset.window, false, true); }

  document.addEventListener("click", function (e) {
    var a = e.target.closest && e.target.closest("a[data-zoom], a[data-window]");
    if (!a || !holder()) return;
    e.preventDefault();
    var url = new URL(a.href);
    // a new window of a live run starts at its newest groups and time
    var live = holder().querySelector("svg[data-live='1']") !== null;
    load(Number(url.searchParams.get("zoom")), url.searchParams.get("window") || "", live && a.dataset.window !== undefined);
  });
  // The page's own timeline is drawn at a default width: redraw it at the box's, and as the box resizes.
  // A live run's page opens at its newest groups and time, where an operator looks first.
  var resized = null;
  function fit() {
    var h = holder(), b = box(), svg = h && h.querySelector("svg");
    if (!svg || !b) return;
    var live = first && svg.dataset.live === "1";
    if (live) { b.scrollLeft = b.scrollWidth; b.scrollTop = b.scrollHeight; }
    first = false;
    if (Number(svg.dataset.width) !== width()) load(Number(h.dataset.zoom), h.dataset.window, live);
  }
  document.addEventListener("DOMContentLoaded", fit);
  window.addEventListener("resize", function () { clearTimeout(resized); resized = setTimeout(fit, 250); });
  // The live stream's "timeline" message: the run changed, refresh at the current zoom and window.
  // The policy form's "a large change" is for one change: once a change is applied it is unticked again
  // (left ticked, the next large S went through unconfirmed). A refusal leaves it as it is: unticking
  // then could undo a tick made as the refusal came.
  // (htmx counts a 422 as successful: the page's config swaps refusals in.)
  document.addEventListener("htmx:afterRequest", function (e) {
    var xhr = e.detail && e.detail.xhr, applied = xhr && xhr.status >= 200 && xhr.status < 300;
    var form = e.target && e.target.id === "policy-form" && applied && e.target;
    if (!form) return;
    var large = document.getElementById("p-large");
    if (large) large.checked = false;
    // What was applied is now what the fields show: left as they are, they are no change next time.
    form.querySelectorAll("input[name$='_shown']").forEach(function (shown) {
      var field = form.elements[shown.name.slice(0, -"_shown".length)];
      if (field) shown.value = field.value;
    });
  });
  // The policy as the stream brings it (the API's change, another page's) becomes what the form's fields
  // show, so the form reads as what runs now; a field being edited keeps what is typed in it. Until
  // then the form showed the policy as the page loaded, and S typed back to that value was "no change".
  // The page's head line ("S 4 · K 2") follows the "Now:" line too: it kept the policy as the page
  // loaded, beside "Now: K = 3" after a change.
  document.addEventListener("htmx:sseMessage", function (e) {
    if (!e.target || e.target.id !== "policy") return;
    var heads = [["current-k", "policy-k"], ["current-s", "policy-s"], ["current-gate", "policy-gate"]];
    heads.forEach(function (ids) {
      var from = document.getElementById(ids[0]), to = document.getElementById(ids[1]);
      if (from && to) to.textContent = from.textContent;
    });
    var form = document.getElementById("policy-form"), now = document.getElementById("policy-now");
    if (!form || !now) return;
    ["max_staleness", "surplus_groups", "agent_gate"].forEach(function (name) {
      var field = form.elements[name], shown = form.elements[name + "_shown"], value = now.dataset[name];
      if (!field || !shown || !value) return;
      if (field.value === shown.value && document.activeElement !== field) field.value = value;
      shown.value = value;
    });
  });
  document.addEventListener("htmx:sseOpen", function (e) {
    e.detail.source.addEventListener("timeline", reload);
  });
})();

// A page whose server went away (killed, restarted, stopped) said nothing: it went on showing the last
// figures it was sent as live, and its controls did nothing when clicked. The live stream's state is
// said at the top of the page; once the stream is open again its first message brings every block up
// to date (and the timeline with it).
(function () {
  var lostAt = null;

  function two(n) { return (n < 10 ? "0" : "") + n; }

  function show(note, text) {
    note.textContent = text;
    note.className = "flash error";  // not before: a page's own error is the one `.flash.error` there
    note.hidden = false;
  }

  document.addEventListener("htmx:sseError", function () {
    var note = document.getElementById("live-lost");
    if (!note) return;
    if (!lostAt) {
      var now = new Date();
      lostAt = two(now.getHours()) + ":" + two(now.getMinutes()) + ":" + two(now.getSeconds());
    }
    var since = lostAt;
    show(note, "Disconnected from the server since " + since + ", retrying: this page shows what it was " +
      "sent until then, and its controls reach nothing until it is connected again.");
    // The stream fails the same way whether the server is gone or answers it 503 (its database away):
    // ask the health route, which answers either way while the server is up.
    fetch("/healthz", { cache: "no-store" }).then(function () {
      if (note.hidden || lostAt !== since) return;  // connected again meanwhile
      show(note, "Live updates stopped at " + since + ", retrying: the server answers, but not its live " +
        "stream (its database may be away; see /healthz). This page shows what it was sent until then.");
    }, function () { /* no answer: the server is gone, as said */ });
  });
  document.addEventListener("htmx:sseOpen", function () {
    var note = document.getElementById("live-lost");
    if (note) note.hidden = true;
    lostAt = null;
  });

  // A control's answer goes to its message area (an id ending in -msg), else just before its form.
  function tell(target, text) {
    if (!target) return;
    var p = document.createElement("p");
    p.className = "flash error";
    p.setAttribute("role", "alert");
    p.dataset.unanswered = "1";
    p.textContent = text;
    if (/-msg$/.test(target.id)) { target.replaceChildren(p); return; }
    var before = target.previousElementSibling;
    if (before && before.dataset && before.dataset.unanswered) before.remove();
    target.before(p);
  }

  // An answer's words: the API's JSON `detail`, else its text.
  function said(xhr) {
    var text = xhr.responseText || "";
    try {
      var detail = JSON.parse(text).detail;
      if (typeof detail === "string") return detail;
    } catch (err) { /* not JSON */ }
    var body = new DOMParser().parseFromString(text, "text/html").body;
    return ((body ? body.textContent : text) || xhr.statusText || "no answer").trim().slice(0, 300);
  }

  // No answer at all (the server down): htmx only logged it.
  document.addEventListener("htmx:sendError", function (e) {
    tell(e.detail.target, "Not done: the server did not answer (it may be restarting). Nothing was " +
      "changed; try again once this page is connected.");
  });
  // A 5xx (the database away, a run being resumed after a restart) is not swapped by the page's
  // responseHandling: the dashboard's own one-line answer is, anything else is said in words.
  document.addEventListener("htmx:beforeSwap", function (e) {
    var xhr = e.detail.xhr;
    if (!xhr || xhr.status < 500) return;
    var target = e.detail.target;
    if (target && /-msg$/.test(target.id) && /^\s*<p class="flash/.test(xhr.responseText || "")) {
      e.detail.shouldSwap = true;
      e.detail.isError = false;
      return;
    }
    e.detail.shouldSwap = false;
    var why = said(xhr);
    tell(target, "Not done: the server answered " + xhr.status + " (" + why + ")" +
      (/try again/i.test(why) ? "." : ". Try again in a few seconds."));
  });
})();
