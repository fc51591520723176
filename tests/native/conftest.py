"""Every test of tests/native starts with its process's threads noted (native_util.threads_now)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from native_util import note_threads_at_start


@pytest.fixture(autouse=True)
def _threads_at_start() -> Iterator[None]:
    note_threads_at_start()
    yield
