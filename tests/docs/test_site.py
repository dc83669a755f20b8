"""The documentation site (mkdocs.yml): it builds without the network and without a warning, every link of every
page leads somewhere, and a reader in headless Chromium finds pages with the search, clicks through the
navigation and sees the front page drawn (a screenshot)."""

from __future__ import annotations

import functools
import html.parser
import importlib.util
import os
import re
import subprocess
import sys
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest

from tests.docs.browser import CHROMIUM, Browser
from tests.docs.examples import ROOT, pages

if importlib.util.find_spec("mkdocs") is None:  # `make test` installs it (the docs extra); a GPU machine's wheels do not
    pytest.skip("mkdocs is not installed: pip install -e '.[docs]'", allow_module_level=True)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": str(ROOT)}
    built = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=ROOT,
                           env=env, capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    assert "WARNING" not in built.stderr, built.stderr
    return out


class _Links(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.links, self.ids = [], set()

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if attrs.get("id"):
            self.ids.add(attrs["id"])
        if tag == "a" and attrs.get("href"):
            self.links.append(attrs["href"])


def _page(site: Path, path: Path) -> _Links:
    parsed = _Links()
    parsed.feed(path.read_text())
    return parsed


def test_every_page_is_built_the_generated_ones_included(site):
    for page in pages()[1:]:
        assert (site / page.stem / "index.html").is_file(), page.name
    assert (site / "index.html").is_file()  # the README
    reference = (site / "config-reference" / "index.html").read_text()
    from lmrl.config.describe import field_rows

    for key, *_ in field_rows():  # every field of the schema, with its docstring's words
        assert f"<code>{key}</code>" in reference, key
    api = (site / "api" / "index.html").read_text()
    for name in ("policy_loss", "grpo_advantages", "Trainer", "train_on_scored", "load_config", "Sandbox"):
        assert re.search(rf'id="[\w.]*{name}"', api), name


def test_a_broken_link_fails_the_build_naming_the_page(tmp_path):
    """The suite's build is strict: shown on a copy of the site's config with one page linking nowhere."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# Home\n\nSee [the page](missing.md).\n")
    config = (ROOT / "mkdocs.yml").read_text().split("\nnav:")[0].replace("hooks:\n  - scripts/docs_hooks.py\n", "")
    (tmp_path / "mkdocs.yml").write_text(config.replace("docs_dir: docs", f"docs_dir: {docs}"))
    built = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                           cwd=tmp_path, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"}, capture_output=True, text=True,
                           timeout=300)
    assert built.returncode != 0
    assert "Doc file 'index.md' contains a link 'missing.md', but the target is not found" in built.stderr, built.stderr


def test_no_link_of_any_page_is_broken(site):
    pages = sorted(site.rglob("*.html"))
    parsed = {p: _page(site, p) for p in pages}
    broken = []
    for page, links in parsed.items():
        for href in links.links:
            url = urlparse(href)
            if url.scheme or href.startswith("mailto:"):
                continue
            path = unquote(url.path)
            target = (site / path.lstrip("/") if path.startswith("/") else page.parent / path).resolve() if path else page
            if target.is_dir():
                target = target / "index.html"
            if not target.exists():
                broken.append(f"{page.relative_to(site)}: {href}")
            elif url.fragment and target.suffix == ".html" and url.fragment not in parsed[target].ids:
                broken.append(f"{page.relative_to(site)}: {href} (no such anchor)")
    assert not broken, broken


@pytest.fixture(scope="module")
def served(site):
    class Quiet(SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    handler = functools.partial(Quiet, directory=str(site))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()


@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium installed (Debian: apt-get install chromium; make test tries)")
def test_a_reader_searches_clicks_through_and_sees_the_front_page(served, tmp_path):
    """10-12 s on 2 cores: a headless Chromium starts and loads the pages a reader visits."""
    from PIL import Image

    browser = Browser(tmp_path / "profile")
    try:
        browser.open(served)
        shot = browser.screenshot(tmp_path / "front.png")
        image = Image.open(shot).convert("L")
        assert image.size[0] == 1200 and image.size[1] > 500 and len(image.getcolors(maxcolors=1 << 16) or range(17)) > 16  # drawn, not blank
        assert "lmrl" in browser.evaluate("document.querySelector('h1').textContent")

        browser.open(served + "?q=decoupled")  # the search box, typed into
        titles = browser.wait_for("[...document.querySelectorAll('.md-search-result__item a')].map(a => a.href)",
                                  "search results for 'decoupled'")
        assert any("/async/" in t or "/glossary/" in t for t in titles), titles

        nav = browser.evaluate("[...new Set([...document.querySelectorAll('nav.md-nav--primary a.md-nav__link[href]')]"
                               ".map(a => a.href.split(/[?#]/)[0]))]")
        every = {f"{served}{p.stem}/" for p in pages()[1:]} | {served + p for p in ("", "api/", "config-reference/")}
        assert set(nav) == every  # the navigation reaches every page
        for url in nav:  # every page of the navigation opens, with its title
            browser.open(url)
            title = browser.evaluate("(document.querySelector('article h1') || {}).textContent")
            assert title and "404" not in title, url
    finally:
        browser.close()
