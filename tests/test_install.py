"""The product install (`scripts/setup.sh` without --test, pyproject.toml's base dependencies): it
holds what the product imports and no more, and the CPU path serves without Triton (~1 GB), which
only the extras "gpu" and "test" bring."""
from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PRODUCT = ("serve", "scheduler", "engine", "kvcache", "kernels", "bench")  # `serve bench` is a product command
IMPORT_NAME = {"asyncio-throttle": "asyncio_throttle", "prometheus-client": "prometheus_client"}
# Base dependencies the product uses without importing them by name.
INDIRECT = {"tokenizers": "the fast tokenizers behind transformers' AutoTokenizer (scheduler/token_bytes.py reads them)"}


def project() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def dist_name(requirement: str) -> str:
    return re.split(r"[\s<>=!~;\[]", requirement, maxsplit=1)[0].lower()


def product_imports() -> set[str]:
    names: set[str] = set()
    for package in PRODUCT:
        for path in (REPO / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names.update(alias.name.split(".")[0] for alias in node.names)
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names.add(node.module.split(".")[0])
    return names


def test_every_base_dependency_is_used_by_the_product():
    imported = product_imports()
    unused = [d for d in map(dist_name, project()["dependencies"])
              if d not in INDIRECT and IMPORT_NAME.get(d, d.replace("-", "_")) not in imported]
    assert not unused, f"base dependencies the product never imports (drop them, or move them to an extra): {unused}"


def test_triton_comes_only_with_the_gpu_and_test_extras():
    proj = project()
    assert "triton" not in map(dist_name, proj["dependencies"])
    extras = proj["optional-dependencies"]
    assert "triton" in map(dist_name, extras["gpu"])
    assert "triton" in map(dist_name, extras["test"])  # the kernel tests run it under TRITON_INTERPRET=1


CPU_WITHOUT_TRITON = """
import sys
sys.modules["triton"] = None  # as if it were not installed: `import triton` raises, find_spec says None
from serve.cli import build_parser, main
build_parser()  # imports every command's module: run, generate, bench, kv-calc
import serve.api, serve.run_cmd, serve.uvicorn_server, serve.engine_process, bench.load, bench.client
sys.exit(main(["generate", "--model", sys.argv[1], "--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "16",
               "--max-tokens", "4", "--ignore-eos", "Hello"]))
"""


def test_the_cpu_path_runs_without_triton(tmp_path):
    from tests.models import build_model

    model = build_model("llama", tmp_path / "llama")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("TRITON_INTERPRET", None)
    r = subprocess.run([sys.executable, "-c", CPU_WITHOUT_TRITON, str(model)], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip(), r.stderr  # the generated text
    assert "triton" not in r.stderr.lower(), r.stderr


def test_kernels_package_imports_no_triton():
    """kernels/__init__.py runs on the CPU path (kernels.reference): it must not need Triton."""
    code = ("import sys; sys.modules['triton'] = None\n"
            "import kernels, kernels.reference\n"
            "try:\n    kernels.require_triton()\nexcept ValueError as e:\n    print(e)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "pip install triton" in r.stdout and "--backend torch" in r.stdout
