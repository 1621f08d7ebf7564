"""Transparent huge pages for a CPU engine's long-lived memory: the weights and the KV cache.

A decoder step reads every weight of every layer, and the KV cache through block tables, far
more memory than the CPU's TLB covers in 4 KiB pages (a few MiB), so on pages of that size
most of those reads first walk the page table. Linux can back memory with 2 MiB pages
instead, but on most distributions only memory a program asked for with madvise
(/sys/kernel/mm/transparent_hugepage/enabled says `madvise`), and the engine's allocations
(torch's, oneDNN's) never ask. Measured on a 2-core Xeon (AMX): the small model's gate-up
product of 2,048 rows took 7.6 ms with its weight hot and 10.7 ms when the layers' weights
took turns, as they do in a forward pass, and 7.7 ms either way once they sat on huge pages;
the same engine with them embedded and generated 1.1-1.3x the tokens a second
(benchmarks/huge_pages.py; benchmarks/README.md, "huge pages, again").

So the worker backs what it keeps for its lifetime with huge pages where the kernel offers
them (`HugePager`): the KV cache is allocated on them (`zeros`: an anonymous mapping advised
before it is first touched), and the weights, which the loaders and oneDNN allocate, are
moved onto them where they lie (`back`: MADV_COLLAPSE, Linux 6.1 and later; on an older
kernel the advice alone lets khugepaged move them in the background). Where huge pages turn
out to be slow to come by (some VMs), it leaves them to khugepaged rather than slow the
start. Short-lived activations stay with malloc. Nothing changes where the kernel has
transparent huge pages off (`never`) or is not Linux; `--no-cpu-huge-pages` turns it off.
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import errno
import functools
import logging
import mmap
import re
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from torch import nn

logger = logging.getLogger(__name__)

SYSFS = Path("/sys/kernel/mm/transparent_hugepage")
# madvise(2) advice values (asm-generic/mman-common.h).
MADV_HUGEPAGE = 14
MADV_POPULATE_WRITE = 23  # Linux 5.14
MADV_COLLAPSE = 25  # Linux 6.1
DEFAULT_HUGE_PAGE = 2 << 20
# Huge pages are slow here once PROBE_PAGES in a row took more than this each (HugePager).
SLOW_PAGE_S = 0.004
PROBE_PAGES = 4
# However slow they are, a worker spends this long moving its weights onto huge pages: every
# step reads all of them (the small model's 250 MB take 1.5-3 s on the slow VM).
WEIGHTS_BUDGET_S = 10.0

# An address range: (first byte, length in bytes).
Extent = tuple[int, int]


def thp_mode(sysfs: Path = SYSFS) -> str:
    """The kernel's transparent-huge-page mode: always, madvise or never; "" where there is
    no such setting (not Linux, or a kernel built without them)."""
    try:
        text = (sysfs / "enabled").read_text()
    except OSError:
        return ""
    chosen = re.search(r"\[(\w+)\]", text)
    return chosen.group(1) if chosen else ""


def huge_page_bytes(sysfs: Path = SYSFS) -> int:
    """The size of a transparent huge page (2 MiB on x86-64, more on some arm64 kernels)."""
    try:
        return int((sysfs / "hpage_pmd_size").read_text())
    except (OSError, ValueError):
        return DEFAULT_HUGE_PAGE


@functools.cache
def available() -> bool:
    """Whether this process can ask for huge pages: Linux with THP on always or madvise."""
    return sys.platform == "linux" and thp_mode() in ("always", "madvise")


@functools.cache
def _madvise():
    libc = ctypes.CDLL(None, use_errno=True)
    call = libc.madvise
    call.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    call.restype = ctypes.c_int
    return call


def madvise(address: int, length: int, advice: int) -> int:
    """madvise(2); returns 0, or the errno it failed with."""
    if _madvise()(address, length, advice) == 0:
        return 0
    return ctypes.get_errno()


def _count(shape: Sequence[int]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def extent(tensor: torch.Tensor) -> Extent:
    """The bytes a CPU tensor's storage spans, oneDNN's opaque (packed) tensors included."""
    if tensor.is_mkldnn:
        return torch.ops.mkldnn.data_ptr(tensor), torch.ops.mkldnn._nbytes(tensor)
    storage = tensor.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


def model_extents(model: nn.Module) -> list[Extent]:
    """Where a CPU model's parameters, buffers and packed weights lie."""
    tensors = [*model.parameters(), *model.buffers()]
    tensors += [m.packed for m in model.modules() if getattr(m, "packed", None) is not None]
    extents = [extent(t) for t in tensors if t.device.type == "cpu"]
    return [(address, length) for address, length in extents if length > 0]


def page_runs(extents: Iterable[Extent], page: int) -> list[Extent]:
    """The huge pages the extents touch, as runs of whole pages (start, length), merged
    where they meet or overlap. A page shared with other memory is moved with it: that
    changes only which physical page holds those bytes."""
    runs: list[list[int]] = []
    for address, length in sorted(e for e in extents if e[1] > 0):
        first = address - address % page
        end = -(-(address + length) // page) * page
        if runs and first <= runs[-1][1]:
            runs[-1][1] = max(runs[-1][1], end)
        else:
            runs.append([first, end])
    return [(first, end - first) for first, end in runs]


@dataclasses.dataclass
class Backing:
    """What `HugePager.back` did: bytes advised, bytes moved onto huge pages, time taken."""

    advised: int = 0
    collapsed: int = 0
    seconds: float = 0.0
    # Why some pages stayed small (the errno's name, from the first failure), or "".
    note: str = ""


def errno_name(error: int) -> str:
    """EINVAL for 22, and so on."""
    return errno.errorcode.get(error, str(error))


def huge_bytes_in(extents: Iterable[Extent], smaps: Path = Path("/proc/self/smaps")) -> int:
    """How many bytes of the mappings that hold these extents sit on huge pages
    (AnonHugePages of each mapping touched, counted once): for logs and tests."""
    try:
        text = smaps.read_text()
    except OSError:
        return 0
    mappings = []
    for block in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", text):
        head = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", block)
        huge = re.search(r"AnonHugePages:\s+(\d+) kB", block)
        if head and huge:
            mappings.append((int(head.group(1), 16), int(head.group(2), 16), int(huge.group(1))))
    touched = set()
    for address, length in extents:
        for index, (low, high, _) in enumerate(mappings):
            if low < address + length and address < high:
                touched.add(index)
    return sum(mappings[index][2] for index in touched) << 10


class HugePager:
    """Puts memory on huge pages while that is cheap here, and leaves the rest to khugepaged.

    A huge page normally costs well under a millisecond to hand out (zeroing 2 MiB) or to
    move memory onto (copying it). On some virtual machines it costs tens: on the 2-core VM
    of benchmarks/README.md, 13-24 ms a page (12 s for a 1 GiB cache, at every start),
    while torch.zeros commits 1 GiB of small pages in 0.5 s. Its hypervisor takes back the
    guest's free memory (virtio-balloon free page reporting), which the guest reports in
    free blocks of huge-page size, so a new huge page most likely is memory the host must
    fault in again. So the pages are timed as they are placed (all of them: the first ones
    may come from a pool freed a moment ago), and once a few in a row cost more than
    `slow_page_s` each, the worker stops doing the work itself: memory still to be placed
    is only advised (khugepaged, the kernel's background thread, moves it over the
    following minutes), and a cache still to be committed is committed on small pages
    first and advised after, so that start-up takes about what it took without huge pages.

    One per worker start: conditions change between starts (pages freed a moment ago are
    cheap again). `advise` and `clock` are for tests.
    """

    def __init__(
        self,
        slow_page_s: float | None = None,
        probe_pages: int = PROBE_PAGES,
        advise=None,  # type: ignore[no-untyped-def]
        clock=time.perf_counter,  # type: ignore[no-untyped-def]
        page: int | None = None,
    ) -> None:
        self.slow_page_s = SLOW_PAGE_S if slow_page_s is None else slow_page_s
        self.advise = advise or madvise
        self.clock = clock
        self.page = page or huge_page_bytes()
        self.chunk_pages = probe_pages
        # The cost of each of the latest pages, and what they averaged once that was slow.
        self.recent: collections.deque[float] = collections.deque(maxlen=probe_pages)
        self.slow_s: float | None = None
        self.committed_huge = 0  # bytes `zeros` committed on huge pages

    @property
    def cheap(self) -> bool:
        """True until the latest `probe_pages` pages cost more than `slow_page_s` each on
        average (one slow page, a compaction say, decides nothing); then False for good."""
        return self.slow_s is None

    def _timed(self, address: int, length: int, advice: int) -> int:
        """madvise a range, timing it against the pages it covers; returns the errno."""
        began = self.clock()
        error = self.advise(address, length, advice)
        pages = -(-length // self.page)
        self.recent.extend([(self.clock() - began) / pages] * min(pages, self.chunk_pages))
        average = sum(self.recent) / len(self.recent)
        if len(self.recent) == self.recent.maxlen and average > self.slow_page_s:
            self.slow_s = average
        return error

    def back(self, extents: Iterable[Extent], budget_s: float = 0.0) -> Backing:
        """Move memory already in use onto huge pages (MADV_COLLAPSE, Linux 6.1) while they
        are cheap, or slow but within `budget_s` of starting, and advise all of it
        (MADV_HUGEPAGE) so that khugepaged finishes the rest.

        Best effort: a page the kernel cannot move (no free huge page, a kernel before 6.1,
        a page at the edge of a mapping) stays as it was, which is only slower.
        """
        done = Backing()
        if not available():
            return done
        start = self.clock()
        for first, length in page_runs(extents, self.page):
            # ENOMEM: the run reaches past its mapping (a heap's last page); the rest took it.
            error = self.advise(first, length, MADV_HUGEPAGE)
            if error not in (0, errno.ENOMEM):
                done.note = done.note or errno_name(error)
                continue
            done.advised += length
            for address in range(first, first + length, self.page):
                if not self.cheap and self.clock() - start >= budget_s:
                    break
                error = self._timed(address, self.page, MADV_COLLAPSE)
                if error == 0:
                    done.collapsed += self.page
                elif not done.note:
                    done.note = errno_name(error)
        if done.collapsed < done.advised and not self.cheap:
            done.note = done.note or self.slow_note()
        done.seconds = self.clock() - start
        return done

    def zeros(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A zero-filled CPU tensor on huge pages, committed now as torch.zeros would be.

        An anonymous private mapping, advised before its first touch, so its pages fault in
        as huge pages directly (no copy); the kernel hands them over zeroed. It is committed
        a few pages at a time, each timed: once huge pages turn out slow here, the rest is
        committed on small pages and advised after. The tensor keeps the mapping alive.
        Where huge pages are not available: torch.zeros.
        """
        nbytes = dtype.itemsize * _count(shape)
        if not available() or nbytes == 0:
            return torch.zeros(shape, dtype=dtype)
        # One page more than needed, so that the tensor can start on a huge-page boundary.
        mapping = mmap.mmap(-1, nbytes + self.page, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        raw = torch.frombuffer(mapping, dtype=torch.uint8)
        offset = -raw.data_ptr() % self.page
        tensor = raw[offset : offset + nbytes]
        done = 0
        while done < nbytes and self.cheap:
            length = min(self.chunk_pages * self.page, nbytes - done)
            self.advise(tensor.data_ptr() + done, length, MADV_HUGEPAGE)
            if self._timed(tensor.data_ptr() + done, length, MADV_POPULATE_WRITE) != 0:
                break  # a kernel before 5.14: the rest is touched below
            done += length
            self.committed_huge += length
        if done < nbytes:
            # Commit the rest on small pages (cheap: they are not advised yet), then advise
            # them for khugepaged. A cache that does not fit fails here, at start.
            rest = tensor[done:]
            if self.advise(rest.data_ptr(), rest.nbytes, MADV_POPULATE_WRITE) != 0:
                rest.zero_()  # a kernel before 5.14: touch every page
            self.advise(rest.data_ptr(), rest.nbytes, MADV_HUGEPAGE)
        return tensor.view(dtype).view(tuple(shape))

    def slow_note(self) -> str:
        """Why the rest was left to khugepaged."""
        return (
            f"huge pages cost {1e3 * (self.slow_s or 0.0):.0f} ms each here, "
            "so khugepaged moves the rest in the background"
        )
