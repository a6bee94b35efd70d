// What counts as a layout break on a page, measured in the browser; returns a list of problems (empty: none):
// the page or a scroll box needs a sideways scroll; a visible element sticks out of its parent's box (SVG
// drawings and hidden elements aside); a button (but a destination's name, class `name`, which may wrap at its
// separators), badge or column title breaks onto a second line; the items of a toolbar (each CSS selector of
// `toolbars`: its visible children) do not all share a line.
// Called by tests/browser_helpers.py layout_problems(frame, toolbars).
(toolbars) => {
  const problems = [];
  const name = (n) => n.id ? `#${n.id}` : `${n.tagName.toLowerCase()}${n.className && typeof n.className === "string"
    ? "." + n.className.trim().split(/\s+/).join(".") : ""} "${(n.textContent || "").trim().slice(0, 30)}"`;
  const visible = (n) => n.getClientRects().length > 0 && getComputedStyle(n).visibility !== "hidden";
  const root = document.documentElement;
  if (root.scrollWidth > root.clientWidth + 1) problems.push(`the page scrolls sideways: ${root.scrollWidth} px in ${root.clientWidth}`);
  for (const box of document.querySelectorAll(".scroll")) {
    if (box.scrollWidth > box.clientWidth + 1) problems.push(`${name(box)} scrolls sideways: ${box.scrollWidth} px in ${box.clientWidth}`);
  }
  for (const node of document.body.querySelectorAll("*")) {
    if (node.closest("svg") && node.tagName.toLowerCase() !== "svg" || !visible(node) || node.closest("[hidden]")) continue;
    const r = node.getBoundingClientRect(), p = node.parentElement.getBoundingClientRect();
    if (r.right > p.right + 1 || r.left < p.left - 1) {
      problems.push(`${name(node)} sticks out of ${name(node.parentElement)}: [${Math.round(r.left)}, ${Math.round(r.right)}] in [${Math.round(p.left)}, ${Math.round(p.right)}]`);
    }
  }
  for (const node of document.querySelectorAll("button:not(.name), .badge, thead th")) {
    if (!visible(node) || node.closest("[hidden]")) continue;
    const style = getComputedStyle(node);
    const inner = node.clientHeight - parseFloat(style.paddingTop) - parseFloat(style.paddingBottom);
    if (node.textContent.trim() && inner > parseFloat(style.lineHeight) * 1.5) {
      problems.push(`${name(node)} breaks onto ${Math.round(inner / parseFloat(style.lineHeight))} lines (${Math.round(inner)} px high)`);
    }
  }
  for (const selector of toolbars) {
    for (const bar of document.querySelectorAll(selector)) {
      const items = [...bar.children].filter((n) => visible(n) && n.tagName.toLowerCase() !== "datalist");
      // One line: some height is common to all of them (the lowest top is above the highest bottom).
      const boxes = items.map((n) => n.getBoundingClientRect());
      if (boxes.length && Math.max(...boxes.map((b) => b.top)) >= Math.min(...boxes.map((b) => b.bottom))) {
        problems.push(`${selector} is on more than one line: ${items.map((n, i) => `${name(n)} at ${Math.round(boxes[i].top)}-${Math.round(boxes[i].bottom)}`).join(", ")}`);
      }
    }
  }
  return problems;
}
