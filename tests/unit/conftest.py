"""Sandbox fixtures: a sandbox per path (warm, cold), and the check that the host is clean after
(sandbox_host.py says what clean means)."""

from __future__ import annotations

import pytest
from sandbox_host import SLOT_UID_BASE, assert_host_clean, host_state

from gapless.sandbox import BwrapSandbox


@pytest.fixture
def clean_host():
    """Asserts, after the test, that it left nothing on the host."""
    before = host_state()
    yield
    assert_host_clean(before)


@pytest.fixture(params=["warm", "cold"])
def sandbox(request, clean_host):
    """A sandbox on each path; closed and checked for leftovers after the test."""
    box = BwrapSandbox(slot_uid_base=SLOT_UID_BASE, warm=request.param == "warm", max_concurrency=4)
    try:
        yield box
        assert box.leftovers() == []
        assert box.quarantined_uids == frozenset()
    finally:
        box.close()
