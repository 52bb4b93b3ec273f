"""The layers point down (ARCHITECTURE.md): serve/bench -> scheduler/engine -> kvcache/kernels.

Reads every import statement of the project's packages, function-level ones included, so that a
lazy upward import fails here too."""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PROJECT = ("serve", "bench", "lab", "scheduler", "engine", "kvcache", "kernels")
# what each package may import of the project (its own modules always)
ALLOWED = {
    "kernels": {"kvcache"},
    "kvcache": {"kernels"},
    "scheduler": {"kvcache"},
    "engine": {"kvcache", "kernels", "scheduler.request"},  # scheduler.request: the shared vocabulary
    "serve": {"scheduler", "engine", "kvcache", "kernels"},
    "bench": {"serve", "scheduler", "engine", "kvcache", "kernels"},  # the user's load generator
    "lab": {"bench", "serve", "scheduler", "engine", "kvcache", "kernels", "tests"},
}
# modules that must stay free of torch (tested in milliseconds, importable by the CLI's --help)
TORCH_FREE = ("scheduler", "kvcache/block_manager.py", "kvcache/spec.py", "kvcache/calc.py", "kvcache/gpus.py",
              "engine/config.py", "engine/presets.py")


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, dotted module) of every import in the file; relative imports resolved."""
    tree = ast.parse(path.read_text(), str(path))
    package = ".".join(path.relative_to(REPO).with_suffix("").parts[:-1])
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            # `from scheduler import request` names the module scheduler.request
            found += [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
    return sorted(found)


def allowed(package: str, module: str) -> bool:
    top = module.split(".")[0]
    if top not in PROJECT and top != "tests" or top == package:
        return True
    return any(module == rule or module.startswith(rule + ".") for rule in ALLOWED[package])


def source_files(package: str) -> list[Path]:
    return sorted((REPO / package).rglob("*.py"))


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_imports_point_down(package):
    bad = [f"{path.relative_to(REPO)}:{line} imports {module}"
           for path in source_files(package) for line, module in imports(path)
           if not allowed(package, module)]
    assert not bad, "upward or sideways imports:\n" + "\n".join(bad)


def test_nothing_imports_the_lab():
    bad = [f"{path.relative_to(REPO)}:{line}" for package in PROJECT if package != "lab"
           for path in source_files(package) for line, module in imports(path) if module.split(".")[0] == "lab"]
    assert not bad


@pytest.mark.parametrize("part", TORCH_FREE)
def test_torch_free(part):
    target = REPO / part
    files = source_files(part) if target.is_dir() else [target]
    bad = [f"{path.relative_to(REPO)}:{line} imports {module}" for path in files
           for line, module in imports(path) if module.split(".")[0] in ("torch", "triton", "numpy")]
    assert not bad


def test_the_rules_see_lazy_and_relative_imports(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    pkg = tmp_path / "kvcache"
    pkg.mkdir()
    (pkg / "m.py").write_text("def f():\n    from engine.runner import ModelRunner\nfrom . import spec\n")
    found = imports(pkg / "m.py")
    assert found == [(2, "engine.runner.ModelRunner"), (3, "kvcache.spec")]
    assert not allowed("kvcache", found[0][1]) and allowed("kvcache", found[1][1])
    assert allowed("engine", "scheduler.request.Batch") and not allowed("engine", "scheduler.policy.Scheduler")
