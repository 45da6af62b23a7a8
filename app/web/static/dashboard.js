// Keep the timeline's scroll position (at the same time under the centre) across live updates and zooms.
(function () {
  var saved = null;
  document.addEventListener("htmx:beforeSwap", function (e) {
    var box = document.getElementById("tl-scroll");
    if (!box || !e.detail.target || e.detail.target.id !== "timeline") return;
    var svg = box.querySelector("svg");
    saved = { left: box.scrollLeft, top: box.scrollTop, width: box.clientWidth, total: svg ? svg.width.baseVal.value : 1 };
  });
  document.addEventListener("htmx:afterSettle", function (e) {
    var box = document.getElementById("tl-scroll");
    if (!box || !saved || !e.detail.target || e.detail.target.id !== "timeline") return;
    var svg = box.querySelector("svg");
    var total = svg ? svg.width.baseVal.value : saved.total;
    var centre = (saved.left + saved.width / 2) / saved.total;
    box.scrollLeft = Math.max(0, centre * total - box.clientWidth / 2);
    box.scrollTop = saved.top;
    saved = null;
  });
})();
