"""The KV cache and the weights on transparent huge pages.

The host allocates the whole KV cache with one `torch.zeros` (in
`vllm.v1.worker.utils.allocate_kv_cache`). On CPU that zeroing faults in every
4 KiB page one at a time. Marked `MADV_HUGEPAGE` before it is touched, the
buffer faults in 2 MiB pages instead: on a 2-core Zen 3 VM the automatic
20 GiB cache was set up in 21-24 s against 29-35 s (a second buffer in one
process: 3.0-3.6 s against 12.8 s; the first touch after another process freed
the memory pays the VM's own faults), and attention reads it with fewer TLB
misses. The memory is still committed and
zeroed at start, as the host's is: a KV cache that does not fit fails there,
not mid-serve.

`allocation_context()` is what our model runner passes as the host's
`kv_cache_allocation_context` (its hook for placing the KV cache): a torch
function mode that serves large CPU `torch.zeros` calls from
`huge_page_zeros` and leaves every other call alone. With THP set to `never`
(/sys/kernel/mm/transparent_hugepage/enabled) the advice is skipped and the
allocation is the host's.

`move_weights(model)` does the same for the weights once they are loaded and
repacked: it copies every tensor the model's modules hold (parameters,
buffers, our packed copies) into one buffer marked `MADV_HUGEPAGE` and points
the tensors at it in place (`Tensor.set_`, so every holder sees the move).
Separate allocations could not use huge pages: most weights are smaller than
2 MiB, and glibc maps each large allocation on its own, unaligned. Decode reads
every weight once per token; on 4 KiB pages that is a TLB miss every 4 KiB,
each a page walk (through the guest's and the host's tables in a VM): cold
int4 linears of the Qwen2.5-0.5B shape ran 8-12% faster on huge pages
(2 threads, Sapphire Rapids VM: o 25.3 -> 23.3 us, gate_up 199 -> 184 us).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import math
import time
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14
# Below this a buffer holds few whole huge pages: not worth a syscall.
MIN_BYTES = 64 << 20
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@functools.cache
def thp_mode() -> str:
    """`always`, `madvise` or `never` (the bracketed word); `never` if unknown."""
    try:
        text = THP_ENABLED.read_text()
    except OSError:
        return "never"
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else "never"


@functools.cache
def _libc_madvise():
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


def advise_huge_pages(tensor: torch.Tensor) -> bool:
    """MADV_HUGEPAGE over the whole 2 MiB pages inside `tensor`'s storage.
    Only pages not yet touched are affected, so call it before writing."""
    start = tensor.untyped_storage().data_ptr()
    end = start + tensor.untyped_storage().nbytes()
    first = -(-start // HUGE_PAGE) * HUGE_PAGE
    last = end // HUGE_PAGE * HUGE_PAGE
    if thp_mode() == "never" or last <= first:
        return False
    return _libc_madvise()(first, last - first, MADV_HUGEPAGE) == 0


def huge_page_zeros(size, dtype: torch.dtype) -> torch.Tensor:
    """torch.zeros(size, dtype=dtype) on the CPU, faulted in as huge pages."""
    out = torch.empty(size, dtype=dtype)
    advise_huge_pages(out)
    return out.zero_()


def huge_page_bytes(tensor: torch.Tensor) -> int:
    """Bytes of `tensor`'s storage backed by huge pages now (/proc/self/smaps,
    summed over the mappings the storage overlaps, so mappings it only shares
    with other memory count too)."""
    start = tensor.untyped_storage().data_ptr()
    end = start + tensor.untyped_storage().nbytes()
    total, overlaps = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split(None, 1)[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(v, 16) for v in head.split("-"))
                overlaps = lo < end and start < hi
            elif overlaps and head == "AnonHugePages:":
                total += int(line.split()[1]) * 1024
    return total


class _LargeZerosOnHugePages(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.zeros and _large_cpu_zeros(args, kwargs):
            return huge_page_zeros(args[0] if len(args) == 1 else args, kwargs["dtype"])
        return func(*args, **kwargs)


def _large_cpu_zeros(args, kwargs) -> bool:
    """torch.zeros(int or ints, dtype=..., [device=cpu]) of MIN_BYTES or more."""
    if set(kwargs) - {"dtype", "device"} or not isinstance(kwargs.get("dtype"), torch.dtype):
        return False
    if torch.device(kwargs.get("device") or "cpu").type != "cpu":
        return False
    dims = args[0] if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)) else args
    if not dims or not all(isinstance(d, int) for d in dims):
        return False
    return math.prod(dims) * kwargs["dtype"].itemsize >= MIN_BYTES


def allocation_context() -> contextlib.AbstractContextManager:
    if thp_mode() == "never":
        return contextlib.nullcontext()
    return _LargeZerosOnHugePages()


# Weight slots start on cache lines (and so on every element size).
WEIGHT_ALIGN = 64
# Below this the model's weights fill few whole huge pages: left where they are.
MIN_WEIGHT_BYTES = 8 << 20


@dataclasses.dataclass
class MovedWeights:
    """What `move_weights` did; `buffer` keeps the weights' new home."""

    buffer: torch.Tensor | None
    tensors: int
    nbytes: int
    seconds: float

    def huge_page_bytes(self) -> int:
        return 0 if self.buffer is None else huge_page_bytes(self.buffer)


def _held_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """Every CPU tensor the model's modules hold directly: parameters,
    buffers, tensor attributes and the tensor fields of dataclass attributes,
    alone or in a list (the packed copies our linear methods keep)."""
    found: dict[int, torch.Tensor] = {}
    for module in model.modules():
        values = [*module._parameters.values(), *module._buffers.values()]
        for value in vars(module).values():
            if isinstance(value, torch.Tensor):
                values.append(value)
                continue
            for item in value if isinstance(value, list) else [value]:
                if dataclasses.is_dataclass(item) and not isinstance(item, type):
                    values.extend(getattr(item, f.name) for f in dataclasses.fields(item))
        for t in values:
            if (isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.layout == torch.strided
                    and t.untyped_storage().nbytes() > 0):
                found[id(t)] = t
    return list(found.values())


def _movable(t: torch.Tensor) -> bool:
    """A plain tensor (or parameter) autograd does not track."""
    return type(t).__torch_dispatch__ is torch.Tensor.__torch_dispatch__ and not t.requires_grad


def move_weights(model: torch.nn.Module) -> MovedWeights:
    """Move the model's weights into one buffer on huge pages (see the module
    docstring). Tensors sharing a storage keep sharing it (a storage one of
    whose tensors cannot move stays); values are copied bit for bit. Nothing
    moves with THP `never` or under MIN_WEIGHT_BYTES."""
    start = time.perf_counter()
    if thp_mode() == "never":
        return MovedWeights(None, 0, 0, 0.0)
    by_storage: dict[int, list[torch.Tensor]] = {}
    for t in _held_tensors(model):
        by_storage.setdefault(t.untyped_storage().data_ptr(), []).append(t)
    by_storage = {k: group for k, group in by_storage.items() if all(map(_movable, group))}
    slots, total = [], 0
    for group in by_storage.values():
        slots.append((total, group))
        total += -(-group[0].untyped_storage().nbytes() // WEIGHT_ALIGN) * WEIGHT_ALIGN
    if total < MIN_WEIGHT_BYTES:
        return MovedWeights(None, 0, 0, time.perf_counter() - start)
    # Inference mode: weights made under it can only be re-pointed inside it.
    with torch.inference_mode():
        buffer = torch.empty(total, dtype=torch.uint8)
        advise_huge_pages(buffer)
        storage = buffer.untyped_storage()
        for offset, group in slots:
            old = group[0].untyped_storage()
            src = torch.empty(0, dtype=torch.uint8).set_(old, 0, (old.nbytes(),), (1,))
            buffer[offset:offset + old.nbytes()].copy_(src)
            del src, old
            for t in group:
                t.set_(storage, offset // t.element_size() + t.storage_offset(), t.size(), t.stride())
    # The old copies below glibc's mmap threshold went back to its heap:
    # hand their pages to the kernel (else resident memory grew by ~30% of
    # the moved bytes on a GPTQ int4 Qwen2.5-0.5B).
    _malloc_trim()
    return MovedWeights(buffer, sum(len(g) for g in by_storage.values()), total,
                        time.perf_counter() - start)


def _malloc_trim() -> None:
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (AttributeError, OSError):  # not glibc
        pass
