"""validate refuses a GPTQ / AWQ base in one line: gptqmodel's kernels need CUDA (the estimate reads them from
source, tests/unit/test_quant_base.py). Slow: ``memcalc validate`` imports torch."""

from __future__ import annotations

import pytest

from conftest import cli_run, one_line_error

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("quant", ["gptq", "awq"])
def test_validate_refuses_quant_base(quant: str) -> None:
    one_line_error(cli_run(["validate", "--model", "llama-2-7b", "--quant", quant]), 2,
                   f"--quant {quant}: a {quant.upper()} base cannot be traced without CUDA")
