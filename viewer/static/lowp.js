// tracetap viewer: select a token named in the URL (?sel=) and jump between low-probability
// tokens. Loaded after app.js on every page; acts only where there is a token
// view. Selecting goes through the token box's own click handler (app.js), so the detail
// panel shows the token as if it had been clicked.
(function () {
  "use strict";
  const box = document.getElementById("toks");
  const tokData = document.getElementById("tok-data");
  const panel = document.getElementById("lowp");
  if (!box || !tokData) return;
  const data = JSON.parse(tokData.textContent);
  const spans = Array.from(box.querySelectorAll(".t"));

  // A jump scrolls the tokens; whatever then lies under the resting mouse pointer must not
  // take the selection over (app.js selects on hover), so hovers are ignored for a moment.
  let quietUntil = 0;
  box.addEventListener("mouseover", (event) => {
    if (Date.now() < quietUntil) event.stopImmediatePropagation();
  }, true);

  function pick(i) {
    quietUntil = Date.now() + 600;
    spans[i].dispatchEvent(new MouseEvent("click", { bubbles: true }));
    centre(spans[i]);
  }

  // A token jumped to is scrolled to the middle of the token box, with the tokens before
  // and after it in view (the click's own scroll only brought it to the box's edge).
  function centre(node) {
    const outer = box.getBoundingClientRect();
    const inner = node.getBoundingClientRect();
    box.scrollTop += inner.top + inner.height / 2 - (outer.top + box.clientTop + box.clientHeight / 2);
  }

  // ?sel=POSITION (the lowest-token links, the strip, the compare page): select that token.
  const query = new URLSearchParams(window.location.search);
  const sel = query.has("sel") ? Number(query.get("sel")) - data.start : -1;
  if (Number.isInteger(sel) && sel >= 0 && sel < spans.length) pick(sel);

  if (!panel) return;
  const low = { threshold: Number(panel.dataset.threshold), prevHref: panel.dataset.prevHref,
    nextHref: panel.dataset.nextHref };
  // Window-relative indices of the trained tokens below the threshold, in order.
  const lows = [];
  if (data.lp) {
    data.lp.forEach((lp, i) => {
      if (data.mask[i] && lp < low.threshold) { lows.push(i); spans[i].classList.add("lowp-mark"); }
    });
  }

  function selected() {
    const node = box.querySelector(".t.sel");
    return node ? Number(node.dataset.k) : -1;
  }

  function jump(step) {
    const at = selected();
    const found = step > 0 ? lows.find((i) => i > at) : lows.slice().reverse().find((i) => at < 0 || i < at);
    if (found !== undefined) { pick(found); return; }
    const href = step > 0 ? low.nextHref : low.prevHref;
    if (href) window.location.assign(href);  // the next one is in another window
    else document.getElementById("lowp-count").classList.add("lowp-none");
  }

  document.getElementById("lowp-next").addEventListener("click", () => jump(1));
  document.getElementById("lowp-prev").addEventListener("click", () => jump(-1));
  document.addEventListener("keydown", (event) => {
    if (event.ctrlKey || event.metaKey || event.altKey) return;
    if (event.target.closest && event.target.closest("input, textarea, select")) return;
    if (event.key === "n") { event.preventDefault(); jump(1); }
    else if (event.key === "p") { event.preventDefault(); jump(-1); }
  });
})();
