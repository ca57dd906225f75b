"""The HTML report in a real browser: headless Chromium (Debian's `chromium`, installed by
etc/dev/setup.sh) loads the page of the real demo recording and of a 256-node generated job, with the
network cut. Checked from the DOM after the page's script ran: no console message and no error
caught by the page, every section drawn (its charts' canvases there), the drill-down and flame
graph opened on the straggler, a trace name with markup shown as text. Screenshots go to
tests/artifacts/browser/ (ignored by git; CI keeps the folder as an artifact, docs/report.md)."""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import time
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path

import h5py
import pytest

from gpuprof.mpi_merge import synthetic as syn
from gpuprof.mpi_merge.merge import merge

from headless import Page, chromium, open_page  # isort: skip (tests/ helper)

if chromium() is None:
    pytest.skip("chromium not installed (Debian package 'chromium'; `make setup` installs it)", allow_module_level=True)

RECORDING = Path(__file__).parent / "recordings" / "demo-4nodes"
ARTIFACTS = Path(__file__).parent / "artifacts" / "browser"
HOSTILE = "<img src=x onerror=window.gpXss=1>"  # would set gpXss if it ever became an element
SECTIONS = ["summary", "lanes", "drill", "metrics", "flames", "stacklanes", "clocks", "ranks", "gpus", "phases",
            "kernels", "nccl"]
CHARTED = {"lanes": 2, "metrics": 1, "clocks": 1}  # sections and the canvases they hold at least


class Dom(HTMLParser):
    """Per section of the page: its attributes, text and canvases; every element's tag."""

    def __init__(self) -> None:
        super().__init__()
        self.sections: dict[str, dict] = {}
        self.tags: list[tuple[str, dict]] = []
        self._stack: list[str] = []
        self.by_id: dict[str, dict] = {}

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        self.tags.append((tag, a))
        if tag == "section":
            self._stack.append(a["data-section"])
            self.sections[a["data-section"]] = {"attrs": a, "text": "", "canvas": 0}
        elif tag == "canvas" and self._stack:
            self.sections[self._stack[-1]]["canvas"] += 1
        if "id" in a:
            self.by_id[a["id"]] = {"attrs": a, "text": ""}
            self._id = a["id"]

    def handle_endtag(self, tag: str) -> None:
        if tag == "section" and self._stack:
            self._stack.pop()

    def handle_data(self, data: str) -> None:
        if self._stack:
            self.sections[self._stack[-1]]["text"] += data


def parse(dom: str) -> Dom:
    d = Dom()
    d.feed(dom)
    return d


def check_page(p: Page, shots: str, charted: dict[str, int] | None = None) -> Dom:
    """The checks every page passes, and its screenshot (ARTIFACTS/<shots>.png); with
    GPUPROF_SCREENSHOTS=1 one per section too (ARTIFACTS/<shots>-<section>.png, what docs/img/ holds)."""
    assert p.console == [], f"console messages: {p.console[:5]}"
    d = parse(p.dom())
    errs = d.by_id["gp-errors"]["attrs"]
    assert errs["data-count"] == "0", p.js("document.getElementById('gp-errors').textContent")
    assert list(d.sections) == SECTIONS
    for name, s in d.sections.items():
        assert s["attrs"].get("data-rendered") == "1", name
        assert "failed" not in s["text"], (name, s["text"][:500])
    for name, n in (CHARTED if charted is None else charted).items():
        assert d.sections[name]["canvas"] >= n, (name, d.sections[name]["canvas"])
    assert d.by_id["gp-done"]["attrs"].get("data-painted-ms")
    p.screenshot(ARTIFACTS / f"{shots}.png")
    for name in SECTIONS if os.environ.get("GPUPROF_SCREENSHOTS") == "1" else []:
        p.screenshot(ARTIFACTS / f"{shots}-{name}.png", f"#sec-{name}")
    return d


def click_chart(p: Page, selector: str, js_point: str) -> None:
    """A real mouse click (DevTools Input events) at the pixel `js_point` computes from the chart
    (`c`, the ECharts instance of `selector`), in the chart's coordinates."""
    x, y = p.js(f"""(function(){{
        var dom = document.querySelector({json.dumps(selector)}); dom.scrollIntoView({{block: "center"}});
        var c = echarts.getInstanceByDom(dom), pt = {js_point}, r = dom.getBoundingClientRect();
        return [r.left + pt[0], r.top + pt[1]];}})()""")
    for kind in ("mouseMoved", "mousePressed", "mouseReleased"):
        p.call("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", clickCount=1)
    time.sleep(0.2)


@pytest.fixture(scope="module")
def demo_page(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Page]:
    """The demo recording's page, loaded once for the module's tests (node2's host name is markup)."""
    d = tmp_path_factory.mktemp("demo") / "demo.gpuprof.d"
    shutil.copytree(RECORDING, d)
    with h5py.File(d / "node2.h5", "r+") as f:
        f.attrs["hostname"] = HOSTILE + "host2"
    res = merge(str(d))
    assert res is not None
    with open_page(res.job_file.with_suffix(".html")) as p:
        yield p


@pytest.fixture(scope="module")
def big_page(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """256 nodes x 1 GPU for 2 s (200 instances of a 256-rank communicator), node 37 slow."""
    d = tmp_path_factory.mktemp("big") / "big.gpuprof.d"
    syn.generate(syn.SynthConfig(nodes=256, duration_s=2, gpus_per_node=1, seed=3,
                                 stragglers=[syn.Straggler(37, "gpu", 0.3, 1.8)]), d)
    res = merge(str(d))
    assert res is not None
    return res.job_file.with_suffix(".html")


def test_demo_page_in_chromium(demo_page: Page) -> None:
    p = demo_page
    d = check_page(p, "demo")
    summary = d.sections["summary"]["text"]
    assert "Root cause: node3 (host" in summary
    # the flame graphs and the drill-down open on the straggler
    flames = d.sections["flames"]
    # the analysis's per-process differential first (/analysis/flames), then the page's own
    assert flames["canvas"] >= 1 and "finding 1 (node3), per process, from the analysis: on-CPU" in flames["text"]
    p.js("var s=document.getElementById('gp-flame-kind'); s.value='diff:0'; s.dispatchEvent(new Event('change'));")
    assert "differential: node3 vs 3 peer node(s)" in p.js("document.getElementById('gp-flame-info').textContent")
    drill = d.sections["drill"]["text"]
    assert "node3 (arrived last)" in drill and "samples (" in drill  # node3's stacks before the instance
    assert "NVTX ranges: not recorded" in drill and "Kernel launches: not recorded" in drill
    # a search in the flame graph reports the share of the frames it matches
    p.js("var s=document.getElementById('gp-flame-search'); s.value='poll'; s.dispatchEvent(new Event('input'));")
    assert re.search(r"search matches \d+%", p.js("document.getElementById('gp-flame-info').textContent"))


def test_stack_lanes_put_the_nodes_side_by_side(demo_page: Page) -> None:
    """A lane per node with stacks, the straggler's first; the legend names functions of the program,
    and a hover over a cell names its node, collective index and function, with its share."""
    p = demo_page
    d = parse(p.dom())
    sec = d.sections["stacklanes"]
    assert sec["canvas"] == 1 and "not recorded" not in sec["text"]
    data = p.js("JSON.parse(document.getElementById('gp-data').textContent)")
    with_stacks = sorted(n for n, r in data["node_rows"].items() if r["samples"])
    legend = p.js("Array.prototype.map.call(document.querySelectorAll('#gp-stacklanes-legend span'), e => e.textContent)")
    assert 1 <= len(legend) <= 12 and all(x.startswith("\u25a0 ") for x in legend), legend
    x, y = p.js("""(function(){var c=document.querySelector('#gp-stacklanes canvas'); c.scrollIntoView({block:'center'});
        var r=c.getBoundingClientRect(); return [r.left + 110 + (r.width - 130) / 2, r.top + 6 + 4];})()""")
    p.call("Input.dispatchMouseEvent", type="mouseMoved", x=x, y=y)
    time.sleep(0.2)
    tip = p.js("document.querySelector('#gp-stacklanes .heattip').textContent")
    # the first lane is the straggler's node (node3), then the others by name
    assert tip.startswith("node3, ") and "(seq " in tip and ("samples" in tip or "no sample" in tip), tip
    assert len(with_stacks) >= 2


def test_clicking_an_instance_and_a_metric_point_drills_down(demo_page: Page) -> None:
    p = demo_page
    # the world communicator's first drawn call of rank 0 (node1): cell [rank index, seq, enter, exit, ...]
    cell = p.js("(function(){var c=JSON.parse(document.getElementById('gp-data').textContent).comms[0];"
                "var x=c.cells.filter(function(x){return x[0]===0;})[5]; return x;})()")
    mid = (cell[2] + cell[3]) / 2
    click_chart(p, "#sec-lanes .chart:nth-of-type(2)", f"c.convertToPixel({{seriesIndex: 0}}, [{mid}, 0])")
    title = p.js("document.getElementById('gp-drill-title').textContent")
    assert f"Instance seq {cell[1]} of " in title and "rank 0" in title, title
    cards = p.js("Array.prototype.map.call(document.querySelectorAll('#gp-drill .drillcard h4'), e => e.textContent)")
    assert cards[0] == "node1 (the rank clicked)" and "node3 (arrived last)" in cards, cards
    # a point of the host CPU metric: that node's window
    click_chart(p, "#sec-metrics .chart[data-metric=cpu_busy]",
                "c.convertToPixel({gridIndex: 0}, [c.getOption().xAxis[0].min + 15, 50])")
    title = p.js("document.getElementById('gp-drill-title').textContent")
    assert title.startswith("Host CPU busy of node"), title
    p.screenshot(ARTIFACTS / "demo-click-drill.png", "#sec-drill")


def test_trace_name_with_markup_is_text(demo_page: Page) -> None:
    p = demo_page
    d = parse(p.dom())
    assert not [a for t, a in d.tags if t == "img"], "a name from a trace became an element"
    assert HOSTILE + "host2" in d.sections["clocks"]["text"]  # shown, as text
    assert f"<td>{html.escape(HOSTILE, quote=False)}host2</td>" in p.dom()
    assert p.js("window.gpXss === undefined")


def test_256_node_page_in_chromium(big_page: Path) -> None:
    mb = big_page.stat().st_size / 1e6
    assert mb < 10, f"{mb:.1f} MB"
    with open_page(big_page) as p:
        d = check_page(p, "nodes256")
    assert "Root cause: node037" in d.sections["summary"]["text"]
    summarized = d.sections["summary"]["text"]
    assert "GPU utilization: 256 series of 256 nodes shown as their 10/50/90th percentiles" in summarized
    assert "CPU stacks (mode 'stacks') and off-CPU stacks: not recorded" in d.sections["flames"]["text"]
    assert d.sections["metrics"]["canvas"] >= 8


def test_a_page_without_metrics_or_stacks(tmp_path: Path) -> None:
    d = tmp_path / "bare.gpuprof.d"
    syn.generate(syn.SynthConfig(nodes=3, duration_s=2, write_bulk=False, seed=2), d)
    res = merge(str(d))
    assert res is not None
    with open_page(res.job_file.with_suffix(".html")) as p:
        dom = check_page(p, "bare", charted={"lanes": 2})
    assert "GPU and host metrics: not recorded" in dom.sections["metrics"]["text"]
    assert "GPUs: not recorded" in dom.sections["gpus"]["text"]
