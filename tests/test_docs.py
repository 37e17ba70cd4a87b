"""Every Python block of the README and of docs/ runs as written, a page's
blocks in order in one namespace (as a reader pastes them); the README is a
front door of at most 200 lines with no dated or machine-specific sentence.
The guide's examples are also checked against a dense model
(tests/test_guide.py).
"""  # noqa: D205

import os
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).parent.parent
# Every page's code blocks run (the seeds' reference is description only).
PAGES = [
    "README.md",
    *(
        f"docs/{p.name}"
        for p in sorted((ROOT / "docs").glob("*.md"))
        if p.name != "REFERENCE.md"
    ),
]


def _blocks(page: str) -> list[str]:
    # A block inside a list item is indented with it.
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / page).read_text(), re.S)
    return [textwrap.dedent(b) for b in blocks]


# Pages whose blocks need a mesh of 8 devices run in a subprocess that
# simulates them on the CPU.
MESH_PAGES = {"docs/sharding.md"}

_RUN = """
import re, sys, textwrap
page = sys.argv[1]
namespace = {"__name__": "docs:" + page}
blocks = re.findall(r"```python\\n(.*?)```", open(page).read(), re.S)
blocks = [textwrap.dedent(b) for b in blocks]
for i, code in enumerate(blocks):
    exec(compile(code, f"{page} block {i}", "exec"), namespace)
print("ran", len(blocks))
"""


@pytest.mark.parametrize(
    "page",
    [
        # The mesh page starts a JAX of 8 devices (about 10 s): the slow pass.
        pytest.param(p, marks=pytest.mark.slow) if p in MESH_PAGES else p
        for p in PAGES
        if _blocks(p)
    ],
)
def test_every_python_block_runs(page, capsys):
    if page in MESH_PAGES:
        env = {
            **os.environ,
            "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
            "JAX_PLATFORMS": "cpu",
        }
        out = subprocess.run(
            [sys.executable, "-c", _RUN, page],
            capture_output=True,
            text=True,
            env=env,
            cwd=ROOT,
            timeout=600,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        assert out.stdout.strip() == f"ran {len(_blocks(page))}", out.stdout
        return
    namespace: dict = {"__name__": f"docs:{page}"}
    for i, code in enumerate(_blocks(page)):
        exec(compile(code, f"{page} block {i}", "exec"), namespace)  # noqa: S102
    capsys.readouterr()


def test_the_readme_is_a_front_door():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    for page in PAGES:
        body = (ROOT / page).read_text()
        dated = re.findall(r"\b20\d\d-\d\d-\d\d\b|this VM|this machine", body)
        assert not dated, (page, dated)
    linked = set(re.findall(r"\]\((docs/[a-z_A-Z]+\.md)\)", text))
    # Every page but the site's home (the README's own text) is linked.
    assert {p for p in PAGES if p.startswith("docs/")} - {"docs/index.md"} <= linked


def test_no_page_teaches_the_unchecked_bare_view_and_slot_array_form():
    # write_kv(pools, layer.view, k, v, meta.slot_mapping) carries no group:
    # another group's slots went through unchecked (issue 56). Pages teach
    # write_kv(pools, layer, k, v, meta), which is checked.
    bare = re.compile(r"write_kv\([^)]*\.view,[^)]*\.slot_mapping\b", re.S)
    pages = [
        *PAGES,
        *(str(p.relative_to(ROOT)) for p in ROOT.glob("notebooks/*.ipynb")),
    ]
    taught = [page for page in pages if bare.search((ROOT / page).read_text())]
    assert taught == []
    assert bare.search("jaxkv.write_kv(pools, layer.view, k, v, m.slot_mapping)")
