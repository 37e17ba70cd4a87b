"""The import layering written in docs/architecture.md holds for every import in
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
    text = (ROOT / "docs/architecture.md").read_text()
    block = re.search(r"```layers\n(.*?)```", text, re.S)
    assert block is not None, "docs/architecture.md has no ```layers block"
    ranks = {}
    for line in block.group(1).splitlines():
        rank, *units = line.split()
        ranks |= dict.fromkeys(units, int(rank))
    return ranks


def _unit(path: Path) -> str:
    parts = path.relative_to(ROOT / "jaxkv").with_suffix("").parts
    return parts[0]


def _imports(path: Path):
    """(unit, names, module) for every ``jaxkv`` import in ``path``."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "jaxkv" or node.module.startswith("jaxkv."):
                mod = node.module.split(".")
                yield (
                    (mod[1] if len(mod) > 1 else "__init__"),
                    [a.name for a in node.names],
                    node.module,
                )
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("jaxkv."):
                    yield a.name.split(".")[1], [], a.name


def _violations(path: Path, unit: str, ranks: dict[str, int]) -> list[str]:
    bad = []
    packages = {p.name for p in (ROOT / "jaxkv").iterdir() if p.is_dir()}
    for target, names, module in _imports(path):
        if target == unit:
            continue
        if ranks[target] >= ranks[unit]:
            bad.append(
                f"{path.name} ({unit}, {ranks[unit]}) imports {target} "
                f"({ranks[target]})"
            )
        if target in packages and module != f"jaxkv.{target}":
            bad.append(
                f"{path.name} ({unit}) imports {module}: another "
                f"sub-package's private module, not its __init__"
            )
        if (
            ranks[unit] > ranks["__init__"]
            and target.startswith("_")
            and target not in ("__init__",)
        ):
            bad.append(
                f"{path.name} ({unit}) imports {module}: units above the "
                "package import its public namespaces only"
            )
        private = [n for n in names if n.startswith("_") and n not in SEED_PRIVATE]
        if private and target != "_util":
            bad.append(f"{path.name} imports {private} from {target}")
    return bad


def test_every_import_goes_down_the_layers():
    ranks = _ranks()
    files = sorted((ROOT / "jaxkv").rglob("*.py"))
    units = {_unit(f) for f in files}
    assert units <= set(ranks), (
        f"units missing in docs/architecture.md: {units - set(ranks)}"
    )
    bad = [v for f in files for v in _violations(f, _unit(f), ranks)]
    assert not bad, "\n".join(bad)


def test_every_module_inside_a_package_is_private():
    public = [
        str(f.relative_to(ROOT))
        for f in (ROOT / "jaxkv").rglob("*.py")
        if not f.name.startswith("_") and f.parent != ROOT / "jaxkv"
    ]
    assert not public, public
    top = sorted(
        f.name for f in (ROOT / "jaxkv").glob("*.py") if not f.name.startswith("_")
    )
    assert top == ["vllm.py"], top


def test_the_layering_check_sees_a_violation(tmp_path):
    # The check itself: an upward import, a private module of another
    # sub-package and a private name are each found.
    ranks = _ranks()
    assert (
        ranks["config"] < ranks["plan"] < ranks["kv"] < ranks["serve"] < ranks["demo"]
    )
    f = tmp_path / "m.py"
    f.write_text(
        "from jaxkv.serve import ServingLoop\n"
        "from jaxkv.kv._ops import write_kv\n"
        "from jaxkv.plan import _x\n"
    )
    found = _violations(f, "step", ranks)
    assert len(found) == 3, found
    assert "imports serve" in found[0]
    assert "private module" in found[1]
    assert "['_x']" in found[2]
    assert len(_violations(f, "demo", ranks)) == 2  # serve is below demo
    g = tmp_path / "d.py"
    g.write_text("from jaxkv._util import is_int\n")
    assert _violations(g, "plan", ranks) == []
    (found,) = _violations(g, "demo", ranks)
    assert "public namespaces only" in found


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


def test_a_scheduled_step_is_the_step_builder_s_input_and_every_field_is_packed():
    # The scheduler's output is the builder's input type (no field-name
    # coupling); every StepArrays field reaches the packed buffer (a field
    # added to the record but not packed would be dropped silently).
    import dataclasses
    import inspect

    import jaxkv
    from jaxkv.step._step_builder import StepMetadataBuilder

    assert issubclass(jaxkv.ScheduledStep, jaxkv.StepArrays)
    hints = inspect.signature(StepMetadataBuilder.prepare).parameters
    assert hints["arrays"].annotation in ("StepArrays", jaxkv.StepArrays)
    packed = inspect.getsource(StepMetadataBuilder._pack)
    missing = [
        f.name
        for f in dataclasses.fields(jaxkv.StepArrays)
        if f"arrays.{f.name}" not in packed
        and f.name not in ("cu_num_logits",)  # staging input, not packed
    ]
    assert missing == []


def test_no_class_is_split_across_modules():
    # A class inherits from another module's class only where that base is
    # public API of its own (the spec hierarchy, vLLM's records); a private
    # mixin holding half of a class's methods elsewhere is refused.
    import importlib
    import inspect

    import jaxkv

    public = {
        id(getattr(importlib.import_module(f"jaxkv.{p}"), n))
        for p in jaxkv.__all__
        if inspect.ismodule(getattr(jaxkv, p))
        for n in importlib.import_module(f"jaxkv.{p}").__all__
    } | {id(getattr(jaxkv, n)) for n in jaxkv.__all__}
    split = []
    for path in sorted((ROOT / "jaxkv").rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        if rel.parts[1] == "demo" or rel.name == "__main__":
            continue
        mod = importlib.import_module(".".join(rel.parts).removesuffix(".__init__"))
        for cls in vars(mod).values():
            if not inspect.isclass(cls) or cls.__module__ != mod.__name__:
                continue
            for base in cls.__bases__:
                if (
                    base.__module__.startswith("jaxkv")
                    and base.__module__ != cls.__module__
                    and id(base) not in public
                ):
                    split.append(f"{cls.__module__}.{cls.__name__}({base.__name__})")
    assert not split, split


def test_no_folder_holds_more_than_a_quarter_of_the_library():
    lines: dict[str, int] = {}
    for path in (ROOT / "jaxkv").rglob("*.py"):
        parts = path.relative_to(ROOT / "jaxkv").parts
        key = parts[0] if len(parts) > 1 else "."
        lines[key] = lines.get(key, 0) + len(path.read_text().splitlines())
    total = sum(lines.values())
    big = {k: round(v / total, 3) for k, v in lines.items() if v > total / 4}
    assert not big, big


def _module_graph() -> dict[str, set[str]]:
    """Module -> the jaxkv modules it imports (function-local and type-only too).

    Package ``__init__`` files are left out: an import through a package is
    a step down the layers, checked above.
    """
    files = {
        ".".join(p.relative_to(ROOT).with_suffix("").parts): p
        for p in (ROOT / "jaxkv").rglob("*.py")
        if p.name != "__init__.py"
    }
    graph: dict[str, set[str]] = {m: set() for m in files}
    for m, path in files.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module in files:
                graph[m].add(node.module)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    found, done = [], set()

    def visit(m: str, path: list[str]) -> None:
        for t in sorted(graph.get(m, ())):
            if t in path:
                found.append([*path[path.index(t) :], t])
            elif t not in done:
                visit(t, [*path, t])
        done.add(m)

    for m in sorted(graph):
        if m not in done:
            visit(m, [m])
    return found


def test_no_module_imports_itself_around_a_circle():
    # Inside a package too: a function-local or TYPE_CHECKING import that
    # closes a circle hides an order between two modules.
    assert _cycles(_module_graph()) == []
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]


def test_the_root_is_a_package_boundary_not_a_drawer():
    # The package's own modules; every idea with modules of its own is a
    # sub-package.
    root = sorted(p.name for p in (ROOT / "jaxkv").glob("*.py"))
    assert len(root) <= 6, root
