"""The receive arena is refused, in one line, when the device cannot hold it."""

from __future__ import annotations

import pytest

from mx_refit.errors import FailedPrecondition
from mx_refit.receive.memory import check_arena_fits, device_free_bytes


def test_an_arena_larger_than_free_memory_is_refused_naming_needed_free_and_the_alternative() -> None:
    with pytest.raises(FailedPrecondition) as info:
        check_arena_fits(3 << 30, "cuda:0", 1 << 30, reader="r0")
    text = str(info.value)
    assert "\n" not in text
    assert "needs 3.00 GiB on cuda:0" in text and "1.00 GiB are free" in text
    assert "arena_device='cpu'" in text and "rank_exact" in text


def test_an_arena_that_fits_or_host_memory_passes() -> None:
    check_arena_fits(1 << 30, "cuda:0", 1 << 30, reader="r0")
    check_arena_fits(1 << 40, "cpu", None, reader="r0")
    assert device_free_bytes("cpu") is None
