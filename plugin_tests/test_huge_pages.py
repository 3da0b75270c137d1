"""cpu_backend.worker.huge_pages: the KV cache's zeroed buffer and the moved
weights on transparent huge pages.

Reference: torch.zeros. The buffer must equal it (shape, dtype, all zeros,
resident); where THP is `madvise` or `always` it must be backed by huge pages,
read back from /proc/self/smaps. The allocation context must change only the
large CPU `torch.zeros` calls the host's KV allocation makes.
Moved weights: bit for bit the values before the move (clones taken before),
every tensor the modules hold inside the one buffer, shared storage still
shared (a write through one view seen through the other), tied parameters
still one object, the model's output unchanged.
"""

from __future__ import annotations

import dataclasses

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


@dataclasses.dataclass
class _Packed:  # like our linear methods' packed copies (a dataclass attribute)
    qweight: torch.Tensor
    scales: torch.Tensor
    mode: str = "int8"


def _model() -> torch.nn.Module:
    gen = torch.Generator().manual_seed(3)
    embed = torch.nn.Embedding(1000, 1024, dtype=torch.bfloat16)  # 2 MB
    embed.weight.requires_grad_(False)
    body = torch.nn.Linear(1024, 2048, bias=True)  # 8 MB fp32
    body.requires_grad_(False)
    head = torch.nn.Linear(1024, 1000, bias=False, dtype=torch.bfloat16)
    head.weight = embed.weight  # tied: one Parameter in two modules
    model = torch.nn.Sequential(embed, body, head)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    # a buffer viewing part of a parameter's storage, a plain tensor
    # attribute, a dataclass of packed tensors, one made in inference mode
    body.register_buffer("first_rows", body.weight[:4], persistent=False)
    body.cpu_backend_packed = torch.randint(-128, 128, (3, 70), dtype=torch.int8, generator=gen)
    with torch.inference_mode():
        head.cpu_backend_lm_head = _Packed(torch.randint(0, 255, (500, 64), dtype=torch.uint8),
                                           torch.rand(500, 2, dtype=torch.float32))
    return model


def _held(model):
    body, head = model[1], model[2]
    return {"embed": model[0].weight, "w": body.weight, "b": body.bias, "rows": body.first_rows,
            "attr": body.cpu_backend_packed, "q": head.cpu_backend_lm_head.qweight,
            "s": head.cpu_backend_lm_head.scales}


def test_move_weights_keeps_values_sharing_and_output():
    model = _model()
    held = _held(model)
    before = {k: v.clone() for k, v in held.items()}
    x = torch.randn(3, 1024)
    y_before = model[1](x)
    moved = huge_pages.move_weights(model)
    if THP == "never":
        assert moved.buffer is None and moved.nbytes == 0
        return
    buf = moved.buffer
    lo, hi = buf.data_ptr(), buf.data_ptr() + buf.numel()
    for k, t in _held(model).items():
        assert t is held[k]  # moved in place: every holder sees the move
        assert lo <= t.data_ptr() < hi, k
        assert t.dtype == before[k].dtype and t.shape == before[k].shape
        assert torch.equal(t.view(torch.uint8), before[k].view(torch.uint8)), k
    assert moved.tensors == 7  # first_rows views the weight: one slot for both
    assert moved.nbytes >= sum(t.numel() * t.element_size() for k, t in before.items() if k != "rows")
    assert model[2].weight is model[0].weight
    assert held["rows"].data_ptr() == held["w"].data_ptr()  # still a view of the weight
    with torch.no_grad():
        held["w"][0, 0] = 7.0
    assert held["rows"][0, 0] == 7.0
    with torch.no_grad():
        held["w"][0, 0] = before["w"][0, 0]
    assert torch.equal(model[1](x), y_before)
    assert moved.huge_page_bytes() >= 4 * MiB, (THP, moved.huge_page_bytes())


def test_small_models_and_thp_never_move_nothing(monkeypatch):
    small = torch.nn.Linear(64, 64).requires_grad_(False)
    ptr = small.weight.data_ptr()
    assert huge_pages.move_weights(small).buffer is None
    assert small.weight.data_ptr() == ptr
    model = _model()
    ptr = model[1].weight.data_ptr()
    monkeypatch.setattr(huge_pages, "thp_mode", lambda: "never")
    moved = huge_pages.move_weights(model)
    assert moved.buffer is None and moved.tensors == 0
    assert model[1].weight.data_ptr() == ptr


def test_move_weights_skips_trainable_and_non_cpu_tensors(monkeypatch):
    monkeypatch.setattr(huge_pages, "MIN_WEIGHT_BYTES", 0)
    model = _model()
    model[1].weight.requires_grad_(True)
    model[1].register_buffer("meta", torch.empty(4, device="meta"), persistent=False)
    ptr = model[1].weight.data_ptr()
    moved = huge_pages.move_weights(model)
    # first_rows shares the trainable weight's storage: both stay
    assert model[1].weight.data_ptr() == ptr == model[1].first_rows.data_ptr()
    assert model[1].meta.device.type == "meta"
    assert moved.tensors == (0 if THP == "never" else 5)
