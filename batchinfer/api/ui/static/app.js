// batchinfer dashboard: the tokens/s chart of a batch page (uPlot). Everything else is htmx attributes.
"use strict";

(function () {
  const REFRESH_MS = 3000;

  function chartSize(el) {
    return { width: Math.max(el.clientWidth, 320), height: 240 };
  }

  // Wall-clock time of a unix second, HH:MM:SS in the viewer's time zone (uPlot's default for a short
  // span is ":03.500", a sub-second offset nobody can place).
  function clock(seconds) {
    return seconds == null ? "-" : new Date(seconds * 1000).toLocaleTimeString([], { hour12: false });
  }

  function startChart(el) {
    const opts = {
      ...chartSize(el),
      scales: { x: { time: true } },
      legend: { show: true, live: true },
      series: [
        { label: "time", value: (u, v) => clock(v) },
        { label: "output tokens/s of requests finished in the interval", stroke: "#2563eb", width: 2,
          fill: "rgba(37, 99, 235, 0.12)", points: { show: false },
          value: (u, v) => (v == null ? "-" : v.toFixed(1)) },
      ],
      axes: [
        { label: "time (HH:MM:SS, local)", incrs: [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600,
                                                  7200, 14400, 21600, 43200, 86400],
          values: (u, splits) => splits.map(clock), space: 70 },
        { label: "tokens/s", size: 60 },
      ],
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
