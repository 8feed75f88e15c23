"""pytest fixtures shared by the tests; the tiny-model specs themselves live in tests/models.py (import them from
there: `from models import ALL_TYPES, tiny_model`)."""

from __future__ import annotations

import pytest
import torch
from models import tiny_model


@pytest.fixture
def make_tiny():
    """Fixture form of tiny_model for tests that prefer fixtures."""
    return tiny_model


@pytest.fixture
def one_thread():
    """torch on one thread for the test (tiny matrices: thread start-up dominates on a shared machine), restored
    after; a module takes it for all its tests with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
