"""pytest fixtures shared by the tests; the tiny-model specs themselves live in tests/models.py (import them from
there: `from models import ALL_TYPES, tiny_model`)."""

from __future__ import annotations

import pytest
from models import tiny_model


@pytest.fixture
def make_tiny():
    """Fixture form of tiny_model for tests that prefer fixtures."""
    return tiny_model
