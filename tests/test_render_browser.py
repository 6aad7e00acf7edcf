"""`rollplex graph --format html` as a person sees it: the page rendered by a real headless Chromium
(Debian's chromium-headless-shell; scripts/setup.sh installs it) in a 1600×1000 window. A script added
after the page's own measures what is on screen once the page has laid itself out: every kind's box
lies inside the visible part of the window, no box's text runs past its box or ends in an ellipsis, no
edge label leaves the window, the text is not shrunk below 8 px, and every edge says its bytes."""
from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rollplex.pipeline.compile import render as R
from rollplex.pipeline.compile.ranks import distribute
from rollplex.pipeline.plan.schedule import schedule

sys.path.insert(0, str(Path(__file__).parent))
from test_render import grpo_graph  # noqa: E402

WINDOW = (1600, 1000)

MEASURE = """
<script>
window.addEventListener("load", () => {
  const main = document.querySelector("main").getBoundingClientRect();
  const screen = {left: Math.max(0, main.left), top: Math.max(0, main.top),
                  right: Math.min(innerWidth, main.right), bottom: Math.min(innerHeight, main.bottom)};
  const inside = r => r.left >= screen.left - 0.5 && r.top >= screen.top - 0.5 &&
                      r.right <= screen.right + 0.5 && r.bottom <= screen.bottom + 0.5;
  const view = document.querySelector(".view:not([hidden])");
  const boxes = [...view.querySelectorAll("[data-box]")].map(g => {
    const rects = g.querySelectorAll(":scope > rect"), r = rects[rects.length - 1].getBoundingClientRect();
    const texts = [...g.querySelectorAll("text")].map(t => ({text: t.textContent, r: t.getBoundingClientRect()}));
    return {key: g.dataset.box, visible: inside(r),
            clipped: texts.filter(t => t.r.right > r.right + 0.5 || t.text.endsWith("\u2026")).map(t => t.text),
            text_px: Math.min(...texts.map(t => t.r.height))};
  });
  const labels = [...view.querySelectorAll(".edge-label")];
  const out = {view: view.dataset.view, window: [innerWidth, innerHeight], boxes,
               edges: view.querySelectorAll(".edge").length,
               labels: labels.map(t => ({text: t.textContent, visible: inside(t.getBoundingClientRect()),
                                         px: t.getBoundingClientRect().height}))};
  const pre = document.createElement("pre"); pre.id = "rp-measured"; pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
});
</script>
"""


def _browser() -> str:
    found = shutil.which("chromium-headless-shell") or shutil.which("chromium")
    assert found, "no headless Chromium: `apt-get install chromium-headless-shell` (scripts/setup.sh does)"
    return found


def _on_screen(page: str, tmp_path: Path) -> dict:
    path = tmp_path / "graph.html"
    path.write_text(page.replace("</body>", MEASURE + "</body>"), encoding="utf-8")
    out = subprocess.run([_browser(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                          f"--window-size={WINDOW[0]},{WINDOW[1]}", "--virtual-time-budget=5000", "--dump-dom",
                          path.as_uri()], capture_output=True, text=True, timeout=120)
    found = re.search(r'<pre id="rp-measured">(.*?)</pre>', out.stdout, re.S)
    assert found, f"the page did not finish loading: {out.stderr[-2000:]}"
    return json.loads(html.unescape(found.group(1)))


def _graphs():
    one = schedule(grpo_graph(8), "rollplex")
    two = distribute(grpo_graph(8), 2)
    return {"grpo-P8": one, "grpo-P32": schedule(grpo_graph(32), "serial"), "grpo-2-ranks": schedule(two, "rollplex")}


@pytest.mark.parametrize("name", ["grpo-P8", "grpo-P32", "grpo-2-ranks"])
def test_the_page_opens_fitted_and_readable(tmp_path, name):
    graph = _graphs()[name]
    seen = _on_screen(R.to_html(graph), tmp_path)
    assert seen["window"] == list(WINDOW) and seen["view"] == "groups"
    grouped = R.overview(graph)
    kinds_shown = {grouped.boxes[b["key"]].kind for b in seen["boxes"] if b["visible"]}
    assert kinds_shown == {n.kind for n in graph}, "a kind's box is off-screen at the initial view"
    assert all(b["visible"] for b in seen["boxes"]), [b["key"] for b in seen["boxes"] if not b["visible"]]
    assert [b for b in seen["boxes"] if b["clipped"]] == []
    assert min(b["text_px"] for b in seen["boxes"]) >= 8
    # Every edge of the grouped view carries its label, on screen and readable.
    assert len(seen["labels"]) == seen["edges"] == len(grouped.edges)
    assert all(lab["visible"] and lab["px"] >= 7 for lab in seen["labels"]), seen["labels"]
    assert all(re.search(r"\d+(\.\d)?(B|KiB|MiB|GiB) live→", lab["text"]) or "order" in lab["text"]
               for lab in seen["labels"])


def test_placement_is_shown_for_a_one_worker_run(tmp_path):
    graph = _graphs()["grpo-P8"]
    assert all("placement" not in n.meta for n in graph)
    boxes = R.overview(graph).boxes.values()
    assert all(any("rank0/" in line for line in b.lines) for b in boxes)


def test_the_grouped_view_is_the_same_size_for_8_and_32_prompts():
    sizes = []
    for prompts in (8, 32):
        svg = R.to_svg(grpo_graph(prompts), expand=())
        sizes.append(tuple(float(x) for x in re.search(r'width="([\d.]+)" height="([\d.]+)"', svg).groups()))
    assert sizes[0] == sizes[1] and sizes[0][0] <= WINDOW[0] and sizes[0][1] <= WINDOW[1]
