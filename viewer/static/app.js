// tracetap viewer: the token detail panel and the live page. No library, no build step.
// Everything agent-made is put into the page with textContent, never as HTML.
(function () {
  "use strict";

  function el(tag, attrs, text) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
    if (text !== undefined && text !== null) node.textContent = String(text);
    return node;
  }

  function when(t) {
    return new Date(t * 1000).toISOString().replace("T", " ");
  }

  function secs(v) {
    if (v === null || v === undefined) return "\u2013";
    return v < 1 ? Math.round(v * 1000) + " ms" : v.toFixed(2) + " s";
  }

  function rewardClass(v) {
    if (v === null || v === undefined) return "rn";
    return v <= 0 ? "r0" : v < 0.5 ? "r1" : v < 1 ? "r2" : "r3";
  }

  function rewardText(v) {
    return v === null || v === undefined ? "\u2013" : String(Math.round(v * 1000) / 1000);
  }

  // -- token view -------------------------------------------------------------------
  function tokenView(data, box, detail) {
    const prefix = document.body.dataset.prefix || "/tracetap/ui";
    const spans = Array.from(box.querySelectorAll(".t"));
    spans.forEach((s, i) => { s.dataset.k = i; });
    let current = -1;

    function kind(i) {
      if (data.mask[i]) return "trained (sampled by the model, mask 1)";
      if (data.start + i < data.nprompt) return "prompt (not trained)";
      if (data.model[i]) return "sampled by the model, context in this row (trained in another row)";
      return "observation: tool output or template (not trained)";
    }

    function spanOf(pos) {
      return data.spans.find((s) => s[0] <= pos && pos < s[1]);
    }

    function row(dl, name, value) {
      dl.append(el("dt", {}, name));
      const dd = el("dd");
      if (value instanceof Node) dd.append(value); else dd.textContent = value;
      dl.append(dd);
    }

    function show(i) {
      const pos = data.start + i;
      const node = spans[i];
      const unknown = node.classList.contains("u");
      const text = unknown ? null : node.textContent;
      const dl = el("dl");
      row(dl, "position", String(pos));
      row(dl, "id", String(data.ids[i]));
      row(dl, "text", unknown ? "(no tokenizer reachable: id only)" : JSON.stringify(text));
      if (!unknown) {
        const bytes = Array.from(new TextEncoder().encode(text))
          .map((b) => b.toString(16).padStart(2, "0")).join(" ");
        row(dl, "bytes", bytes || "(none)");
      }
      row(dl, "kind", kind(i));
      if (data.lp && data.mask[i]) {
        const lp = data.lp[i];
        row(dl, "logprob", lp.toFixed(4) + "  (p = " + Math.exp(lp).toFixed(3) + ")");
      }
      const alts = data.alt[String(pos)];
      if (alts) {
        const list = el("ol", { class: "alts" });
        for (const [tok, lp] of alts) {
          list.append(el("li", {}, JSON.stringify(tok) + "  " + Number(lp).toFixed(3)));
        }
        row(dl, "alternatives", list);
      } else if (data.mask[i] || data.model[i]) {
        row(dl, "alternatives", "not captured (the client did not ask for top_logprobs)");
      }
      const span = spanOf(pos);
      if (span) {
        const link = el("a", { href: prefix + "/calls/" + encodeURIComponent(span[4]) },
          "turn " + span[2] + ", call " + span[3]);
        row(dl, "from", link);
      }
      detail.replaceChildren(dl);
    }

    function select(i) {
      if (i < 0 || i >= spans.length) return;
      if (current >= 0) spans[current].classList.remove("sel");
      current = i;
      spans[i].classList.add("sel");
      spans[i].scrollIntoView({ block: "nearest" });
      show(i);
    }

    box.addEventListener("mouseover", (event) => {
      const t = event.target.closest(".t");
      if (t && box.contains(t)) select(Number(t.dataset.k));
    });
    box.addEventListener("click", (event) => {
      const t = event.target.closest(".t");
      if (t && box.contains(t)) { select(Number(t.dataset.k)); box.focus({ preventScroll: true }); }
    });
    box.addEventListener("focus", () => { if (current < 0) select(0); });
    box.addEventListener("keydown", (event) => {
      const moves = { ArrowRight: 1, ArrowLeft: -1, ArrowDown: 20, ArrowUp: -20,
        PageDown: 200, PageUp: -200 };
      let next = null;
      if (event.key in moves) next = Math.max(0, Math.min(spans.length - 1, current + moves[event.key]));
      else if (event.key === "Home") next = 0;
      else if (event.key === "End") next = spans.length - 1;
      if (next !== null) { event.preventDefault(); select(next); }
    });
  }

  // -- live page ----------------------------------------------------------------------
  function liveFeed(root) {
    const prefix = root.dataset.prefix;
    const calls = document.getElementById("live-calls");
    const episodes = document.getElementById("live-episodes");
    const state = document.getElementById("live-state");
    const pause = document.getElementById("live-pause");
    const held = document.getElementById("live-held");
    const queue = [];
    let paused = false;

    function link(path, text) {
      return el("a", { href: prefix + path }, text);
    }

    function cell(tr, content, cls) {
      const td = el("td", cls ? { class: cls } : {});
      if (content instanceof Node) td.append(content); else td.textContent = content;
      tr.append(td);
    }

    function trim(list, keep) {
      list.querySelectorAll(".placeholder").forEach((p) => p.remove());
      while (list.children.length > keep) list.lastElementChild.remove();
    }

    function addCall(c) {
      const tr = el("tr", { class: "new" });
      cell(tr, link("/calls/" + encodeURIComponent(c.call_id), when(c.stored_at)), "time");
      cell(tr, c.episode_id ? link("/episodes/" + encodeURIComponent(c.episode_id), c.episode_id)
        : el("span", { class: "muted" }, "untagged"));
      cell(tr, c.endpoint);
      const failed = c.http_status !== 200 || !["ok", "passthrough"].includes(c.status);
      cell(tr, failed ? el("span", { class: "badge failed" }, c.status + " " + c.http_status)
        : c.status + " " + c.http_status);
      cell(tr, String((c.prompt_tokens || 0) + (c.completion_tokens || 0)), "num");
      cell(tr, c.t_end ? secs(c.t_end - c.t_start) : "\u2013", "num");
      calls.prepend(tr);
      trim(calls, 500);
    }

    function addEpisode(e) {
      const li = el("li", { class: "new" });
      li.append(link("/episodes/" + encodeURIComponent(e.id), e.id), " ");
      if (e.finished_at) {
        li.append("finished, ", el("span", { class: "reward " + rewardClass(e.reward) },
          "reward " + rewardText(e.reward)));
        if (e.outcome) li.append(" (" + e.outcome + ")");
      } else {
        li.append("started");
      }
      episodes.prepend(li);
      trim(episodes, 200);
    }

    // What the page already shows (its first rows, or an event seen before a reconnect)
    // is not added twice.
    const seen = new Set(Array.from(root.querySelectorAll("[data-key]"), (n) => n.dataset.key));

    function handle(kind, value) {
      const key = kind === "call" ? value.call_id
        : value.id + "|" + (value.finished_at === null ? "" : value.finished_at);
      if (seen.has(key)) return;
      seen.add(key);
      if (kind === "call") addCall(value); else addEpisode(value);
    }

    function showHeld() {
      held.textContent = paused && queue.length ? queue.length + " new, held" : "";
    }

    pause.addEventListener("click", () => {
      paused = !paused;
      pause.setAttribute("aria-pressed", String(paused));
      pause.textContent = paused ? "Resume" : "Pause";
      if (!paused) { while (queue.length) handle(...queue.shift()); }
      state.textContent = paused ? "paused" : "live";
      showHeld();
    });

    const source = new EventSource(root.dataset.events);
    source.addEventListener("hello", () => { state.textContent = paused ? "paused" : "live"; });
    source.addEventListener("error", () => { state.textContent = "reconnecting\u2026"; });
    for (const kind of ["call", "episode"]) {
      source.addEventListener(kind, (event) => {
        const value = JSON.parse(event.data);
        if (paused) { queue.push([kind, value]); showHeld(); } else handle(kind, value);
      });
    }
  }

  // -- a conversation's collapsed turns: all opened or closed at once ----------------
  // (the button is hidden until this script runs: without it, each turn still opens)
  document.querySelectorAll("button.fold-all").forEach((button) => {
    const folds = button.parentElement.nextElementSibling.querySelectorAll("details.fold");
    button.hidden = false;
    button.addEventListener("click", () => {
      const open = button.getAttribute("aria-pressed") !== "true";
      folds.forEach((fold) => { fold.open = open; });
      button.setAttribute("aria-pressed", String(open));
      button.textContent = (open ? "Collapse " : "Expand ") + button.dataset.label;
    });
  });

  const data = document.getElementById("tok-data");
  const box = document.getElementById("toks");
  if (data && box) tokenView(JSON.parse(data.textContent), box, document.getElementById("tok-detail"));
  const live = document.getElementById("live");
  if (live) liveFeed(live);
})();
