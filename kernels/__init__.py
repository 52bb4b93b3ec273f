"""Triton/Gluon kernels, each beside its plain-torch reference (kernels/reference.py).

Every module here but reference.py imports triton, which only the GPU path (and the kernel tests,
under TRITON_INTERPRET=1) needs: the CPU install leaves it out (pyproject.toml's extra "gpu"). So
this file imports nothing heavy: the CPU path imports kernels.reference through it.
"""
from __future__ import annotations

import importlib.util

TRITON_MISSING = ("the Triton kernels (a CUDA device, or --backend triton) need the triton package, which is not "
                  "installed: pip install triton (scripts/setup.sh installs it on a machine with an NVIDIA GPU), or "
                  "run with --backend torch")


def require_triton() -> None:
    """Where triton is missing, raise a ValueError (like select_ops' other "these choices don't go
    together" errors: one line at the CLI, no traceback) that says what to install. Imports nothing."""
    if importlib.util.find_spec("triton") is None:
        raise ValueError(TRITON_MISSING)
