"""HTML report: content checks in Python and, when available, a real headless Chromium."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from backprism.plot import read_log
from backprism.report import render_report, write_report
from test_plot import write_synthetic_log

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")

PANEL_KEYS = [
    "alpha", "distance", "gradnorm", "hyperparameters", "gradtests", "hist1d", "hist2d",
    "maxev", "trace", "tic", "gsnr", "performance",
]


def _embedded(html: str) -> dict:
    m = re.search(r'<script type="application/json" id="backprism-data">(.*?)</script>', html,
                  re.S)
    assert m is not None
    return json.loads(m.group(1))


def test_report_is_self_contained(tmp_path: Path) -> None:
    log = write_synthetic_log(tmp_path / "run.jsonl", steps=30)
    out = write_report(log, tmp_path / "sub" / "report.html")
    html = out.read_text()
    assert "http://" not in html.replace("http://www.w3.org/2000/svg", "")
    assert "https://" not in html and "<script src" not in html and "<link" not in html
    data = _embedded(html)
    assert [p["key"] for p in data["panels"]] == PANEL_KEYS
    assert all(p["tracked"] for p in data["panels"])
    alpha = next(p for p in data["panels"] if p["key"] == "alpha")
    steps, _values = read_log(log).scalar("Alpha")
    shown = next(s for s in alpha["series"] if s["style"] == "scatter")
    assert len(shown["x"]) == 29  # the NaN step is not drawn
    assert shown["c"][0] == steps[0]


def test_report_script_tag_cannot_be_closed_by_data(tmp_path: Path) -> None:
    recs = [{"kind": "meta", "version": 1, "quantities": ["</script><b>x"]},
            {"kind": "step", "step": 0, "values": {"</script><b>x": 1.0}}]
    p = tmp_path / "odd.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in recs))
    html = render_report(p)
    assert html.count("</script>") == 2
    assert _embedded(html)["panels"][-1]["title"] == "</script><b>x"


@pytest.fixture(scope="module")
def browser():
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
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(path.resolve().as_uri())
    page.wait_for_selector("body[data-ready='1']", timeout=10_000)
    return page, errors


def test_report_in_chromium(browser, tmp_path: Path) -> None:
    log = write_synthetic_log(tmp_path / "run.jsonl", steps=40)
    page, errors = _open(browser, write_report(log, tmp_path / "report.html"))
    for key in PANEL_KEYS:
        card = page.locator(f".card[data-panel='{key}']")
        assert card.count() == 1, key
        assert card.locator("svg.chart").count() >= 1, key
        assert card.locator("svg.chart path, svg.chart rect, svg.chart circle").count() > 3, key
    for child in ("NormTest", "InnerTest", "OrthoTest"):
        assert page.locator(f"svg[data-key='gradtests.{child}'] path").count() >= 1
    assert page.locator("#warnings li").count() >= 1

    # hover shows the values of the nearest step
    chart = page.locator("svg[data-key='gradnorm']")
    chart.scroll_into_view_if_needed()
    box = chart.bounding_box()
    page.mouse.move(box["x"] + box["width"] * 0.6, box["y"] + box["height"] * 0.5)
    tip = page.locator("#tooltip")
    assert tip.is_visible()
    assert re.search(r"step \d+\nGradNorm: [0-9.]+", tip.inner_text())

    # drag to zoom changes the x ticks, double-click resets them
    def ticks() -> list[str]:
        return chart.locator("text.xtick").all_text_contents()

    before = ticks()
    page.mouse.move(box["x"] + box["width"] * 0.3, box["y"] + box["height"] * 0.5)
    page.mouse.down()
    page.mouse.move(box["x"] + box["width"] * 0.5, box["y"] + box["height"] * 0.5, steps=4)
    page.mouse.up()
    zoomed = ticks()
    assert zoomed != before
    assert float(zoomed[-1]) - float(zoomed[0]) < float(before[-1]) - float(before[0])
    chart.dblclick()
    assert ticks() == before

    # legend toggles a series
    perf = page.locator(".card[data-panel='performance']")
    n = perf.locator("svg path").count()
    perf.locator(".legend span", has_text="mini-batch loss").click()
    assert perf.locator("svg path").count() < n

    # the 2D histogram reports bin counts on hover
    heat = page.locator("svg[data-key='hist2d']")
    heat.scroll_into_view_if_needed()
    hb = heat.bounding_box()
    page.mouse.move(hb["x"] + hb["width"] * 0.55, hb["y"] + hb["height"] * 0.5)
    assert "count" in tip.inner_text()
    assert errors == []
    page.close()


def test_report_untracked_panels_in_chromium(browser, tmp_path: Path) -> None:
    log = write_synthetic_log(tmp_path / "run.jsonl", steps=10, quantities=["Loss", "Alpha"])
    page, errors = _open(browser, write_report(log, tmp_path / "report.html"))
    # Loss (performance), Alpha and the logged learning rate (hyperparameters) are tracked
    assert page.locator(".card.untracked").count() == len(PANEL_KEYS) - 3
    assert "not tracked (add GradHist2d)" in page.locator(
        ".card[data-panel='hist2d']").inner_text()
    assert page.locator("svg[data-key='alpha'] circle").count() == 9
    assert errors == []
    page.close()
