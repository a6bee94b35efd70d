// The backlog page: counts, the due-time histogram (chart.js), the message list and the delivery history (its chart
// per minute, the recent entries, a message's story), from this app's JSON endpoints, with times in the user's zone
// and colours in Airflow's mode (prefs.js). Filters can come in the page's URL (a task's extra link). Everything shown
// goes into the page as text nodes (never as HTML), so message ids, headers and bodies cannot inject markup. Actions
// are offered only to users who may edit; the server checks again. The body is aria-busy while the page loads.
"use strict";

(() => {
  const REFRESH_MS = 15000;
  const state = {
    backlog: null, canEdit: false, chartDestination: null, query: {}, cursors: [], after: null, next: null,
    page: [], selected: new Set(), busy: false, ids: [],
  };
  const $ = (id) => document.getElementById(id);
  /** Loads under way: the page is aria-busy while any is, or while an action runs (`state.busy`). */
  let pending = 0;

  function showBusy() {
    if (state.busy || pending) document.body.setAttribute("aria-busy", "true");
    else document.body.removeAttribute("aria-busy");
  }

  /** Run `work` (it returns a promise) with the page marked busy until it settles. */
  async function loading(work) {
    pending += 1;
    showBusy();
    try {
      return await work();
    } finally {
      pending -= 1;
      showBusy();
    }
  }

  /** An element with attributes, listeners (on*) and children (strings become text nodes). */
  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs || {})) {
      if (value === undefined || value === null || value === false) continue;
      if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
      else if (key === "class") node.className = value;
      else node.setAttribute(key, value === true ? "" : String(value));
    }
    for (const child of children.flat(Infinity)) {
      if (child !== undefined && child !== null && child !== false) node.append(child instanceof Node ? child : String(child));
    }
    return node;
  }

  async function api(path, body) {
    const init = { credentials: "same-origin", headers: { Accept: "application/json" } };
    if (body !== undefined) {
      init.method = "POST";
      init.headers["Content-Type"] = "application/json";
      init.body = JSON.stringify(body);
    }
    const response = await fetch(path, init);
    let data = null;
    try { data = await response.json(); } catch (_) { /* not JSON */ }
    if (!response.ok) {
      let detail = data && data.detail !== undefined ? data.detail : response.statusText;
      if (typeof detail !== "string") detail = JSON.stringify(detail);
      if (response.status === 401) detail = "your Airflow session has ended: reload the page to log in again";
      const error = new Error(`${response.status}: ${detail}`);
      error.status = response.status;
      error.detail = detail;
      error.connId = data && data.conn_id;
      throw error;
    }
    return data;
  }

  function say(text, kind) {
    const status = $("status");
    status.textContent = text;
    status.className = kind || "";
  }

  /** A name as text nodes with a break opportunity after each separator: a long name wraps between its parts. */
  const breakable = (name) => name.split(/(?<=[._\-/:])/).flatMap((part, i) => (i ? [el("wbr"), part] : [part]));

  const plural = (n, word) => `${n} ${word}${n === 1 ? "" : "s"}`;

  /** [the time in the user's zone (as Airflow's pages show it), how long from now]. */
  function when(iso) {
    const at = new Date(iso);
    const text = window.airflowPrefs.formatTime(iso);
    const seconds = Math.round((at.getTime() - Date.now()) / 1000);
    const span = Math.abs(seconds);
    const amount = span < 90 ? `${span} s` : span < 5400 ? `${Math.round(span / 60)} min`
      : span < 129600 ? `${Math.round(span / 3600)} h` : `${Math.round(span / 86400)} d`;
    return [text, seconds > 0 ? `in ${amount}` : `due ${amount} ago`];
  }

  // -- dialogs (window.confirm is blocked in the UI's sandboxed frame, so the page has its own) -------------
  /** Show the overlay `box`, focus on `first`, until an answer: `wire(done)` sets the dialog's handlers, which call
   * done(answer), and returns what clears them; Escape answers null. Then it hides and gives the focus back. */
  function dialog(box, first, wire) {
    return new Promise((resolve) => {
      const before = document.activeElement;
      const onKey = (event) => { if (event.key === "Escape") done(null); };
      let clear = () => {};
      function done(answer) {
        box.hidden = true;
        clear();
        document.removeEventListener("keydown", onKey);
        if (before && before.focus) before.focus();
        resolve(answer);
      }
      clear = wire(done);
      box.hidden = false;
      first.focus();
      document.addEventListener("keydown", onKey);
    });
  }

  function confirmAction(text, label) {
    const yes = $("confirm-yes"), no = $("confirm-no");
    $("confirm-text").textContent = text;
    yes.textContent = label;
    return dialog($("confirm"), no, (done) => {
      yes.onclick = () => done(true);
      no.onclick = () => done(false);
      return () => { yes.onclick = no.onclick = null; };
    });
  }

  async function act(work) {
    if (state.busy) return;
    state.busy = true;
    showBusy();
    try {
      const message = await work();
      if (message) say(message, "ok");
      await Promise.all([loadBacklog(), loadMessages(state.after), loadActions(), loadMatching(),
        loadHistoryAll(history.after)]);
    } catch (error) {
      failed(error);
    } finally {
      state.busy = false;
      showBusy();
    }
  }

  // -- actions ------------------------------------------------------------------------------------------
  function idList(ids) {
    const shown = ids.slice(0, 5).join("\n");
    return ids.length > 5 ? `${shown}\n… and ${ids.length - 5} more` : shown;
  }

  function cancel(ids) {
    return act(async () => {
      if (!await confirmAction(`Cancel ${plural(ids.length, "message")}? They will never be delivered.\n\n${idList(ids)}`,
        "Cancel messages")) return null;
      const report = await api("api/cancel", { message_ids: ids });
      state.selected.clear();
      return describe("Cancelled", report.counts.cancelled, report.counts);
    });
  }

  function runNow(ids) {
    return act(async () => {
      if (!await confirmAction(`Deliver ${plural(ids.length, "message")} now instead of at the scheduled time?\n\n${idList(ids)}`,
        "Run now")) return null;
      const held = state.page.filter((m) => ids.includes(m.message_id) && m.paused && !m.in_flight);
      const report = await api("api/run-now", { message_ids: ids });
      state.selected.clear();
      // Due now, but a paused destination sends nothing until it is resumed: say so, not just "made due".
      const count = report.counts.rescheduled, paused = Math.min(held.length, count);
      if (!paused) return describe("Made due now:", count, report.counts);
      const names = [...new Set(held.map((m) => `“${m.destination}”`))];
      const waits = `${names.join(", ")} ${names.length > 1 ? "send" : "sends"} nothing until resumed`;
      return paused === count ? describe("Made due now; held while paused:", count, report.counts, [waits])
        : describe("Made due now:", count, report.counts, [`${paused} held while paused (${waits})`]);
    });
  }

  /** Pause (hold stored, never delivered) or resume the messages of these ids. */
  function hold(ids, pause) {
    return act(async () => {
      const question = pause
        ? `Pause ${plural(ids.length, "message")}? They stay stored and are not delivered until resumed, whatever their due time.`
        : `Resume ${plural(ids.length, "message")}? Each is delivered at its due time; one already past due goes at once.`;
      if (!await confirmAction(`${question}\n\n${idList(ids)}`, pause ? "Pause messages" : "Resume messages")) return null;
      const report = await api(pause ? "api/pause-messages" : "api/resume-messages", { message_ids: ids });
      state.selected.clear();
      return pause ? describe("Paused", report.counts.paused, report.counts)
        : describe("Resumed", report.counts.resumed, report.counts);
    });
  }

  // -- everything a filter matches: counted first, then changed (by the server, in batches) ---------------
  /** The search's filter as an action's selection (no ids: a link's or the form's ids are a selection of their own). */
  function filterSelection() {
    const q = state.query, selection = {};
    if (q.destination) selection.destination = q.destination;
    if (q.header) {
      const at = q.header.indexOf("=");
      if (at > 0) selection.headers = { [q.header.slice(0, at).trim()]: q.header.slice(at + 1).trim() };
    }
    for (const key of ["due_from", "due_before", "body_contains"]) if (q[key]) selection[key] = q[key];
    return selection;
  }

  const filtered = () => state.canEdit && !(state.query.message_id || []).length
    && Object.keys(filterSelection()).length > 0;

  /** The filter in words, as the confirmation and the status line say it. */
  function describeFilter(selection) {
    const parts = [];
    if (selection.destination) parts.push(`destination “${selection.destination}”`);
    for (const [k, v] of Object.entries(selection.headers || {})) parts.push(`header ${k}=${v}`);
    if (selection.due_from) parts.push(`due from ${window.airflowPrefs.formatTime(selection.due_from)}`);
    if (selection.due_before) parts.push(`due before ${window.airflowPrefs.formatTime(selection.due_before)}`);
    if (selection.body_contains) parts.push(`body containing “${selection.body_contains}”`);
    return parts.join(", ");
  }

  const number = (n) => n.toLocaleString("en-US");

  async function loadMatching() {
    const bar = $("matching");
    if (!filtered()) { bar.hidden = true; return; }
    const counted = await api("api/count", { ...filterSelection(), action: "cancel" });
    const held = counted.in_flight ? ` (and ${number(counted.in_flight)} held by a running sweep, left as they are)` : "";
    const n = counted.would_cancel;
    $("matching-count").textContent = `${number(n)} scheduled message${n === 1 ? " matches" : "s match"} this filter${held}.`;
    for (const id of ["match-run-now", "match-reschedule", "match-pause", "match-resume", "match-cancel"]) {
      $(id).disabled = !counted.would_cancel;
    }
    bar.hidden = false;
  }

  function rescheduleForm(count) {
    const form = $("reschedule-form"), at = $("reschedule-at"), no = $("reschedule-no");
    $("reschedule-note").textContent = `The ${plural(count, "message")} matching ${describeFilter(filterSelection())}`
      + ` become due at this time (in ${window.airflowPrefs.timeZone().zone}).`;
    return dialog($("rescheduler"), at, (done) => {
      form.onsubmit = (event) => { event.preventDefault(); if (at.value) done(window.airflowPrefs.toUtc(at.value)); };
      no.onclick = () => done(null);
      return () => { form.onsubmit = no.onclick = null; };
    });
  }

  const WOULD = { cancel: "would_cancel", run_now: "would_reschedule", reschedule: "would_reschedule",
    pause: "would_pause", resume: "would_resume" };
  const QUESTIONS = {
    cancel: (n, words) => `Cancel ${plural(n, "scheduled message")} matching ${words}? They will never be delivered. `
      + "This cannot be undone.",
    run_now: (n, words) => `Deliver ${plural(n, "scheduled message")} matching ${words} now instead of at their `
      + "scheduled times?",
    pause: (n, words) => `Pause ${plural(n, "scheduled message")} matching ${words}? They stay stored and are not `
      + "delivered until resumed, whatever their due time. New messages are not paused.",
    resume: (n, words) => `Resume ${plural(n, "paused message")} matching ${words}? Each is delivered at its due `
      + "time; those already past due go at once.",
  };

  /** Cancel, run now, reschedule, pause or resume every message the filter matches: the count first, on the confirm
   * button. */
  function onFilter(kind) {
    return act(async () => {
      const selection = filterSelection(), words = describeFilter(selection);
      const counted = await api("api/count", { ...selection, action: kind });
      const n = counted[WOULD[kind]];
      if (!n) {
        return kind === "resume" ? `Nothing changed: no paused message matches ${words}.`
          : kind === "pause" ? `Nothing changed: every scheduled message matching ${words} is paused already.`
            : `Nothing changed: no scheduled message matches ${words}.`;
      }
      let change = {}, question;
      if (kind === "reschedule") {
        const at = await rescheduleForm(n);
        if (!at) return null;
        change = { deliver_at: at };
        question = `Move ${plural(n, "scheduled message")} matching ${words} to ${window.airflowPrefs.formatTime(at)}?`;
      } else {
        question = QUESTIONS[kind](n, words);
      }
      if (counted.in_flight) question += ` ${plural(counted.in_flight, "message")} held by a running sweep will stay.`;
      if (counted.confirm) question += " It is done in batches and may take a while; messages stored meanwhile that match are changed too.";
      const label = { cancel: "Cancel", run_now: "Run now", reschedule: "Reschedule", pause: "Pause",
        resume: "Resume" }[kind];
      if (!await confirmAction(question, `${label} ${number(n)}`)) return null;
      const path = { run_now: "api/run-now", pause: "api/pause-messages", resume: "api/resume-messages" }[kind]
        || `api/${kind}`;
      const report = await api(path, { ...selection, ...change });
      const done = { cancel: "cancelled", pause: "paused", resume: "resumed" }[kind] || "rescheduled";
      const verb = { cancel: "Cancelled", run_now: "Made due now:", reschedule: "Rescheduled", pause: "Paused",
        resume: "Resumed" }[kind];
      return describe(verb, report.counts[done], report.counts);
    });
  }

  // -- editing one message: its body and headers; the due time stays -------------------------------------
  function editForm(m) {
    const form = $("edit-form"), body = $("edit-body"), headers = $("edit-headers"), no = $("edit-no");
    // A body cut short in the list, or not text (shown with replacement characters), is not offered for editing
    // as if it were what is stored.
    const partial = m.body_truncated || (m.body ?? "").includes("\uFFFD");
    body.value = partial ? "" : (m.body ?? "");
    $("edit-note").textContent = partial
      ? `The body (${plural(m.body_bytes, "byte")}) is not all shown as text: type the whole new body. The due time stays.`
      : "The due time stays. Refused once the message is taken for delivery.";
    headers.value = Object.entries(m.headers || {}).map(([k, v]) => `${k}=${v}`).join("\n");
    return dialog($("editor"), body, (done) => {
      form.onsubmit = (event) => {
        event.preventDefault();
        const pairs = headers.value.split("\n").map((line) => line.trim()).filter(Boolean);
        const bad = pairs.find((line) => !line.includes("=") || line.startsWith("="));
        if (bad) { say(`A header line must be key=value: “${bad}”`, "error"); return; }
        done({ body: body.value, headers: Object.fromEntries(pairs.map((line) => {
          const at = line.indexOf("="); return [line.slice(0, at), line.slice(at + 1)];
        })) });
      };
      no.onclick = () => done(null);
      return () => { form.onsubmit = no.onclick = null; };
    });
  }

  function editMessage(m) {
    return act(async () => {
      const change = await editForm(m);
      if (!change) return null;
      const report = await api("api/edit", { message_id: m.message_id, ...change });
      if (report.counts.edited) return `Edited ${m.message_id}: new body and headers, same due time.`;
      if (report.in_flight.length) return `Not edited: ${m.message_id} was taken for delivery meanwhile.`;
      return `Not edited: ${m.message_id} is no longer scheduled (delivered or cancelled).`;
    });
  }

  function describe(done, count, counts, notes = []) {
    if (counts.in_flight) notes.push(`${counts.in_flight} in flight (a sweep holds them: not changed)`);
    if (counts.gone) notes.push(`${counts.gone} already gone (delivered or cancelled)`);
    if (counts.unknown) notes.push(`${counts.unknown} unknown`);
    return `${done} ${number(count)} message${count === 1 ? "" : "s"}${notes.length ? "; " + notes.join(", ") : ""}.`;
  }

  function pause(name) {
    return act(async () => {
      if (!await confirmAction(`Pause “${name}”? Its messages stay stored (due ones wait) until it is resumed; `
        + "batches already claimed still finish.", "Pause")) return null;
      await api("api/pause", { destinations: [name] });
      return `Paused ${name}.`;
    });
  }

  function resume(name, due) {
    return act(async () => {
      if (!await confirmAction(`Resume “${name}”? Its ${plural(due, "due message")} will be delivered, oldest first.`,
        "Resume")) return null;
      await api("api/resume", { destinations: [name] });
      return `Resumed ${name}.`;
    });
  }

  function purge(name) {
    return act(async () => {
      const dry = await api("api/purge", { destination: name, dry_run: true });
      const held = dry.in_flight ? `\n${plural(dry.in_flight, "message")} in flight (held by a sweep) will stay.` : "";
      if (!dry.would_purge) return `Nothing to purge in ${name}.${held}`;
      if (!await confirmAction(`Purge ${plural(dry.would_purge, "scheduled message")} of “${name}”? They will never `
        + `be delivered. This cannot be undone.${held}`, `Purge ${dry.would_purge}`)) return null;
      const report = await api("api/purge", { destination: name, dry_run: false });
      return `Purged ${plural(report.purged, "message")} of ${name}.`;
    });
  }

  function forget(name) {
    return act(async () => {
      if (!await confirmAction(`Forget “${name}”? It is no longer listed or known, and its pause, policy and `
        + "queue delay go. (Refused while it has scheduled messages or dead letters.)", "Forget")) return null;
      try {
        await api("api/forget", { destinations: [name] });
        return `Forgot ${name}.`;
      } catch (error) {
        if (error.status !== 400) throw error;
        // Refused (messages scheduled meanwhile, or dead letters): say why, and offer to force it.
        if (!await confirmAction(`${error.message.replace(/^400: /, "")}\n\nForget “${name}” anyway? Its `
          + "scheduled messages are purged; its dead letters stay in the error queue.", "Forget anyway")) return null;
      }
      const report = await api("api/forget", { destinations: [name], force: true });
      const purged = report.purged[name] || 0, left = report.dead_letters_left.includes(name);
      return `Forgot ${name}${purged ? `; purged ${plural(purged, "message")}` : ""}`
        + `${left ? "; its dead letters are still in the error queue" : ""}.`;
    });
  }

  // -- the summary and the chart ---------------------------------------------------------------------------
  async function loadBacklog() {
    const backlog = await api("api/backlog");
    state.backlog = backlog;
    state.canEdit = backlog.can_edit;
    $("who").textContent = `${backlog.user} · ${backlog.can_edit ? "may act" : "read only"} · store ${backlog.conn_id}`;
    $("updated").textContent = `updated ${when(backlog.at)[0]}`;
    showUnavailable(null);
    renderDestinations();
    renderChart();
  }

  function renderDestinations() {
    const { destinations, totals, dead_letters: dl } = state.backlog;
    const names = Object.keys(destinations);
    const dead = dl && !dl.error ? dl.per_destination : null;  // null: not configured, or not countable
    document.querySelector("#destinations th.dl-col").hidden = dead === null;
    const note = $("dl-note");
    note.hidden = !dl;
    if (dl) {
      note.textContent = dl.error
        ? `Dead letters (error queue “${dl.error_queue}” on ${dl.transport}) cannot be counted: ${dl.error}`
        : `Dead letters: error queue “${dl.error_queue}” on ${dl.transport}`
          + (dl.more ? `, counted among the first ${dl.total} (there may be more).` : ".");
    }
    const rows = names.map((name) => {
      const d = destinations[name];
      const actions = state.canEdit ? el("div", { class: "actions" },
        d.paused
          ? el("button", { type: "button", onclick: () => resume(name, d.due) }, "Resume")
          : el("button", { type: "button", onclick: () => pause(name) }, "Pause"),
        el("button", { type: "button", class: "danger", onclick: () => purge(name) }, "Purge…"),
        d.scheduled === 0 && el("button", { type: "button", class: "danger", onclick: () => forget(name) },
          "Forget…")) : "";
      return el("tr", { class: state.chartDestination === name ? "selected" : null, "data-destination": name },
        el("td", {}, el("button", { type: "button", class: "link name", title: "Show its messages and histogram",
          onclick: () => showDestination(name) }, breakable(name))),
        el("td", { class: "num" }, d.scheduled), el("td", { class: "num" }, d.due),
        el("td", { class: "num" }, d.in_flight),
        dead !== null && el("td", { class: "num" }, dead[name] || 0),
        el("td", {}, el("span", { class: `badge ${d.paused ? "paused" : "active"}` }, d.paused ? "paused" : "active"),
          d.held ? el("span", { class: "held-count", title: "Messages paused by a selection or a filter" },
            ` ${number(d.held)} held`) : ""),
        state.canEdit && el("td", {}, actions));
    });
    if (!rows.length) rows.push(el("tr", {}, el("td", { colspan: 7, class: "empty" }, "No destinations yet.")));
    document.querySelector("#destinations th.actions-col").hidden = !state.canEdit;
    $("destinations").tBodies[0].replaceChildren(...rows);
    const paused = names.filter((n) => destinations[n].paused).length;
    $("destinations").tFoot.replaceChildren(el("tr", {},
      el("td", {}, el("button", { type: "button", class: "link all", onclick: () => showDestination(null) },
        "All destinations")),
      el("td", { class: "num" }, totals.scheduled), el("td", { class: "num" }, totals.due),
      el("td", { class: "num" }, totals.in_flight),
      dead !== null && el("td", { class: "num" }, `${dl.total}${dl.more ? "+" : ""}`),
      el("td", {}, paused ? `${paused} paused` : ""),
      state.canEdit && el("td", {})));
    $("known-destinations").replaceChildren(...names.map((n) => el("option", { value: n })));
    renderHistoryDestinations();
  }

  function renderChart() {
    const { destinations } = state.backlog;
    // The buckets and their words come with the report, as the CLI and the API show them.
    const BUCKETS = state.backlog.buckets.map(({ key, label }) => [key, label]);
    const name = state.chartDestination && destinations[state.chartDestination] ? state.chartDestination : null;
    const counts = Object.fromEntries(BUCKETS.map(([key]) => [key, 0]));
    for (const [dest, d] of Object.entries(destinations)) {
      if (name === null || dest === name) for (const [key] of BUCKETS) counts[key] += d.histogram[key] || 0;
    }
    $("histogram-title").textContent = `When the scheduled messages of ${name === null ? "all destinations" : `“${name}”`} are due`;
    $("chart").replaceChildren(window.backlogChart.draw(BUCKETS, counts));
  }

  function showDestination(name) {
    state.chartDestination = name;
    const form = $("search");
    form.elements.destination.value = name || "";
    renderDestinations();
    renderChart();
    search();
    return loading(() => loadHistoryAll(null)).catch(failed);
  }

  // -- the message list ----------------------------------------------------------------------------------
  function search() {
    const form = $("search").elements;
    const id = form.message_id.value.trim();
    // The form's id, else the ids a link named (a send task's extra link: the messages it sent).
    const moment = (input) => (input.value ? window.airflowPrefs.toUtc(input.value) : "");
    state.query = {
      destination: form.destination.value.trim(), header: form.header.value.trim(),
      message_id: id ? [id] : state.ids, limit: form.limit.value, due_from: moment(form.due_from),
      due_before: moment(form.due_before), body_contains: state.canEdit ? form.body_contains.value : "",
    };
    $("id-filter").hidden = Boolean(id) || !state.ids.length;
    $("id-filter-text").textContent = `Only the ${plural(state.ids.length, "message")} the link names.`;
    state.cursors = [];
    state.selected.clear();
    return Promise.all([loadMessages(null), loadMatching()]).catch(failed);
  }

  /** The query of a link to the page: its own URL's (Airflow 3.3 hands the UI's on to the frame), else the UI's
   * (Airflow 3.2 loads the frame without it; the UI is of the same origin, so the frame may read its URL). */
  function linkQuery() {
    if (window.location.search) return window.location.search;
    try {
      return window.parent !== window ? window.parent.location.search : "";
    } catch (_) {
      return "";  // framed by another origin
    }
  }

  /** The filters a link gives in the page's URL (?destination=&header=k=v&message_id=...&limit=), as a search. */
  function searchFromUrl() {
    const params = new URLSearchParams(linkQuery()), form = $("search").elements;
    const destination = (params.get("destination") || "").trim();
    form.destination.value = destination;
    state.chartDestination = destination || null;
    form.header.value = params.get("header") || "";
    const ids = [...new Set(params.getAll("message_id").map((id) => id.trim()).filter(Boolean))];
    if (ids.length === 1) form.message_id.value = ids[0];
    else state.ids = ids;
    if ([...form.limit.options].some((option) => option.value === params.get("limit"))) {
      form.limit.value = params.get("limit");
    }
    return search();
  }

  async function loadMessages(after) {
    const params = new URLSearchParams();
    for (const [key, value] of Object.entries(state.query)) {
      for (const one of Array.isArray(value) ? value : [value]) if (one) params.append(key, one);
    }
    if (after) params.set("after", after);
    const result = await api(`api/messages?${params}`);
    state.after = after;
    state.next = result.next;
    state.page = result.messages;
    state.canEdit = result.can_edit;
    $("body-search").hidden = !state.canEdit;  // searching bodies is seeing them
    for (const id of [...state.selected]) if (!state.page.some((m) => m.message_id === id)) state.selected.delete(id);
    renderMessages();
  }

  function renderMessages() {
    const edit = state.canEdit;
    const heads = [edit && "", "Message id", "Destination", "Due", "Headers", "Failures", "State",
      edit ? "Body" : "Size", edit && "Actions"].filter((h) => h !== false);
    const table = $("messages");
    table.tHead.rows[0].replaceChildren(...heads.map((h, i) => el("th", { scope: "col", class: edit && i === 0 ? "pick" : null },
      edit && i === 0 ? el("input", { type: "checkbox", "aria-label": "Select all on this page", onchange: selectAll,
        checked: state.page.length > 0 && state.page.every((m) => state.selected.has(m.message_id)) }) : h)));
    const rows = state.page.map((m) => {
      const [at, relative] = when(m.due_at);
      const headers = Object.entries(m.headers || {});
      const size = el("span", { class: "size" }, plural(m.body_bytes, "byte"));
      const cells = [
        edit && el("td", { class: "pick" }, el("input", { type: "checkbox", "aria-label": `Select ${m.message_id}`,
          checked: state.selected.has(m.message_id), disabled: m.in_flight,
          onchange: (event) => select(m.message_id, event.target.checked) })),
        el("td", { class: "id" }, storyLink(m.message_id)),
        el("td", { class: "dest" }, m.destination),
        el("td", { class: "due" }, el("span", { class: "day" }, at.slice(0, 10)), " ",
          el("span", { class: "clock" }, at.slice(11)), el("span", { class: "rel" }, relative)),
        el("td", { class: "hdrs" }, headers.length ? el("ul", { class: "headers" }, headers.map(([k, v]) => el("li", {}, `${k}=${v}`))) : ""),
        el("td", { class: "num" }, m.failures),
        // Pause / Resume sits under the state it changes, as Edit under the body: the actions column keeps its width.
        el("td", { class: "state" }, m.in_flight ? el("span", { class: "badge in-flight" }, "in flight")
          : m.held ? el("span", { class: "badge paused held", title: "Paused: not delivered until resumed" }, "held")
            : m.paused ? el("span", { class: "badge paused" }, "paused") : "scheduled",
        edit && !m.in_flight ? el("button", { type: "button", onclick: () => hold([m.message_id], !m.held) },
          m.held ? "Resume" : "Pause") : ""),
        el("td", { class: "body-cell" }, edit && m.body !== undefined
          ? [el("pre", { class: "body" }, m.body + (m.body_truncated ? "…" : "")), size, " ",
            el("button", { type: "button", disabled: m.in_flight, onclick: () => editMessage(m) }, "Edit")] : size),
        edit && el("td", {}, el("div", { class: "actions" },
          el("button", { type: "button", disabled: m.in_flight, onclick: () => runNow([m.message_id]) }, "Run now"),
          el("button", { type: "button", class: "danger", disabled: m.in_flight,
            onclick: () => cancel([m.message_id]) }, "Cancel"))),
      ].filter((c) => c !== false);
      return el("tr", { "data-message-id": m.message_id }, cells);
    });
    if (!rows.length) rows.push(el("tr", {}, el("td", { colspan: heads.length, class: "empty" },
      state.after ? "No more messages." : "No scheduled messages match.")));
    table.tBodies[0].replaceChildren(...rows);
    const page = state.cursors.length + 1;
    $("page-info").textContent = `Page ${page} · ${plural(state.page.length, "message")}`;
    $("prev").disabled = $("first").disabled = page === 1;
    $("next").disabled = !state.next;
    renderBulk();
  }

  function select(id, on) {
    if (on) state.selected.add(id); else state.selected.delete(id);
    renderBulk();
  }

  function selectAll(event) {
    for (const m of state.page) if (!m.in_flight) select(m.message_id, event.target.checked);
    renderMessages();
  }

  function renderBulk() {
    const n = state.selected.size;
    $("bulk").hidden = !state.canEdit || n === 0;
    $("selected-count").textContent = `${plural(n, "message")} selected`;
  }

  function page(direction) {
    if (direction === "next" && state.next) {
      state.cursors.push(state.after);
      return loadMessages(state.next).catch(failed);
    }
    if (direction === "prev" && state.cursors.length) {
      return loadMessages(state.cursors.pop()).catch(failed);
    }
    state.cursors = [];
    return loadMessages(null).catch(failed);
  }

  // -- the delivery history: per minute over a window, the recent entries, one message's story ----------------
  const WINDOWS = { "1h": "the last hour", "6h": "the last 6 hours", "24h": "the last 24 hours" };
  const OUTCOMES = { delivered: "delivered", retried: "retried", dead_lettered: "dead-lettered", cancelled: "cancelled",
    scheduled: "scheduled", unknown: "unknown" };
  const history = {
    window: "1h", outcome: "", limit: 50, chart: null, entries: [], days: null, after: null, next: null, cursors: [],
    story: null, tickets: { chart: 0, entries: 0, story: 0 },
  };

  const entries = (n) => `${n} ${n === 1 ? "entry" : "entries"}`;
  const clockOf = (iso) => window.airflowPrefs.formatTime(iso).slice(11, 16);  // "HH:mm" in the user's zone
  const lateness = (ms) => (ms < 0 ? window.backlogChart.duration(ms) : `${window.backlogChart.duration(ms)} late`);

  /** A message id that opens its story. */
  const storyLink = (id) => el("button", { type: "button", class: "link name", title: "Show its story",
    onclick: () => openStory(id) }, breakable(id));

  /** A time cell as the message list shows due times, in the user's zone: the date, the time of day and the zone each
   * whole (at 1024 px they may go on lines of their own). */
  function timeCell(iso) {
    const at = window.airflowPrefs.formatTime(iso);
    return el("td", { class: "when" }, el("span", { class: "day" }, at.slice(0, 10)), " ",
      el("span", { class: "clock" }, at.slice(11, 19)), " ", el("span", { class: "zone" }, at.slice(20)));
  }

  /** A new ticket of `kind`: an answer that comes back after a newer request's ticket is dropped. */
  const ticket = (kind) => ++history.tickets[kind];

  function loadHistoryAll(after) {
    return Promise.all([loadHistoryChart(), loadHistory(after)]);
  }

  async function loadHistoryChart() {
    const query = new URLSearchParams({ window: history.window });
    if (state.chartDestination) query.set("destination", state.chartDestination);
    const mine = ticket("chart");
    const report = await api(`api/history/chart?${query}`);
    if (mine !== history.tickets.chart) return;
    history.chart = report;
    history.days = report.history_days;
    renderHistoryChart();
  }

  function renderHistoryDestinations() {
    const names = Object.keys((state.backlog && state.backlog.destinations) || {});
    const chosen = state.chartDestination, select = $("history-destination");
    if (chosen && !names.includes(chosen)) names.push(chosen);  // from a link: not (or no longer) a known one
    const key = JSON.stringify(names);
    if (select.dataset.names !== key) {  // the same names: left as they are (a refresh does not close it while open)
      select.replaceChildren(el("option", { value: "" }, "All destinations"), ...names.map((n) => el("option", { value: n }, n)));
      select.dataset.names = key;
    }
    select.value = chosen || "";
  }

  function renderKept(days) {
    $("history-kept").textContent = days === 0 ? "No history kept (history_days is 0)."
      : days ? `Kept ${plural(days, "day")} (the connection's history_days).` : "";
  }

  function renderHistoryChart() {
    const report = history.chart;
    if (!report) return;
    const of = report.destination ? `“${report.destination}”` : "all destinations";
    const span = WINDOWS[report.window] || report.window;
    $("history-chart-title").textContent = `Delivered per minute to ${of} in ${span}, and their lateness`;
    renderKept(report.history_days);
    const box = $("history-chart"), legend = $("history-legend");
    const empty = (text) => {
      legend.hidden = true;
      box.replaceChildren(el("p", { class: "empty", role: "status" }, text));
    };
    if (report.history_days === 0) {
      return empty("No delivery history is kept: the store's connection turns it off (its history_days extra is 0; "
        + "set it to the days to keep, 1 to 90, default 7).");
    }
    if (!report.minutes.length) {
      return empty(`No deliveries${report.destination ? ` to “${report.destination}”` : ""} in ${span}.`);
    }
    const sum = (key) => report.minutes.reduce((n, m) => n + m[key], 0);
    const busiest = report.minutes.reduce((a, b) => (b.delivered > a.delivered ? b : a));
    const timed = report.minutes.filter((m) => m.p99_ms !== null);
    const worst = (key) => Math.max(...timed.map((m) => m[key]));
    const summary = `Deliveries per minute to ${of} in ${span}: ${number(sum("delivered"))} delivered, `
      + `${number(sum("retried"))} retried, ${number(sum("dead_lettered"))} dead-lettered, `
      + `${number(sum("cancelled"))} cancelled`
      + (busiest.delivered ? `; the busiest minute ${clockOf(busiest.minute)} with ${number(busiest.delivered)}` : "")
      + (timed.length ? `; lateness p50 up to ${window.backlogChart.duration(worst("p50_ms"))}, `
        + `p99 up to ${window.backlogChart.duration(worst("p99_ms"))}` : "")
      + ".";
    legend.hidden = false;
    box.replaceChildren(window.backlogChart.drawHistory(report, clockOf, summary));
  }

  async function loadHistory(after) {
    const query = new URLSearchParams({ limit: String(history.limit) });
    if (state.chartDestination) query.set("destination", state.chartDestination);
    if (history.outcome) query.set("outcome", history.outcome);
    // The cursor of the page before (`next`): a batch shares one hand-over time, so a time alone would skip some.
    if (after) query.set("after", after);
    const mine = ticket("entries");
    const result = await api(`api/history?${query}`);
    if (mine !== history.tickets.entries) return;
    history.after = after || null;
    history.next = result.next;
    history.entries = result.entries;
    history.days = result.history_days;
    renderHistory();
  }

  function renderHistory() {
    const rows = history.entries.map((e) => el("tr", { "data-entry-of": e.message_id, "data-outcome": e.outcome },
      el("td", { class: "id" }, storyLink(e.message_id)),
      el("td", { class: "dest" }, breakable(e.destination)),
      el("td", {}, el("span", { class: `badge ${e.outcome}` }, OUTCOMES[e.outcome] || e.outcome)),
      timeCell(e.due_at), timeCell(e.handed_at),
      el("td", { class: `num${e.lateness_ms < 0 ? " early" : ""}` }, window.backlogChart.duration(e.lateness_ms)),
      el("td", { class: "num" }, e.attempts),
      el("td", { class: "detail" }, e.detail || "")));
    if (!rows.length) {
      const which = history.outcome ? `${OUTCOMES[history.outcome]} ` : "";
      const of = state.chartDestination ? ` of “${state.chartDestination}”` : "";
      rows.push(el("tr", {}, el("td", { colspan: 8, class: "empty" }, history.days === 0
        ? "No history is kept: the connection's history_days extra is 0."
        : history.after ? "No older entries." : `No ${which}messages${of} in the history.`)));
    }
    $("history").tBodies[0].replaceChildren(...rows);
    const page = history.cursors.length + 1;
    $("history-info").textContent = `Page ${page} · ${entries(history.entries.length)}, newest first`;
    $("history-newest").disabled = $("history-newer").disabled = page === 1;
    $("history-older").disabled = !history.next;
  }

  function historyPage(direction) {
    let after = null;
    if (direction === "older" && history.next) {
      history.cursors.push(history.after);
      after = history.next;
    } else if (direction === "newer" && history.cursors.length) {
      after = history.cursors.pop();
    } else {
      history.cursors = [];
    }
    return loading(() => loadHistory(after)).catch(failed);
  }

  /** The recent entries again from their newest (a filter changed). */
  function historyFromNewest() {
    history.cursors = [];
    return loading(() => loadHistory(null)).catch(failed);
  }

  async function loadStory(id) {
    const mine = ticket("story");
    const story = await api(`api/story?${new URLSearchParams({ message_id: id })}`);
    if (mine !== history.tickets.story) return;
    history.story = story;
    renderStory();
  }

  /** Show the story of `id` (a message id clicked in a list, or typed), and bring it into view. */
  function openStory(id) {
    $("story-id").value = id;
    return loading(async () => {
      await loadStory(id);
      $("story-title").scrollIntoView({ block: "start" });
    }).catch(failed);
  }

  function renderStory() {
    const s = history.story, box = $("story");
    box.hidden = !s;
    if (!s) return;
    const time = (iso) => window.airflowPrefs.formatTime(iso);
    const row = s.scheduled;
    const destination = row ? row.destination : s.history.length ? s.history[s.history.length - 1].destination : null;
    const head = el("p", { class: "story-head" }, el("strong", {}, breakable(s.message_id)),
      el("span", { class: `badge ${s.state}`, "data-state": s.state }, OUTCOMES[s.state] || s.state),
      destination && el("span", {}, "to ", breakable(destination)));
    const steps = [];
    if (s.stored_at) steps.push(el("li", { class: "stored" }, el("span", { class: "when" }, time(s.stored_at)), "Stored"));
    for (const e of s.history) {
      const what = e.outcome === "cancelled" ? "Cancelled" : `Attempt ${e.attempts}: ${OUTCOMES[e.outcome] || e.outcome}`;
      steps.push(el("li", { class: e.outcome, "data-outcome": e.outcome, "data-attempt": e.attempts },
        el("span", { class: "when" }, time(e.handed_at)), el("strong", {}, what),
        ` to ${e.destination}, ${lateness(e.lateness_ms)} (due ${time(e.due_at)})`,
        e.detail && el("span", { class: "detail" }, e.detail)));
    }
    if (row) {
      const [at, relative] = when(row.due_at);
      const where = row.in_flight ? "taken for delivery (in flight)" : row.paused ? "held: its destination is paused"
        : "waiting for its due time";
      steps.push(el("li", { class: "scheduled" }, el("span", { class: "when" }, at),
        el("strong", {}, s.history.length ? "Scheduled again" : "Scheduled"), `: due ${relative.replace(/^due /, "")}, ${where}`));
    }
    const parts = [head];
    if (steps.length) parts.push(el("ol", { class: "timeline" }, steps));
    if (s.state === "unknown") {
      parts.push(el("p", { class: "note" }, s.history_days === 0
        ? "Not in the store, and no history is kept (the connection's history_days extra is 0)."
        : `Not in the store, and not in the history: never stored under this id, or handled more than `
          + `${plural(s.history_days, "day")} ago (the history's retention).`));
    }
    if (row) {
      const headers = Object.entries(row.headers || {});
      parts.push(el("h4", {}, "The scheduled message"),
        el("dl", { class: "facts" }, [["Due", time(row.due_at)], ["Stored", row.stored_at ? time(row.stored_at) : ""],
          ["Failures so far", row.failures], ["Size", plural(row.body_bytes, "byte")]]
          .map(([k, v]) => [el("dt", {}, k), el("dd", {}, v)])),
        el("h4", {}, "Headers"),
        headers.length ? el("ul", { class: "headers" }, headers.map(([k, v]) => el("li", {}, `${k}=${v}`)))
          : el("p", { class: "note" }, "No headers."),
        row.body !== undefined
          ? [el("h4", {}, "Body"), el("pre", { class: "body" }, row.body + (row.body_truncated ? "…" : ""))]
          : el("p", { class: "note" }, `Body: ${plural(row.body_bytes, "byte")}, shown to the roles that may act.`));
    }
    box.replaceChildren(...parts.flat());
  }

  // -- dead letters: each error queue the store knows of (provisioning and the dispatchers record them) -------
  const dead = { letters: [], selected: new Set(), open: new Set(), canEdit: false, route: null };

  async function loadDeadLetters() {
    const query = new URLSearchParams({ limit: "100" });
    const destination = $("dead-destination").value.trim(), failure = $("dead-failure").value.trim();
    if (destination) query.set("destination", destination);
    if (failure) query.set("failure", failure);
    if (dead.route) query.set("route", dead.route);
    const result = await api(`api/dead-letters?${query}`);
    dead.canEdit = result.can_edit;
    dead.letters = result.dead_letters;
    renderRoutes(result.routes || [], result.route || null);
    for (const id of [...dead.selected]) if (!dead.letters.some((d) => d.message_id === id)) dead.selected.delete(id);
    $("dead-note").textContent = result.available
      ? `${plural(dead.letters.length, "dead letter")}${result.more ? " (more in the queue)" : ""} in ${result.transport} queue ${result.error_queue}, oldest first; looking consumes nothing.`
      : `No dead letters to show: ${result.reason}.`;
    $("dead-search").hidden = !result.available;
    renderDeadLetters();
  }

  // Several error queues (transports or dispatchers of their own): a choice of which to look at.
  function renderRoutes(routes, chosen) {
    dead.route = chosen;
    const select = $("dead-route");
    select.replaceChildren(...routes.map((r) => el("option", { value: r.key, selected: r.key === chosen },
      `${r.error_queue} (${r.transport})`)));
    $("dead-route-label").hidden = routes.length < 2;
  }

  function renderDeadLetters() {
    const edit = dead.canEdit;
    const heads = [edit && "", "Message id", "Destination", "Attempts", "Last failed", "Last error", edit ? "Body" : "Size"]
      .filter((h) => h !== false);
    const table = $("dead-letters");
    table.tHead.rows[0].replaceChildren(...heads.map((h) => el("th", { scope: "col" }, h)));
    const rows = dead.letters.flatMap((d) => [el("tr", { "data-message-id": d.message_id }, [
      edit && el("td", { class: "pick" }, el("input", { type: "checkbox", "aria-label": `Select dead letter ${d.message_id}`,
        checked: dead.selected.has(d.message_id),
        onchange: (event) => { if (event.target.checked) dead.selected.add(d.message_id); else dead.selected.delete(d.message_id); renderDeadBulk(); } })),
      el("td", { class: "id" }, el("button", { type: "button", class: "link", "aria-expanded": dead.open.has(d.message_id) ? "true" : "false",
        title: "Details", onclick: () => { if (!dead.open.delete(d.message_id)) dead.open.add(d.message_id); renderDeadLetters(); } }, d.message_id)),
      el("td", { class: "dest" }, d.destination || "(unknown)"),
      el("td", { class: "num" }, d.attempts ?? ""), el("td", {}, d.last_failed_at ? window.airflowPrefs.formatTime(d.last_failed_at) : ""),
      el("td", { class: "error-text" }, d.last_error || ""),
      el("td", {}, edit && d.body !== null ? el("pre", { class: "body" }, d.body + (d.body_truncated ? "…" : ""))
        : plural(d.body_bytes, "byte")),
    ].filter((c) => c !== false)), dead.open.has(d.message_id) && deadLetterDetail(d, heads.length, edit)]
      .filter(Boolean));
    if (!rows.length) rows.push(el("tr", {}, el("td", { colspan: heads.length, class: "empty" }, "No dead letters match.")));
    table.tBodies[0].replaceChildren(...rows);
    renderDeadBulk();
  }

  // Everything the error queue says of one dead letter: its failures, why the policy gave up, every header, and
  // (for the roles that may act) the body as far as the listing carries it.
  function deadLetterDetail(d, columns, edit) {
    const time = (iso) => (iso ? window.airflowPrefs.formatTime(iso) : "");
    const facts = [["Destination", d.destination || "(unknown)"], ["Attempts", d.attempts ?? ""],
      ["First failed", time(d.first_failed_at)], ["Last failed", time(d.last_failed_at)],
      ["Last error", d.last_error || ""], ["Gave up", d.gave_up || "(not recorded)"],
      ["Redriven before", d.redriven], ["In the error queue since", time(d.enqueued_at)]];
    return el("tr", { class: "detail", "data-detail-of": d.message_id }, el("td", { colspan: columns },
      el("dl", { class: "facts" }, facts.map(([k, v]) => [el("dt", {}, k), el("dd", {}, v)])),
      el("h4", {}, "Headers"),
      el("ul", { class: "headers" }, Object.entries(d.headers || {}).map(([k, v]) => el("li", {}, `${k}=${v}`))),
      edit && d.body !== null
        ? [el("h4", {}, "Body"), el("pre", { class: "body" }, d.body + (d.body_truncated ? "…" : ""))]
        : el("p", { class: "note" }, `Body: ${plural(d.body_bytes, "byte")}, shown to the roles that may act.`)));
  }

  function renderDeadBulk() {
    $("dead-bulk").hidden = !dead.canEdit || dead.selected.size === 0;
    $("dead-selected-count").textContent = `${plural(dead.selected.size, "dead letter")} selected`;
  }

  function deadAction(kind) {
    const ids = [...dead.selected];
    return act(async () => {
      const text = kind === "redrive"
        ? `Store ${plural(ids.length, "dead letter")} again for their destination, due now?\n\n${idList(ids)}`
        : `Delete ${plural(ids.length, "dead letter")} for good?\n\n${idList(ids)}`;
      if (!await confirmAction(text, kind === "redrive" ? "Redrive" : "Delete")) return null;
      const report = await api(`api/dead-letters/${kind}`, kind === "redrive" ? { message_ids: ids, route: dead.route }
        : { message_ids: ids, dry_run: false, route: dead.route });
      dead.selected.clear();
      await loadDeadLetters();
      if (kind === "delete") return `Deleted ${plural(report.deleted, "dead letter")}.`;
      const skipped = report.skipped ? ` ${report.skipped} left in the error queue: ${report.skipped_messages.map((s) => `${s.message_id}: ${s.reason}`).join("; ")}` : "";
      return `Redriven ${plural(report.redriven, "dead letter")}.${skipped}`;
    });
  }

  /** What an action acted on, as one line: its ids, destinations and headers. */
  function target(t) {
    const parts = [];
    if (t.message_id) parts.push(`id ${t.message_id}`);
    if (t.message_ids) parts.push(`ids ${t.message_ids.join(", ")}`);
    if (t.destination) parts.push(t.destination);
    if (t.destinations) parts.push(t.destinations.join(", "));
    if (t.headers) parts.push(Object.entries(t.headers).map(([k, v]) => `${k}=${v}`).join(", "));
    if (t.due_from) parts.push(`due from ${window.airflowPrefs.formatTime(t.due_from)}`);
    if (t.due_before) parts.push(`due before ${window.airflowPrefs.formatTime(t.due_before)}`);
    if (t.body_contains) parts.push(`body containing “${t.body_contains}”`);
    if (t.everything) parts.push("everything");
    return parts.join("; ");
  }

  async function loadActions() {
    const { actions } = await api("api/actions?limit=20");
    $("actions").tBodies[0].replaceChildren(...(actions.length ? actions.map((a) => el("tr", {},
      el("td", {}, a.when ? window.airflowPrefs.formatTime(a.when) : ""), el("td", {}, a.user),
      el("td", {}, a.action.replace(/_/g, " ")), el("td", {}, breakable(target(a.target || {}))),
      el("td", {}, Object.entries(a.counts || {}).map(([k, n]) => `${k} ${n}`).join(", ")),
      el("td", {}, a.source === "cli" ? "command line" : "this page")))
      : [el("tr", {}, el("td", { colspan: 6 }, "No actions recorded yet."))]));
  }

  function refresh() {
    return loading(() => Promise.all([loadBacklog(), loadMessages(state.after), loadActions(), loadDeadLetters(),
      loadHistoryAll(history.after), history.story ? loadStory(history.story.message_id) : null])).catch(failed);
  }

  /** A failed load: said in the status line; a 503 (the store cannot be used) also names the connection. */
  function failed(error) {
    say(error.message, "error");
    if (error.status === 503) showUnavailable(error);
  }

  function showUnavailable(error) {
    $("unavailable").hidden = !error;
    if (!error) return;
    $("unavailable-conn").textContent = error.connId
      ? `The page shows the store of the Airflow connection “${error.connId}” ([delay_provider] ui_conn_id).`
      : "The page's store connection ([delay_provider] ui_conn_id) cannot be used.";
    $("unavailable-detail").textContent = error.detail;
  }

  function showZone() {
    const { zone, chosen } = window.airflowPrefs.timeZone();
    $("zone").textContent = `Times in ${zone}, ${chosen ? "the time zone chosen in Airflow's user menu"
      : "this browser's (Airflow's user menu can choose another)"}.`;
  }

  document.addEventListener("DOMContentLoaded", () => {
    $("search").addEventListener("submit", (event) => { event.preventDefault(); search(); });
    $("clear").addEventListener("click", () => {
      $("search").reset();
      state.chartDestination = null;
      state.ids = [];
      renderChart();
      renderHistoryDestinations();
      search();
      loading(() => loadHistoryAll(null)).catch(failed);
    });
    $("id-filter-clear").addEventListener("click", () => { state.ids = []; search(); });
    $("refresh").addEventListener("click", refresh);
    $("first").addEventListener("click", () => page("first"));
    $("prev").addEventListener("click", () => page("prev"));
    $("next").addEventListener("click", () => page("next"));
    $("bulk-cancel").addEventListener("click", () => cancel([...state.selected]));
    $("bulk-run-now").addEventListener("click", () => runNow([...state.selected]));
    $("bulk-pause").addEventListener("click", () => hold([...state.selected], true));
    $("bulk-resume").addEventListener("click", () => hold([...state.selected], false));
    $("match-pause").addEventListener("click", () => onFilter("pause"));
    $("match-resume").addEventListener("click", () => onFilter("resume"));
    $("match-cancel").addEventListener("click", () => onFilter("cancel"));
    $("match-run-now").addEventListener("click", () => onFilter("run_now"));
    $("match-reschedule").addEventListener("click", () => onFilter("reschedule"));
    showZone();
    window.airflowPrefs.onChange(() => {  // the user chose another zone (or theme) in Airflow's UI
      showZone();
      if (state.backlog) $("updated").textContent = `updated ${when(state.backlog.at)[0]}`;
      renderMessages();
      renderHistoryChart();
      renderHistory();
      renderStory();
    });
    $("dead-search").addEventListener("submit", (event) => { event.preventDefault(); loading(loadDeadLetters).catch(failed); });
    $("dead-route").addEventListener("change", (event) => {
      dead.route = event.target.value;
      dead.selected.clear();
      loading(loadDeadLetters).catch(failed);
    });
    $("dead-redrive").addEventListener("click", () => deadAction("redrive"));
    $("dead-delete").addEventListener("click", () => deadAction("delete"));
    $("history-bar").addEventListener("submit", (event) => event.preventDefault());
    $("history-window").addEventListener("change", (event) => {
      history.window = event.target.value;
      loading(loadHistoryChart).catch(failed);
    });
    $("history-destination").addEventListener("change", (event) => showDestination(event.target.value || null));
    $("history-filter").addEventListener("submit", (event) => event.preventDefault());
    $("history-outcome").addEventListener("change", (event) => { history.outcome = event.target.value; historyFromNewest(); });
    $("history-limit").addEventListener("change", (event) => { history.limit = Number(event.target.value); historyFromNewest(); });
    $("history-newest").addEventListener("click", () => historyPage("newest"));
    $("history-newer").addEventListener("click", () => historyPage("newer"));
    $("history-older").addEventListener("click", () => historyPage("older"));
    $("story-form").addEventListener("submit", (event) => {
      event.preventDefault();
      const id = $("story-id").value.trim();
      if (id) openStory(id);
    });
    // The first loads, the page busy until all are in (searchFromUrl first: a link's destination is the history's).
    loading(() => Promise.all([searchFromUrl(), loadBacklog().catch(failed), loadActions().catch(failed),
      loadDeadLetters().catch(failed), loadHistoryAll(null).catch(failed)]));
    setInterval(() => {
      if (document.hidden || state.busy || !$("confirm").hidden || !$("rescheduler").hidden) return;
      loadBacklog().catch(failed);
      loadHistoryChart().catch(failed);
    }, REFRESH_MS);
  });
})();
