"""rollout/kv/huge_pages.py: a CPU KV pool asks for transparent huge pages before it is first
written, on a mapping of its own, so the kernel backs it with 2 MB pages (fewer TLB misses for
the scattered reads of a decode step, and 512x fewer faults when the pool is built at every
wake-up)."""

import ctypes
import errno
import gc
import mmap

import pytest
import torch

from rollout.colocation import host_heap
from rollout.kv import huge_pages
from rollout.kv.pool import KVPool


def thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "never"


def mapping_of(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping that holds `address`."""
    with open("/proc/self/smaps") as f:
        fields, inside = {}, False
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                if inside:
                    break
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside:
                fields[head.rstrip(":")] = line.split(":", 1)[1].strip()
    assert fields, "no mapping holds the address"
    return fields


def huge_kb_under(address: int) -> int:
    return int(mapping_of(address)["AnonHugePages"].split()[0])


def advised(address: int) -> bool:
    """The mapping carries MADV_HUGEPAGE ("hg" in its VmFlags)."""
    return "hg" in mapping_of(address)["VmFlags"].split()


def kernel_gives_huge_pages() -> bool:
    """The control: does the kernel back a fresh advised mapping with huge pages right now?
    Whether it does depends on the host's free memory at that moment (another process compacting
    or filling it makes the fault fall back to small pages), not on the code under test, so the
    backing asserts below skip when the control gets none, and fail when only the pool does."""
    size = 8 << 20
    with mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS) as m:
        m.madvise(mmap.MADV_HUGEPAGE)
        for offset in range(0, size, mmap.PAGESIZE):
            m[offset] = 1
        view = ctypes.c_char.from_buffer(m)
        try:
            return huge_kb_under(ctypes.addressof(view) + size // 2) > 0
        finally:
            del view  # an exported buffer would keep the mapping from closing


def assert_backed_by_huge_pages(address: int) -> None:
    if huge_kb_under(address) > 0:
        return
    if not kernel_gives_huge_pages():
        pytest.skip("the kernel gave no huge page to a fresh advised mapping either "
                    "(the host's free memory at this moment); the advice was asserted")
    raise AssertionError("a fresh advised mapping got huge pages, the pool none")


needs_thp = pytest.mark.skipif(thp_mode() == "never" or not huge_pages.can_advise(),
                               reason="no transparent huge pages on this host")


@needs_thp
def test_a_cpu_pool_lives_on_huge_pages():
    # 30 layers x 3 KV heads x 64 (SmolLM2-135M), 1,024 slots: 45 MB of K and V
    pool = KVPool(30, 1024, 3, 64, torch.float32, torch.device("cpu"))
    assert torch.count_nonzero(pool.buffer) == 0  # still the zeroed pool the engine expects
    middle = pool.buffer.data_ptr() + pool.buffer.nbytes // 2
    assert advised(middle)
    assert_backed_by_huge_pages(middle)


@needs_thp
def test_zeros_on_huge_pages_from_a_boundary():
    zeros = huge_pages.empty_zeros((16 << 20,), torch.float32, torch.device("cpu"))
    assert zeros.dtype == torch.float32 and zeros.shape == (16 << 20,)
    assert torch.count_nonzero(zeros) == 0
    assert zeros.data_ptr() % huge_pages.HUGE_PAGE == 0
    assert advised(zeros.data_ptr() + zeros.nbytes // 2)
    assert_backed_by_huge_pages(zeros.data_ptr() + zeros.nbytes // 2)


@needs_thp
def test_the_pool_is_its_own_mapping_after_the_heap_kept_freed_blocks():
    # The failure this guards: with glibc keeping freed blocks (host_heap), a pool taken from
    # malloc came from heap memory other tensors had already written on small pages.
    host_heap.keep_freed_blocks()
    blocks = [torch.ones(7 << 20) for _ in range(3)]  # 28 MB each: below the mmap threshold
    del blocks[:2]  # 56 MB written and freed, one free heap block malloc would serve 45 MB from
    pool = KVPool(30, 1024, 3, 64, torch.float32, torch.device("cpu"))
    middle = pool.buffer.data_ptr() + pool.buffer.nbytes // 2
    assert advised(middle)
    assert_backed_by_huge_pages(middle)
    del blocks


def test_small_and_off_cpu_tensors_come_from_torch():
    # Told apart by their storage, not by the advice on the memory under them: heap memory
    # keeps the advice of an earlier owner (torch's allocator advises its large blocks where
    # THP_MEM_ALLOC_ENABLE is set), and on a CI host a small tensor's heap block was found
    # advised. A mapping of ours is a foreign buffer, which torch will not resize.
    small = huge_pages.empty_zeros((1 << 18,), torch.float32, torch.device("cpu"))  # 1 MB
    assert torch.count_nonzero(small) == 0 and small.untyped_storage().resizable()
    if huge_pages.can_advise():
        large = huge_pages.empty_zeros((1 << 20,), torch.float32, torch.device("cpu"))  # 4 MB
        assert not large.untyped_storage().resizable()
    meta = huge_pages.empty_zeros((1 << 22,), torch.float32, torch.device("meta"))
    assert meta.device.type == "meta" and meta.shape == (1 << 22,)


def test_dropping_the_pool_unmaps_it():
    zeros = huge_pages.empty_zeros((4, 1 << 20), torch.float32, torch.device("cpu"))
    row = zeros[2]  # a view keeps the mapping alive
    address = zeros.data_ptr()
    del zeros
    assert mapping_of(address) and torch.count_nonzero(row) == 0
    del row
    gc.collect()
    with pytest.raises(AssertionError, match="no mapping"):
        mapping_of(address)


def test_a_mapping_the_kernel_refuses_is_a_value_error_naming_kv_cache_tokens(monkeypatch):
    """The backstop behind size_pool's check against free memory (which memory taken between
    the check and the build can defeat): ENOMEM from mmap names the field and the size."""
    def refuse(*args, **kwargs):
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    monkeypatch.setattr(huge_pages.mmap, "mmap", refuse)
    with pytest.raises(ValueError, match=r"^kv_cache_tokens: the KV pool's 64.0 MiB could not "
                                         r"be mapped \(\[Errno 12\] Cannot allocate memory\)"):
        huge_pages.empty_zeros((16 << 20,), torch.float32, torch.device("cpu"))

    def other(*args, **kwargs):
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(huge_pages.mmap, "mmap", other)
    with pytest.raises(OSError, match="Invalid argument"):  # not a matter of the pool's size
        huge_pages.empty_zeros((16 << 20,), torch.float32, torch.device("cpu"))
