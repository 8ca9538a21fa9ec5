"""HTML report (Plotly): content checks in Python and, when available, a real headless Chromium
that draws every instrument, hovers each one and zooms, with all network access blocked.

(``backprism.report``.)
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import sys
from importlib import resources
from pathlib import Path

import pytest

from backprism.plot import read_log
from backprism.report import render_report, write_report
from tests.synthetic_log import write_synthetic_log

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_plotly = pytest.mark.skipif(importlib.util.find_spec("plotly") is None,
                                  reason="plotly not installed (pip install 'backprism[report]')")
PANEL_KEYS = [
    "alpha", "distance", "gradnorm", "hyperparameters", "gradtests", "hist1d", "hist2d",
    "maxev", "trace", "tic", "gsnr", "performance",
]
CHART_KEYS = [*PANEL_KEYS[:5], "gradtests.NormTest", "gradtests.InnerTest",
              "gradtests.OrthoTest", *PANEL_KEYS[5:]]


def _embedded(html: str) -> dict:
    m = re.search(r'<script type="application/json" id="backprism-data">(.*?)</script>', html,
                  re.S)
    assert m is not None
    return json.loads(m.group(1))


def _figure(data: dict, key: str) -> dict:
    (fig,) = [f for f in data["figures"] if f["key"] == key]
    return fig


@needs_plotly
def test_report_is_self_contained(tmp_path: Path) -> None:
    log = write_synthetic_log(tmp_path / "run.jsonl", steps=30)
    out = write_report(log, tmp_path / "sub" / "report.html")
    html = out.read_text()
    assert "<script src" not in html and "<link" not in html and "<iframe" not in html
    # plotly.js is inlined (the bundle shipped inside the plotly package)
    import plotly.offline

    assert plotly.offline.get_plotlyjs()[:2000] in html
    data = _embedded(html)
    assert [f["key"] for f in data["figures"]] == CHART_KEYS
    for key in PANEL_KEYS:
        assert f'class="card" data-panel="{key}"' in html
    alpha = _figure(data, "alpha")
    steps, _values = read_log(log).scalar("Alpha")
    (shown,) = [t for t in alpha["data"] if t["name"] == "α per step"]
    assert len(shown["x"]) == 29  # the NaN step is not drawn
    assert shown["marker"]["color"][0] == steps[0] and shown["customdata"][0] == steps[0]
    # the 2D histogram: log10 counts over the bin edges, counts for the hover
    (heat,) = _figure(data, "hist2d")["data"]
    assert heat["type"] == "heatmap" and len(heat["x"]) == 21 and len(heat["y"]) == 26
    assert len(heat["z"]) == 25 and len(heat["z"][0]) == 20
    assert sum(map(sum, heat["text"])) == 2000
    # raw and smoothed curves share one legend entry; the raw one is left out of the hover
    gn = _figure(data, "gradnorm")["data"]
    assert {t["legendgroup"] for t in gn} == {"GradNorm"}
    assert [t.get("hoverinfo") for t in gn] == ["skip", None]
    # the static assets are package data files, not Python strings
    assets = resources.files("backprism.report") / "assets"
    for name in ("report.html", "report.css", "report.js"):
        assert (assets / name).is_file()
    assert (assets / "report.css").read_text().split("\n", 1)[0] in html


@needs_plotly
def test_report_script_tag_cannot_be_closed_by_data(tmp_path: Path) -> None:
    recs = [{"kind": "meta", "version": 1, "quantities": ["</script><b>x"]},
            {"kind": "step", "step": 0, "values": {"</script><b>x": 1.0}}]
    p = tmp_path / "odd.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in recs))
    html = render_report(p)
    assert html.count("</script>") == 4  # PlotlyConfig, plotly.js, data, report.js
    assert "<b>x" not in html.replace("&lt;/script&gt;&lt;b&gt;x", "")
    fig = _figure(_embedded(html), "other.</script><b>x")
    assert fig["data"][0]["name"] == "</script><b>x"


def test_report_without_plotly_names_the_extra(tmp_path: Path, monkeypatch, capsys) -> None:
    from backprism.cli import main

    log = write_synthetic_log(tmp_path / "run.jsonl", steps=5)
    monkeypatch.setitem(sys.modules, "plotly", None)
    monkeypatch.setitem(sys.modules, "plotly.graph_objects", None)
    with pytest.raises(ImportError, match=r"pip install 'backprism\[report\]'"):
        write_report(log, tmp_path / "r.html")
    assert main(["report", str(log), "-o", str(tmp_path / "r.html")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("backprism: error: the HTML report needs plotly")
    assert "backprism[report]" in err and not (tmp_path / "r.html").exists()


# ------------------------------------------------------------------------------------------ browser
@pytest.fixture(scope="module")
def browser():
    pytest.importorskip("plotly", reason="plotly not installed (pip install 'backprism[report]')")
    sync_api = pytest.importorskip(
        "playwright.sync_api", reason="playwright not installed (pip install playwright)"
    )
    if CHROMIUM is None:
        pytest.skip("chromium not installed (apt-get install -y chromium)")
    with sync_api.sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM,
                               args=["--headless", "--no-sandbox", "--disable-gpu"])
        yield b
        b.close()


def _open(browser, path: Path):
    """Open the report as a file with every other request blocked; returns the page, the
    console errors and the requests that were tried."""
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    errors: list[str] = []
    requests: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))

    def route(r):
        requests.append(r.request.url)
        if r.request.url == path.resolve().as_uri():
            r.continue_()
        else:
            r.abort()

    page.route("**/*", route)
    page.goto(path.resolve().as_uri())
    page.wait_for_selector("body[data-ready='1']", timeout=60_000)
    return page, errors, requests


# Page position of a hoverable data point of a chart: the middle finite point of the first
# trace (named ``name`` if given) that takes part in the hover (a bar's middle, a non-empty
# heat-map cell).
_POINT = """(gd, name) => {
  const fl = gd._fullLayout, box = gd.getBoundingClientRect();
  for (const t of gd._fullData) {
    if (t.visible !== true || t.hoverinfo === "skip" || (name && t.name !== name)) continue;
    const xa = fl[t.xaxis.replace("x", "xaxis")], ya = fl[t.yaxis.replace("y", "yaxis")];
    let x = null, y = null;
    if (t.type === "heatmap") {
      for (let r = 0; r < t.z.length && x === null; r++)
        for (let c = 0; c < t.z[r].length && x === null; c++)
          if (t.z[r][c] !== null) { x = (t.x[c] + t.x[c + 1]) / 2; y = (t.y[r] + t.y[r + 1]) / 2; }
    } else {
      const ok = [...t.x.keys()].filter(i => t.x[i] !== null && t.y[i] !== null &&
                                             (t.type !== "bar" || t.y[i] > 0));
      if (!ok.length) continue;
      const i = ok[Math.floor(ok.length / 2)];
      x = t.x[i];
      y = t.type !== "bar" ? t.y[i] : ya.type === "log" ? Math.sqrt(t.y[i]) : t.y[i] / 2;
    }
    if (x === null) continue;
    return {name: t.name, x: box.left + xa._offset + xa.c2p(x),
            y: box.top + ya._offset + ya.c2p(y)};
  }
  return null;
}"""
_HOVER_TEXT = "(gd) => (gd.querySelector('.hoverlayer') || {}).textContent || ''"


def _hover(page, chart, trace: str | None = None) -> tuple[str, str]:
    """Move the mouse onto a data point of ``chart`` (of its trace ``trace`` if given);
    returns the point's trace name and the text of the hover label."""
    chart.scroll_into_view_if_needed()
    pt = chart.evaluate(_POINT, trace)
    assert pt is not None
    page.mouse.move(pt["x"], pt["y"])
    page.wait_for_function(f"gd => ({_HOVER_TEXT})(gd).length > 0", arg=chart.element_handle(),
                           timeout=5_000)
    return pt["name"], chart.evaluate(_HOVER_TEXT)


def test_report_in_chromium(browser, tmp_path: Path) -> None:
    log = write_synthetic_log(tmp_path / "run.jsonl", steps=40)
    page, errors, requests = _open(browser, write_report(log, tmp_path / "report.html"))
    assert requests == [(tmp_path / "report.html").resolve().as_uri()]  # works offline
    assert page.locator("#warnings li").count() >= 1
    # every instrument is drawn and shows values on hover
    for key in CHART_KEYS:
        card = page.locator(f"[data-panel='{key}']")
        assert card.count() == 1, key
        chart = card.locator(f".chart[data-key='{key}']")
        assert chart.locator(".main-svg").count() >= 1, key
        marks = chart.locator(".scatterlayer .js-line, .scatterlayer .point, "
                              ".barlayer .point, .heatmaplayer image")
        assert marks.count() >= 1, key
        name, text = _hover(page, chart)
        assert re.search(r"\d", text), (key, text)
        if key in ("alpha", "gradtests"):
            assert name in text, (key, name, text)
    # a step chart's unified hover: the step, then "series : value"
    name, text = _hover(page, page.locator(".chart[data-key='gradnorm']"))
    assert re.fullmatch(r"\d+GradNorm : [0-9.]+", text), text
    # the 2D histogram reports bin counts
    _name, text = _hover(page, page.locator(".chart[data-key='hist2d']"))
    assert re.search(r"count \d+", text), text

    # drag to zoom narrows the x range, the wheel zooms too, double-click resets
    chart = page.locator(".chart[data-key='gradnorm']")
    chart.scroll_into_view_if_needed()

    def xrange() -> list[float]:
        return chart.evaluate("gd => gd._fullLayout.xaxis.range.slice()")

    before = xrange()
    box = chart.locator(".nsewdrag").bounding_box()
    y = box["y"] + box["height"] * 0.5
    page.mouse.move(box["x"] + box["width"] * 0.3, y)
    page.mouse.down()
    page.mouse.move(box["x"] + box["width"] * 0.6, y, steps=5)
    page.mouse.up()
    page.wait_for_function("([gd, r]) => gd._fullLayout.xaxis.range[0] !== r[0]",
                           arg=[chart.element_handle(), before])
    zoomed = xrange()
    assert zoomed[1] - zoomed[0] < 0.5 * (before[1] - before[0])
    chart.locator(".nsewdrag").dblclick(position={"x": box["width"] / 2, "y": box["height"] / 2})
    page.wait_for_timeout(300)
    assert xrange() == pytest.approx(before)
    page.mouse.move(box["x"] + box["width"] * 0.5, y)
    page.mouse.wheel(0, -300)
    page.wait_for_timeout(500)
    assert xrange()[1] - xrange()[0] < before[1] - before[0]

    # a legend click hides the series, raw and smoothed together
    perf = page.locator(".chart[data-key='performance']")
    perf.scroll_into_view_if_needed()
    perf.locator(".legend .traces", has_text="mini-batch loss").click()
    page.wait_for_function(  # Plotly waits for a possible double-click first
        "gd => gd._fullData.filter(t => t.legendgroup === 'mini-batch loss')"
        ".every(t => t.visible === 'legendonly')", arg=perf.element_handle(), timeout=5_000)
    assert perf.evaluate("gd => gd._fullData.filter(t => t.visible === true).length") == 4
    assert errors == []
    page.close()


def test_report_untracked_panels_in_chromium(browser, tmp_path: Path) -> None:
    log = write_synthetic_log(tmp_path / "run.jsonl", steps=10, quantities=["Loss", "Alpha"])
    page, errors, _requests = _open(browser, write_report(log, tmp_path / "report.html"))
    # Loss (performance), Alpha and the logged learning rate (hyperparameters) are tracked
    assert page.locator(".card.untracked").count() == len(PANEL_KEYS) - 3
    assert page.locator(".card.untracked .chart").count() == 0
    assert "not tracked (add GradHist2d)" in page.locator(
        ".card[data-panel='hist2d']").inner_text()
    alpha = page.locator(".chart[data-key='alpha']")
    assert alpha.locator(".scatterlayer .trace").last.locator(".point").count() == 9
    _name, text = _hover(page, alpha, "α per step")
    assert re.search(r"α = -?[0-9.]+step \d+", text), text
    _name, text = _hover(page, alpha, "α histogram")
    assert re.search(r"\[-?[0-9.]+, -?[0-9.]+\): [0-9.]+", text), text
    assert errors == []
    page.close()
