// The timeline: zoom and live refresh fetch the SVG and swap it in directly (no htmx swap: for a
// 2,000-span SVG that halves the time), keeping the time under the box's centre in place.
(function () {
  var busy = false, again = false;

  function box() { return document.getElementById("tl-scroll"); }
  function holder() { return document.getElementById("timeline"); }

  // The timeline's width at zoom 1: the box's, so that the plot fills it (the server's bounds).
  function width() { return Math.min(Math.max(Math.floor(box().clientWidth), 400), 8000); }

  function setZoomControls(zoom) {
    var label = document.getElementById("zoom-label");
    if (label) label.textContent = "Zoom \u00d7" + zoom;
    var next = { "in": Math.min(zoom * 2, 64), "out": Math.max(zoom / 2, 1), "fit": 1 };
    document.querySelectorAll("a[data-zoom]").forEach(function (a) {
      var url = new URL(a.href);
      url.searchParams.set("zoom", next[a.dataset.zoom]);
      a.href = url.toString();
    });
  }

  function load(zoom) {
    var h = holder(), b = box();
    if (!h || !b) return;
    if (busy) { again = true; return; }
    busy = true;
    var svg = h.querySelector("svg");
    var total = svg ? svg.width.baseVal.value : 1;
    var centre = (b.scrollLeft + b.clientWidth / 2) / total, top = b.scrollTop;
    var url = h.dataset.src + "?zoom=" + zoom + "&width=" + width();
    fetch(url, { headers: { "HX-Request": "true" }, credentials: "same-origin" })
      .then(function (r) { return r.ok ? r.text() : Promise.reject(r.status); })
      .then(function (html) {
        h.innerHTML = html;
        h.dataset.zoom = zoom;
        setZoomControls(zoom);
        var fresh = h.querySelector("svg");
        if (fresh) {
          var counts = document.getElementById("tl-counts");
          if (counts) counts.textContent = fresh.dataset.trajectories + " trajectories, " + fresh.dataset.spans + " spans";
          b.scrollLeft = Math.max(0, centre * fresh.width.baseVal.value - b.clientWidth / 2);
          b.scrollTop = top;
        }
        h.dispatchEvent(new CustomEvent("timeline:loaded", { bubbles: true }));
      })
      .catch(function () {})
      .finally(function () {
        busy = false;
        if (again) { again = false; load(Number(holder().dataset.zoom)); }
      });
  }

  document.addEventListener("click", function (e) {
    var a = e.target.closest && e.target.closest("a[data-zoom]");
    if (!a || !holder()) return;
    e.preventDefault();
    load(Number(new URL(a.href).searchParams.get("zoom")));
  });
  // The page's own timeline is drawn at a default width: redraw it at the box's, and as the box resizes.
  var resized = null;
  function fit() {
    var h = holder(), b = box(), svg = h && h.querySelector("svg");
    if (!svg || !b) return;
    if (Number(svg.dataset.width) !== width()) load(Number(h.dataset.zoom));
  }
  document.addEventListener("DOMContentLoaded", fit);
  window.addEventListener("resize", function () { clearTimeout(resized); resized = setTimeout(fit, 250); });
  // The live stream's "timeline" message: the run changed, refresh at the current zoom.
  document.addEventListener("htmx:sseOpen", function (e) {
    e.detail.source.addEventListener("timeline", function () {
      var h = holder();
      if (h) load(Number(h.dataset.zoom));
    });
  });
})();
