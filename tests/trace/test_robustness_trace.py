"""Robustness of the command line where torch is imported (slow; the rest is
``tests/unit/test_robustness.py``): ``validate --device cuda`` without CUDA is one line on stderr,
"memcalc: error: ...", exit 2."""

from __future__ import annotations

import pytest
from conftest import cli_run as run
from conftest import one_line_error


@pytest.mark.slow  # imports torch
def test_validate_device_cuda_without_cuda():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    r = run(["validate", "--model", "gpt2", "--seq", "64", "--scale-layers", "1", "--device", "cuda"])
    one_line_error(r, 2, "--device cuda: no CUDA device is available")
