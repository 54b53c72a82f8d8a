/* Turnstile runs list: live refresh.  Polls GET /api/runs with the page's own search and filters;
   when a run appears, goes, changes state, steps or labels, the list and the Engines table are
   re-rendered from the page (the server's rendering, not a copy of it here).  Ticked runs stay ticked. */
"use strict";

(function () {
  const POLL_MS = 3000;

  /* One string per list state: runs in order with what the page shows of each. */
  function signature(runs) {
    return JSON.stringify(runs.map((r) => {
      const counts = r.episodes_by_status || {};
      return [r.id, r.status, r.policy_version, Object.keys(counts).sort().map((k) => [k, counts[k]]),
              r.name || null, r.tags || []];
    }));
  }

  function start() {
    const section = document.getElementById("runs-section");
    const state = document.getElementById("runs-state");
    if (!section || !state) return;
    let last = signature(JSON.parse(state.textContent)); // what the server rendered: nothing is missed
    let lastGood = new Date();
    const query = section.dataset.query ? section.dataset.query + "&" : "";
    const url = `/api/runs?${query}limit=${section.dataset.limit}`;

    function mark(problem) {
      const live = document.getElementById("runs-live");
      if (!live) return;
      live.classList.toggle("stale", Boolean(problem));
      live.textContent = problem ? `refresh failed (${problem}); showing ${lastGood.toLocaleTimeString()}, retrying` : "live";
    }

    async function refresh() {
      const resp = await fetch(window.location.href, { headers: { Accept: "text/html" } });
      if (!resp.ok) return `the page answered HTTP ${resp.status}`;
      const doc = new DOMParser().parseFromString(await resp.text(), "text/html");
      const ticked = new Set(Array.from(document.querySelectorAll('#runs input[name="compare"]:checked'), (el) => el.value));
      for (const id of ["runs-section", "engines-section"]) {
        const fresh = doc.getElementById(id), current = document.getElementById(id);
        if (fresh && current) current.replaceWith(fresh);
      }
      document.querySelectorAll('#runs input[name="compare"]').forEach((el) => { el.checked = ticked.has(el.value); });
      return null;
    }

    async function tick() {
      if (document.hidden) return schedule(); // nobody looks: no requests
      let runs;
      try {
        const resp = await fetch(url, { headers: { Accept: "application/json" } });
        if (!resp.ok) return failed(`HTTP ${resp.status}`);
        runs = (await resp.json()).runs;
      } catch (err) {
        return failed("the API cannot be reached");
      }
      const sig = signature(runs);
      if (sig !== last) {
        let error;
        try {
          error = await refresh();
        } catch (err) {
          error = "the page cannot be reached";
        }
        if (error) return failed(error); // `last` kept: the next tick tries again
        last = sig;
      }
      lastGood = new Date();
      mark(null);
      schedule();
    }
    function failed(why) { mark(why); schedule(); }
    function schedule() { setTimeout(tick, POLL_MS); }
    schedule();
  }

  document.addEventListener("DOMContentLoaded", start);
})();
