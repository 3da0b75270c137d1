"""cpu_backend.worker.huge_pages: the KV cache's zeroed buffer on transparent huge pages.

Reference: torch.zeros. The buffer must equal it (shape, dtype, all zeros,
resident); where THP is `madvise` or `always` it must be backed by huge pages,
read back from /proc/self/smaps. The allocation context must change only the
large CPU `torch.zeros` calls the host's KV allocation makes.
"""

from __future__ import annotations

import pytest
import torch

from cpu_backend.worker import huge_pages
from cpu_backend.worker.model_runner import _on_huge_pages

MiB = 1 << 20
THP = huge_pages.thp_mode()


def test_thp_mode_reads_the_bracketed_word(tmp_path, monkeypatch):
    sysfs = tmp_path / "enabled"
    sysfs.write_text("always [madvise] never\n")
    monkeypatch.setattr(huge_pages, "THP_ENABLED", sysfs)
    huge_pages.thp_mode.cache_clear()
    try:
        assert huge_pages.thp_mode() == "madvise"
        sysfs.unlink()
        huge_pages.thp_mode.cache_clear()
        assert huge_pages.thp_mode() == "never"
    finally:
        huge_pages.thp_mode.cache_clear()


@pytest.mark.parametrize("dtype", [torch.int8, torch.bfloat16])
def test_huge_page_zeros_equals_torch_zeros_and_is_on_huge_pages(dtype):
    size = 96 * MiB // dtype.itemsize
    buf = huge_pages.huge_page_zeros(size, dtype)
    assert buf.shape == (size,) and buf.dtype == dtype and buf.is_contiguous()
    assert torch.equal(buf, torch.zeros(size, dtype=dtype))
    backed = huge_pages.huge_page_bytes(buf)
    if THP == "never":
        assert backed == 0
    else:
        # The kernel may fall back to small pages where it finds no free 2 MiB
        # page, but not for most of an idle 96 MiB.
        assert backed >= 48 * MiB, (THP, backed)


def test_a_small_pages_buffer_reports_no_huge_pages():
    buf = torch.ones(8 * MiB, dtype=torch.int8)  # under 2 huge pages, never advised
    assert huge_pages.huge_page_bytes(buf) <= 8 * MiB


@pytest.mark.skipif(THP != "madvise", reason="only THP `madvise` leaves unadvised memory on small pages")
def test_plain_torch_zeros_stays_on_small_pages():
    """The reference the advice is measured against: without it, no huge pages."""
    buf = torch.zeros(96 * MiB, dtype=torch.int8)
    assert huge_pages.huge_page_bytes(buf) == 0


@pytest.mark.skipif(THP == "never", reason="transparent huge pages disabled on this machine")
def test_the_allocation_context_serves_only_large_cpu_zeros():
    with _on_huge_pages(None):
        large = torch.zeros(80 * MiB, dtype=torch.int8, device=torch.device("cpu"))
        small = torch.zeros(MiB, dtype=torch.int8)
        shaped = torch.zeros(4, 4)  # no dtype: the host's call always names one
        ones = torch.ones(80 * MiB, dtype=torch.int8)
    assert torch.equal(large, torch.zeros_like(large))
    assert huge_pages.huge_page_bytes(large) >= 40 * MiB
    assert small.dtype == torch.int8 and not small.any()
    assert shaped.shape == (4, 4) and shaped.dtype == torch.float32 and not shaped.any()
    assert bool(ones.all())
    # outside the context torch.zeros is the plain one again
    assert torch.zeros(3, dtype=torch.int8).tolist() == [0, 0, 0]


def test_the_allocation_context_keeps_the_hosts_own_context():
    entered = []

    class Outer:
        def __enter__(self):
            entered.append("in")

        def __exit__(self, *exc):
            entered.append("out")

    with _on_huge_pages(Outer()):
        assert entered == ["in"]
    assert entered == ["in", "out"]
