// batchinfer dashboard: the tokens/s chart of a batch page (uPlot). Everything else is htmx attributes.
"use strict";

(function () {
  const REFRESH_MS = 3000;

  function chartSize(el) {
    return { width: Math.max(el.clientWidth, 320), height: 240 };
  }

  function startChart(el) {
    const opts = {
      ...chartSize(el),
      scales: { x: { time: true } },
      legend: { show: true },
      series: [
        {},
        { label: "tokens/s", stroke: "#2563eb", width: 2, fill: "rgba(37, 99, 235, 0.12)",
          points: { show: false }, value: (u, v) => (v == null ? "-" : v.toFixed(1)) },
      ],
      axes: [{}, { label: "tokens/s", size: 60 }],
    };
    const plot = new uPlot(opts, [[], []], el);
    window.addEventListener("resize", () => plot.setSize(chartSize(el)));

    async function refresh() {
      let data;
      try {
        const response = await fetch(el.dataset.src, { headers: { Accept: "application/json" } });
        if (response.status === 401) { window.location.href = "/ui/login"; return; }
        if (!response.ok) { return; }
        data = await response.json();
      } catch (err) {
        setTimeout(refresh, REFRESH_MS);  // the server restarts or the network blinks: try again
        return;
      }
      plot.setData([data.at, data.tokens_per_second]);
      el.dataset.points = String(data.at.length);
      el.dataset.final = String(data.final);
      if (!data.final) { setTimeout(refresh, REFRESH_MS); }
    }
    refresh();
  }

  document.addEventListener("DOMContentLoaded", () => {
    const el = document.getElementById("chart");
    if (el && window.uPlot) { startChart(el); }
  });
})();
