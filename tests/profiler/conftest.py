"""Profiler-test fixtures."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_intra_op_thread() -> Iterator[None]:
    # The models here are tiny: on a loaded 2-core machine intra-op threads spin
    # against each other and a step takes far longer than its work.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
