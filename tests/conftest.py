import os

import pytest

# Triton kernels run under the interpreter on CPU tensors when there is no GPU. This must be set
# before triton is first imported.
try:
    import torch
    _has_cuda = torch.cuda.is_available()
except ImportError:  # torch-free test subsets
    _has_cuda = False
if not _has_cuda:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if _has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """arch -> folder of a tiny random checkpoint with a trained tokenizer (built once per session)."""
    from tests.models import build_model

    root = tmp_path_factory.mktemp("models")
    return {arch: build_model(arch, root / arch) for arch in ("llama", "qwen2", "qwen3", "mistral")}


def pytest_runtest_logreport(report):
    """PAGEDSERVE_FAILURES=PATH: each failure's report is appended to PATH as it happens, so a run
    cut off by a time limit (the GPU machine's calls have one) still says what failed and why."""
    path = os.environ.get("PAGEDSERVE_FAILURES")
    if path and report.failed:
        with open(path, "a") as f:
            f.write(f"== {report.nodeid} ({report.when})\n{report.longreprtext}\n\n")
