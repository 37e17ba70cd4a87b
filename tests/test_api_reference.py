"""The API reference (``docs/api/``, mkdocstrings over the docstrings) has an
entry for every public name of ``jaxkv`` and of each sub-package, and the site
builds with ``mkdocs build --strict`` (every nav entry and link resolves).
"""  # noqa: D205

import importlib
import inspect
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
NAMESPACES = [
    "jaxkv",
    *(f"jaxkv.{p}" for p in ("vllm", "config", "groups", "plan", "kv", "attention")),
    *(f"jaxkv.{p}" for p in ("sched", "step", "serve", "transfer", "pictures")),
    "jaxkv.demo",
]


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    pytest.importorskip("mkdocstrings_handlers.python")
    out = tmp_path_factory.mktemp("site")
    run = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return out


def test_every_namespace_has_a_reference_page_in_the_nav():
    nav = (ROOT / "mkdocs.yml").read_text()
    for ns in NAMESPACES:
        page = "api/index.md" if ns == "jaxkv" else f"api/{ns.split('.')[1]}.md"
        assert f"{ns}: {page}" in nav, ns
        assert f"::: {ns}\n" in (ROOT / "docs" / page).read_text(), ns


@pytest.mark.parametrize("ns", NAMESPACES)
def test_every_public_name_has_an_entry(site, ns):
    mod = importlib.import_module(ns)
    page = "index.html" if ns == "jaxkv" else f"{ns.split('.')[1]}/index.html"
    ids = set(re.findall(r'id="([\w.]+)"', (site / "api" / page).read_text()))
    missing = [
        name
        for name in mod.__all__
        if not inspect.ismodule(getattr(mod, name)) and f"{ns}.{name}" not in ids
    ]
    assert missing == [], missing
