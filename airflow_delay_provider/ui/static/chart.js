// The due-time histogram of the backlog page, drawn as plain SVG (no library: the page loads only its own
// files). Text goes in as text nodes, never as markup.
"use strict";

(() => {
  function svg(tag, attrs, ...children) {
    const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
    for (const [key, value] of Object.entries(attrs || {})) node.setAttribute(key, String(value));
    for (const child of children) node.append(child instanceof Node ? child : String(child));
    return node;
  }

  /** An SVG bar chart of `counts` per bucket (`buckets`: [key, label] pairs, in order). */
  function draw(BUCKETS, counts) {
    const W = 520, H = 230, left = 48, right = 10, top = 22, bottom = 34;
    const max = Math.max(1, ...Object.values(counts));
    const step = niceStep(max / 4), top_value = Math.ceil(max / step) * step;
    const y = (v) => top + (H - top - bottom) * (1 - v / top_value);
    const band = (W - left - right) / BUCKETS.length;
    const label = BUCKETS.map(([key, text]) => `${text}: ${counts[key]}`).join(", ");
    const chart = svg("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": `Messages by due time: ${label}` });
    for (let v = 0; v <= top_value; v += step) {
      chart.append(svg("line", { class: "grid", x1: left, x2: W - right, y1: y(v), y2: y(v) }),
        svg("text", { x: left - 6, y: y(v) + 4, "text-anchor": "end" }, v.toLocaleString()));
    }
    BUCKETS.forEach(([key, text], i) => {
      const x = left + i * band + band * 0.15, width = band * 0.7, value = counts[key];
      const bar = svg("rect", { class: `bar ${key}`, x, width, y: y(value), height: Math.max(0, y(0) - y(value)),
        "data-bucket": key, "data-count": value });
      bar.append(svg("title", {}, `${text}: ${value}`));
      chart.append(bar,
        svg("text", { class: "value", x: x + width / 2, y: y(value) - 5, "text-anchor": "middle" }, value.toLocaleString()),
        svg("text", { x: x + width / 2, y: H - bottom + 18, "text-anchor": "middle" }, text));
    });
    chart.append(svg("line", { class: "axis", x1: left, x2: W - right, y1: y(0), y2: y(0) }));
    return chart;
  }

  function niceStep(raw) {
    if (raw <= 1) return 1;
    const power = 10 ** Math.floor(Math.log10(raw));
    for (const m of [1, 2, 5, 10]) if (raw <= m * power) return m * power;
    return 10 * power;
  }

  window.backlogChart = { draw };
})();
