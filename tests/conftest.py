"""Shared, generic test helpers: ``seed`` and ``free_port`` fixtures and skips for optional
hardware/packages.

Markers:
    ``gpu``: the test needs a CUDA device; skipped when ``torch.cuda.is_available()``
        is false.
    ``transformers``: the test needs the optional ``transformers`` package; skipped
        when it is not installed.
"""

from __future__ import annotations

import importlib.util
import random
import socket
from collections.abc import Iterator

import pytest
import torch

HAS_TRANSFORMERS: bool = importlib.util.find_spec("transformers") is not None


def pytest_configure(config: pytest.Config) -> None:
    """Register the ``transformers`` marker (``gpu`` is registered in pyproject.toml);
    one intra-op thread for the whole session, fixtures included."""
    torch.set_num_threads(1)
    config.addinivalue_line(
        "markers", "transformers: needs the optional transformers package (skipped without it)"
    )


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Skip ``gpu`` tests without CUDA and ``transformers`` tests without the package."""
    if item.get_closest_marker("gpu") is not None and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if item.get_closest_marker("transformers") is not None and not HAS_TRANSFORMERS:
        pytest.skip("needs transformers (pip install transformers)")


@pytest.fixture
def seed() -> int:
    """Seed Python's and torch's global RNGs with 0 and return the seed."""
    random.seed(0)
    torch.manual_seed(0)
    return 0


@pytest.fixture
def free_port() -> int:
    """A TCP port on 127.0.0.1 free now, for a process group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def has_transformers() -> bool:
    """Whether the optional ``transformers`` package is installed."""
    return HAS_TRANSFORMERS


@pytest.fixture(autouse=True)
def _one_intra_op_thread() -> Iterator[None]:
    # The test models are tiny: with several intra-op threads on a loaded 2-core
    # machine the threads spin against each other and a millisecond step takes
    # seconds. Results do not depend on it (CPU kernels here are deterministic), but
    # kernels' scratch memory does (oneDNN keeps some per thread), so module-scoped
    # fixtures that profile run with one thread too (see pytest_configure).
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
