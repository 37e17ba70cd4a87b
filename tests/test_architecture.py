"""The import layering written in ARCHITECTURE.md holds for every import in
``jaxkv/``, no unit imports another's underscore names, and ``import jaxkv``
loads no flax (the demo's dependency, an extra).
"""  # noqa: D205

import ast
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# vLLM's own names for these are underscore names; the seeds export them.
SEED_PRIVATE = {
    "_align_mixed_attention_kv_cache_views",
    "_kv_first_layers_sharing_pool_with_mamba",
}


def _ranks() -> dict[str, int]:
    text = (ROOT / "ARCHITECTURE.md").read_text()
    block = re.search(r"```layers\n(.*?)```", text, re.S)
    assert block is not None, "ARCHITECTURE.md has no ```layers block"
    ranks = {}
    for line in block.group(1).splitlines():
        rank, *units = line.split()
        ranks |= dict.fromkeys(units, int(rank))
    return ranks


def _unit(path: Path) -> str:
    parts = path.relative_to(ROOT / "jaxkv").with_suffix("").parts
    return parts[0]


def _imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "jaxkv" or node.module.startswith("jaxkv."):
                mod = node.module.split(".")
                yield (
                    (mod[1] if len(mod) > 1 else "__init__"),
                    [a.name for a in node.names],
                )
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("jaxkv."):
                    yield a.name.split(".")[1], []


def test_every_import_goes_down_the_layers():
    ranks = _ranks()
    files = sorted((ROOT / "jaxkv").rglob("*.py"))
    units = {_unit(f) for f in files}
    assert units <= set(ranks), (
        f"units missing in ARCHITECTURE.md: {units - set(ranks)}"
    )
    bad = []
    for f in files:
        u = _unit(f)
        for target, names in _imports(f):
            if target == u:
                continue
            if ranks[target] >= ranks[u]:
                bad.append(
                    f"{f.relative_to(ROOT)} ({u}, {ranks[u]}) imports {target} "
                    f"({ranks[target]})"
                )
            private = [n for n in names if n.startswith("_") and n not in SEED_PRIVATE]
            if private and target != "_util":
                bad.append(f"{f.relative_to(ROOT)} imports {private} from {target}")
    assert not bad, "\n".join(bad)


def test_the_layering_check_sees_a_violation(tmp_path):
    # The check itself: an upward import is found.
    ranks = _ranks()
    assert ranks["specs"] < ranks["cache"] < ranks["serve"] < ranks["demo"]
    f = tmp_path / "m.py"
    f.write_text(
        "from jaxkv.serve.loop import ServingLoop\nfrom jaxkv.cache.ops import _x\n"
    )
    assert list(_imports(f)) == [("serve", ["ServingLoop"]), ("cache", ["_x"])]


def test_import_jaxkv_loads_no_flax_and_flax_is_an_extra():
    code = (
        "import sys, jaxkv; print(sorted(m for m in ('flax', 'jaxkv.demo', "
        "'matplotlib') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not any(d.startswith("flax") for d in project["dependencies"])
    assert any(d.startswith("flax") for d in project["optional-dependencies"]["demo"])
