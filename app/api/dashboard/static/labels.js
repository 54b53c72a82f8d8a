/* Turnstile run page: the name, tags and notes form.  PATCH /api/runs/<id>; saved, the page reloads
   to show them; refused (400), the API's reasons appear and what was typed stays. */
"use strict";

(function () {
  function csrf() {
    const meta = document.querySelector('meta[name="csrf-token"]');
    return meta && meta.content ? { "X-CSRF-Token": meta.content } : {};
  }

  function bind(form) {
    form.addEventListener("submit", async (event) => {
      event.preventDefault();
      const out = document.getElementById("labels-result");
      out.classList.remove("error");
      out.textContent = "saving…";
      const tags = form.elements.tags.value.split(",").map((t) => t.trim()).filter((t) => t);
      const body = { name: form.elements.name.value, tags: tags, notes: form.elements.notes.value };
      let resp, answer;
      try {
        resp = await fetch(`/api/runs/${form.dataset.runId}`, {
          method: "PATCH", headers: { "Content-Type": "application/json", ...csrf() }, body: JSON.stringify(body) });
        answer = await resp.json();
      } catch (err) {
        out.classList.add("error");
        out.textContent = "not saved: the API cannot be reached";
        return;
      }
      if (resp.ok) {
        window.location.reload();
        return;
      }
      const err = answer.error || { message: `HTTP ${resp.status}` };
      const details = err.details && err.details.length ? err.details : [{ field: err.field, message: err.message }];
      out.classList.add("error");
      out.textContent = "not saved: " + details.map((d) => (d.field ? `${d.field}: ${d.message}` : d.message)).join("; ");
    });
  }

  document.addEventListener("DOMContentLoaded", () => {
    const form = document.getElementById("labels-form");
    if (form) bind(form);
  });
})();
