"""The layout shows the pipeline, and the lineage covers what each stage runs.

- Imports: no cycle between modules, and none from a lower layer to a higher one (LAYERS).
- Code in the lineage: every module a stage's code imports (its import closure inside eagle3ops, read from the
  source with ast) and the data files beside it are under one of that stage's `deps` in dvc.yaml, except the
  bookkeeping modules of BOOKKEEPING, each with its reason.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "eagle3ops"

# From the bottom up; a module may import from its own layer and the ones below. A layer names top-level modules
# or packages of eagle3ops.
LAYERS = (
    ("errors", "fs", "progress", "resume", "spec_settings", "reproducible", "cpu_share"),  # base helpers
    ("config",),  # the schema of params.yaml: a leaf above the base helpers (the stage's view: tracking/stage_view.py)
    ("data", "modeling", "formats", "decoding", "serving", "presets"),  # the shared core
    ("generation", "extraction", "training", "reporting", "tracking"),  # each stage's own core
    ("zoo", "runs"),  # built on those: the zoo trains with the training loop; runs read the tracking store
    ("stages", "benchmark"),
    ("cli",),
)

# Modules a stage runs that decide nothing in its outputs. No stage lists them as deps: an edit to one would
# re-run the whole pipeline for no change in any result.
BOOKKEEPING = {
    "eagle3ops.config": "parses params.yaml; every value it defaults is spelled out in params.yaml "
                        "(tests/test_params.py), which DVC tracks key by key",
    "eagle3ops.errors": "exception types",
    "eagle3ops.progress": "progress bars",
    "eagle3ops.fs": "writes files whole (temporary file, then rename); what they hold is the caller's",
    "eagle3ops.resume": "keeps a killed stage's state; a resumed run's outputs equal an uninterrupted run's "
                        "(tests/test_resume.py)",
    "eagle3ops.tracking": "records the run: MLflow, the metrics files, the target's identity, the dvc.yaml "
                          "declarations it reads; no output of a stage depends on it",
    "eagle3ops.reproducible": "pins the CPU kernels and thread count (cpu_reproducible) and the GPU's deterministic "
                              "settings (gpu_deterministic), outside the lineage like threads: how the machine rounds, recorded with each run, not what a stage computes",
    "eagle3ops.serving.registry": "the engine sessions running on this machine, stopped when idle to make room "
                                  "(loading the target on a GPU too); which engine answers changes no output",
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in PACKAGE.rglob("*.py")}


def imports(module: str) -> set[str]:
    """The eagle3ops modules `module` imports, at the top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in MODULES)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in MODULES:
            for alias in node.names:  # `from eagle3ops.x import y` imports the module x.y, or a name of x
                submodule = f"{node.module}.{alias.name}"
                found.add(submodule if submodule in MODULES else node.module)
    return found - {module, "eagle3ops"}


def layer(module: str) -> int:
    top = module.split(".")[1] if "." in module else ""
    return next(i for i, names in enumerate(LAYERS) if top in names)


def test_every_module_has_a_layer():
    placed = {name for names in LAYERS for name in names}
    assert not {m.split(".")[1] for m in MODULES if m != "eagle3ops"} - placed


def upward(graph: dict[str, set[str]]) -> list[str]:
    return [f"{module} (layer {layer(module)}) imports {imported} (layer {layer(imported)})"
            for module, imported_modules in sorted(graph.items()) for imported in sorted(imported_modules)
            if layer(imported) > layer(module)]


def test_no_import_from_a_lower_layer_to_a_higher_one():
    found = upward({module: imports(module) for module in MODULES if module != "eagle3ops"})
    assert not found, "\n".join(found)


def test_an_upward_import_is_found():
    assert upward({"eagle3ops.config": {"eagle3ops.tracking.run", "eagle3ops.errors", "eagle3ops.data.shards"}}) == [
        "eagle3ops.config (layer 1) imports eagle3ops.data.shards (layer 2)",
        "eagle3ops.config (layer 1) imports eagle3ops.tracking.run (layer 3)"]


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_cycle():
    graph = {module: imports(module) for module in MODULES if module != "eagle3ops"}
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def test_the_cycle_finder_finds_one():  # the guard above only means something if this finds a planted cycle
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def closure(module: str) -> set[str]:
    """`module` and every eagle3ops module it imports, directly or not, with the packages they sit in. What only
    bookkeeping imports (the config checking eval's decoding settings for every stage) is not followed."""
    seen, todo = set(), [module]
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        if not bookkeeping(current):
            todo.extend(imports(current))
        parent = current.rpartition(".")[0]
        if parent != "eagle3ops" and parent in MODULES:  # a package's __init__ runs before its modules
            todo.append(parent)
    return seen


def bookkeeping(module: str) -> bool:
    return any(module == name or module.startswith(f"{name}.") for name in BOOKKEEPING)


def files_run(module: str) -> list[Path]:
    """The module's source, and the data files beside it that its package ships (templates, presets)."""
    path = MODULES[module]
    if path.name != "__init__.py" and not path.read_text().strip():
        return []
    data = [p for p in path.parent.rglob("*") if p.is_file() and p.suffix not in (".py", ".pyc")
            and "__pycache__" not in p.parts and _same_package(p, path.parent)]
    runs = bool(path.read_text().strip()) and not (path.name == "__init__.py" and _docstring_only(path))
    return [path] * runs + data  # a package's description alone runs nothing


def _docstring_only(path: Path) -> bool:
    body = ast.parse(path.read_text()).body
    return all(isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) for node in body)


def _same_package(file: Path, package: Path) -> bool:
    """Data in `package` or its folders that are not packages of their own."""
    folder = file.parent
    while folder != package:
        if (folder / "__init__.py").is_file():
            return False
        folder = folder.parent
    return True


def stage_deps() -> dict[str, list[str]]:
    """{dvc.yaml stage: its deps under src/}, the same for every variant of a matrix or foreach stage."""
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    return {name: [dep for dep in entry.get("do", entry)["deps"] if dep.startswith("src/")]
            for name, entry in stages.items()}


def uncovered(stage: str, deps: list[str]) -> list[str]:
    covered = [ROOT / dep for dep in deps]
    missing = []
    for module in sorted(closure(f"eagle3ops.stages.{stage}")):
        if bookkeeping(module):
            continue
        for file in files_run(module):
            if not any(file == dep or dep in file.parents for dep in covered):
                missing.append(str(file.relative_to(ROOT)))
    return missing


@pytest.mark.parametrize("stage", sorted(stage_deps()))
def test_the_stage_depends_on_all_the_code_it_runs(stage):
    missing = uncovered(stage, stage_deps()[stage])
    assert not missing, f"dvc.yaml stage {stage!r} runs these but does not list them in its deps: {missing}"


def test_the_coverage_check_sees_a_missing_module():
    deps = stage_deps()["train"]
    assert not uncovered("train", deps)
    assert "src/eagle3ops/modeling/draft.py" in uncovered("train", [d for d in deps if "modeling" not in d])


def test_bookkeeping_modules_exist():
    for name in BOOKKEEPING:
        assert name in MODULES, f"BOOKKEEPING names {name}, which is gone"
