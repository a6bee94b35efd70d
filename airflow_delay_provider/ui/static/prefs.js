// The Airflow UI's own settings, which the page follows: the UI keeps them in this origin's localStorage, and
// shows the page in a same-origin frame (Airflow 3.3: sandbox "allow-scripts allow-same-origin ..."), so the
// page reads them as the UI wrote them, and hears the UI change them (a `storage` event reaches every other
// document of the origin, this frame included):
//   "theme": the colour mode (next-themes under Chakra UI): "light", "dark" or "system" (none chosen: system);
//   "timezone": the user's time zone as JSON ("\"Europe/Paris\""); none chosen: the browser's zone, as the UI.
// Loaded in <head>, not deferred, so that the page paints in the right colours from its first frame.
"use strict";

(() => {
  const THEME_KEY = "theme", ZONE_KEY = "timezone";
  const osDark = window.matchMedia("(prefers-color-scheme: dark)");
  const listeners = [];

  function read(key) {
    try { return window.localStorage.getItem(key); } catch (_) { return null; }  // storage turned off
  }

  /** "dark" or "light": Airflow's choice, else (system, or none) the operating system's. */
  function theme() {
    const chosen = read(THEME_KEY);
    if (chosen === "dark" || chosen === "light") return chosen;
    return osDark.matches ? "dark" : "light";
  }

  const browserZone = () => Intl.DateTimeFormat().resolvedOptions().timeZone || "UTC";

  /** { zone, chosen }: the zone chosen in Airflow's UI when it is one this browser knows, else the browser's. */
  function timeZone() {
    let zone = null;
    try { zone = JSON.parse(read(ZONE_KEY)); } catch (_) { /* unset or not JSON */ }
    if (typeof zone === "string" && zone) {
      try {
        new Intl.DateTimeFormat("en-US", { timeZone: zone });
        return { zone, chosen: true };
      } catch (_) { /* a zone this browser does not know */ }
    }
    return { zone: browserZone(), chosen: false };
  }

  const formats = new Map();
  /** `iso` as "YYYY-MM-DD HH:mm:ss ZONE" in the user's zone (Airflow's own pages' form), e.g. "... 14:05:09 CET". */
  function formatTime(iso) {
    const { zone } = timeZone();
    if (!formats.has(zone)) {
      formats.set(zone, new Intl.DateTimeFormat("en-US", {
        timeZone: zone, year: "numeric", month: "2-digit", day: "2-digit", hour: "2-digit", minute: "2-digit",
        second: "2-digit", hourCycle: "h23", timeZoneName: "short",
      }));
    }
    const parts = Object.fromEntries(formats.get(zone).formatToParts(new Date(iso)).map((p) => [p.type, p.value]));
    return `${parts.year}-${parts.month}-${parts.day} ${parts.hour}:${parts.minute}:${parts.second} ${parts.timeZoneName}`;
  }

  /** A wall time of a datetime-local input ("YYYY-MM-DDTHH:mm[:ss]") in the user's zone, as an ISO time in UTC. */
  function toUtc(local) {
    const [y, mo, d, h, mi, s = 0] = local.split(/[-T:]/).map(Number);
    const wall = Date.UTC(y, mo - 1, d, h, mi, s);
    const { zone } = timeZone();
    const numeric = new Intl.DateTimeFormat("en-US", { timeZone: zone, year: "numeric", month: "numeric",
      day: "numeric", hour: "numeric", minute: "numeric", second: "numeric", hourCycle: "h23" });
    const offset = (at) => {
      const p = Object.fromEntries(numeric.formatToParts(new Date(at)).map((part) => [part.type, Number(part.value)]));
      return Date.UTC(p.year, p.month - 1, p.day, p.hour, p.minute, p.second) - at;
    };
    // The zone's offset at the guess, then at the instant found (they differ across a change of offset).
    const first = wall - offset(wall);
    return new Date(wall - offset(first)).toISOString();
  }

  function apply() {
    const mode = theme();
    document.documentElement.dataset.theme = mode;
    document.documentElement.style.colorScheme = mode;
  }

  function changed() {
    apply();
    for (const listener of listeners) listener();
  }

  apply();
  window.addEventListener("storage", (event) => {
    if (event.key === null || event.key === THEME_KEY || event.key === ZONE_KEY) changed();
  });
  osDark.addEventListener("change", changed);
  window.airflowPrefs = { theme, timeZone, formatTime, toUtc, onChange: (listener) => listeners.push(listener) };
})();
