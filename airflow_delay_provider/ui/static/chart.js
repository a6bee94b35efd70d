// The charts of the backlog page, drawn as plain SVG (no library: the page loads only its own files): the due-time
// histogram, and the delivery history per minute. Text goes in as text nodes, never as markup.
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

  /** A lateness in milliseconds in words: "4 ms", "1.2 s", "3 min 5 s", "2.5 h", "3.1 d"; negative ones are "early". */
  function duration(ms) {
    const a = Math.abs(ms), seconds = Math.round(a / 1000);
    const text = a < 9.95 ? `${Number(a.toFixed(1))} ms` : Math.round(a) < 1000 ? `${Math.round(a)} ms`
      : a < 59_950 ? `${Number((a / 1000).toFixed(1))} s`
      : seconds < 3600 ? `${Math.floor(seconds / 60)} min ${seconds % 60} s`
      : a < 86_220_000 ? `${Number((a / 3_600_000).toFixed(1))} h` : `${Number((a / 86_400_000).toFixed(1))} d`;
    return ms < 0 ? `${text} early` : text;
  }

  const MINUTE = 60_000;
  /** The tick every so many minutes, per window: a label per 10 min of an hour, per hour of 6, per 4 h of 24. */
  const TICKS = { "1h": 10, "6h": 60, "24h": 240 };

  /** The delivery history's chart: per minute of `report` (api/history/chart), the messages delivered as bars (the
   * retried and dead-lettered stacked on them) on the left axis, and the p50 and p99 lateness of the delivered ones
   * as two lines on the right axis. `label(iso)` gives a time's "HH:mm" in the user's zone; `summary` is said first
   * in the drawing's accessible name. */
  function drawHistory(report, label, summary) {
    const W = 900, H = 270, left = 48, right = 64, top = 26, bottom = 36;
    const since = Date.parse(report.since), until = Date.parse(report.until);
    const first = Math.floor(since / MINUTE) * MINUTE, count = Math.max(1, Math.ceil((until - first) / MINUTE));
    const band = (W - left - right) / count;
    const x = (at) => left + ((at - first) / MINUTE) * band;
    const points = report.minutes.map((m) => ({ ...m, at: Date.parse(m.minute) }));
    const total = (m) => m.delivered + m.retried + m.dead_lettered;
    const maxCount = Math.max(1, ...points.map(total));
    const step = niceStep(maxCount / 4), topCount = Math.ceil(maxCount / step) * step;
    const late = points.filter((m) => m.p99_ms !== null).flatMap((m) => [m.p50_ms, m.p99_ms]);
    const maxLate = Math.max(1, ...late);
    const lateStep = niceStep(maxLate / 4), topLate = Math.ceil(maxLate / lateStep) * lateStep;
    const y = (v) => top + (H - top - bottom) * (1 - v / topCount);
    const yLate = (ms) => top + (H - top - bottom) * (1 - Math.max(0, ms) / topLate);

    const chart = svg("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": summary, class: "history" },
      svg("title", {}, summary));
    for (let v = 0; v <= topCount; v += step) {
      chart.append(svg("line", { class: "grid", x1: left, x2: W - right, y1: y(v), y2: y(v) }),
        svg("text", { x: left - 6, y: y(v) + 4, "text-anchor": "end" }, v.toLocaleString()));
    }
    for (let v = 0; v <= topLate; v += lateStep) {
      chart.append(svg("text", { class: "late-axis", x: W - right + 6, y: yLate(v) + 4 }, duration(v)));
    }
    chart.append(svg("text", { class: "axis-title", x: 4, y: 12 }, "per minute"),
      svg("text", { class: "axis-title", x: W - 4, y: 12, "text-anchor": "end" }, "lateness"));
    // The ticks of the time axis, on whole minutes of the user's zone (its offset may be 30 or 45 minutes).
    const every = TICKS[report.window] || 10;
    for (let at = first; at < first + count * MINUTE; at += MINUTE) {
      const text = label(new Date(at).toISOString()), [hh, mm] = text.split(":").map(Number);
      if ((hh * 60 + mm) % every) continue;
      chart.append(svg("line", { class: "tick", x1: x(at), x2: x(at), y1: y(0), y2: y(0) + 4 }),
        svg("text", { x: x(at), y: H - bottom + 18, "text-anchor": "middle" }, text));
    }
    const width = Math.max(1, band * 0.8);
    for (const m of points) {
      const parts = [["delivered", m.delivered], ["retried", m.retried], ["dead_lettered", m.dead_lettered]];
      let base = 0;
      const words = [`${label(m.minute)}: ${m.delivered} delivered`];
      if (m.p50_ms !== null) words.push(`lateness p50 ${duration(m.p50_ms)}, p99 ${duration(m.p99_ms)}`);
      for (const [key, n] of parts.slice(1)) if (n) words.push(`${n} ${key.replace("_", "-")}`);
      if (m.cancelled) words.push(`${m.cancelled} cancelled`);
      for (const [key, n] of parts) {
        if (!n) continue;
        const bar = svg("rect", { class: `bar ${key}`, x: x(m.at) + (band - width) / 2, width, y: y(base + n),
          height: Math.max(0, y(base) - y(base + n)), "data-minute": m.minute, "data-count": n });
        bar.append(svg("title", {}, words.join("; ")));
        chart.append(bar);
        base += n;
      }
    }
    // The lines go through the minutes with deliveries, and break where a minute has none.
    for (const [key, field] of [["p50", "p50_ms"], ["p99", "p99_ms"]]) {
      let d = "", previous = null;
      const lonely = [];
      const delivered = points.filter((m) => m[field] !== null);
      delivered.forEach((m, i) => {
        const cx = x(m.at) + band / 2, cy = yLate(m[field]);
        const joined = previous !== null && m.at - previous === MINUTE;
        d += `${joined ? "L" : "M"}${cx.toFixed(1)},${cy.toFixed(1)}`;
        const next = delivered[i + 1];
        if (!joined && !(next && next.at - m.at === MINUTE)) lonely.push([cx, cy, m]);
        previous = m.at;
      });
      if (d) chart.append(svg("path", { class: `line ${key}`, d, "data-points": delivered.length }));
      for (const [cx, cy, m] of lonely) {  // a minute between two without deliveries: a dot, not a line
        chart.append(svg("circle", { class: `dot ${key}`, cx, cy, r: 3 },
          svg("title", {}, `${label(m.minute)}: ${key} lateness ${duration(m[field])}`)));
      }
    }
    chart.append(svg("line", { class: "axis", x1: left, x2: W - right, y1: y(0), y2: y(0) }));
    return chart;
  }

  function niceStep(raw) {
    if (raw <= 1) return 1;
    const power = 10 ** Math.floor(Math.log10(raw));
    for (const m of [1, 2, 5, 10]) if (raw <= m * power) return m * power;
    return 10 * power;
  }

  window.backlogChart = { draw, drawHistory, duration };
})();
