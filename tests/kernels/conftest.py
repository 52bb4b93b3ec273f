"""The kernel tests run the Triton kernels (under TRITON_INTERPRET=1 on the CPU): without the
triton package (the CPU product install leaves it out) the whole folder skips."""
import pytest

pytest.importorskip("triton")
