"""The weights and the KV cache of a CPU engine on transparent huge pages."""

from __future__ import annotations

import pytest
import torch

from tidegate.engine import LLM, SamplingParams, huge_pages
from tidegate.engine.model.packed_linear import can_pack, pack

MIB = 1 << 20
needs_thp = pytest.mark.skipif(
    not huge_pages.available(), reason="this kernel offers no transparent huge pages"
)


@pytest.mark.parametrize(
    ("text", "mode"),
    [
        ("always [madvise] never\n", "madvise"),
        ("[always] madvise never\n", "always"),
        ("always madvise [never]\n", "never"),
        ("", ""),
    ],
)
def test_the_kernel_mode_is_read_from_sysfs(tmp_path, text, mode):
    (tmp_path / "enabled").write_text(text)
    assert huge_pages.thp_mode(tmp_path) == mode


def test_without_sysfs_there_are_no_huge_pages_and_the_size_falls_back(tmp_path):
    assert huge_pages.thp_mode(tmp_path / "absent") == ""
    assert huge_pages.huge_page_bytes(tmp_path / "absent") == 2 * MIB
    (tmp_path / "hpage_pmd_size").write_text("524288\n")
    assert huge_pages.huge_page_bytes(tmp_path) == 512 << 10


def test_extents_become_runs_of_whole_pages_merged_where_they_meet():
    page = 2 * MIB
    extents = [
        (10 * page + 100, 50),  # inside one page
        (10 * page + 4000, page),  # into the next: joins the first run
        (12 * page, 10),  # the page right after: joins too
        (20 * page - 1, 2),  # straddles a boundary, far away: a run of its own
        (30 * page, 0),  # empty: nothing
    ]
    assert huge_pages.page_runs(extents, page) == [(10 * page, 3 * page), (19 * page, 2 * page)]
    assert huge_pages.page_runs([], page) == []


def test_zeros_falls_back_to_torch_where_the_kernel_offers_none(monkeypatch):
    monkeypatch.setattr(huge_pages, "available", lambda: False)
    pager = huge_pages.HugePager()
    cache = pager.zeros((4, 16, 8), torch.bfloat16)
    assert cache.shape == (4, 16, 8) and cache.dtype == torch.bfloat16
    assert not cache.any()
    assert pager.back([huge_pages.extent(cache)]).advised == 0


@needs_thp
def test_zeros_are_zero_writable_aligned_and_on_huge_pages():
    page = huge_pages.huge_page_bytes()
    # However slow huge pages are here (HugePager's pacing is tested with a fake kernel).
    cache = huge_pages.HugePager(slow_page_s=10.0).zeros((3, 1024, 1024), torch.float32)
    assert cache.shape == (3, 1024, 1024) and cache.is_contiguous()
    assert cache.data_ptr() % page == 0
    assert not cache.any()
    cache[1, 7, 9] = 5.0
    assert cache.sum().item() == 5.0
    assert huge_pages.huge_bytes_in([(cache.data_ptr(), cache.nbytes)]) >= 4 * page
    # An empty tensor needs no mapping.
    assert huge_pages.HugePager().zeros((0, 8), torch.float32).shape == (0, 8)


@needs_thp
def test_memory_in_use_moves_onto_huge_pages_and_keeps_its_bytes():
    page = huge_pages.huge_page_bytes()
    weight = torch.randn(3000, 2000)  # 24 MB from malloc, on 4 KiB pages
    before = weight.clone()
    where = huge_pages.extent(weight)
    backed = huge_pages.HugePager(slow_page_s=10.0).back([where])
    assert backed.advised >= where[1]
    assert backed.collapsed >= where[1] - 2 * page, backed.note  # all but the edges at worst
    assert huge_pages.huge_bytes_in([where]) >= backed.collapsed
    assert torch.equal(weight, before)


@needs_thp
@pytest.mark.skipif(not can_pack(torch.zeros(1, 1, dtype=torch.bfloat16)), reason="no oneDNN bf16")
def test_a_packed_weight_moves_and_computes_the_same():
    plain = torch.randn(2048, 1024, dtype=torch.bfloat16)
    packed = pack(plain)
    x = torch.randn(64, 1024, dtype=torch.bfloat16)
    expected = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    where = huge_pages.extent(packed)
    assert where[1] == plain.nbytes
    assert huge_pages.HugePager(slow_page_s=10.0).back([where]).collapsed > 0
    assert huge_pages.huge_bytes_in([where]) > 0
    assert torch.equal(
        torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""), expected
    )


class FakeKernel:
    """madvise and a clock stood in for: each huge page collapsed or committed takes
    `page_s`, and every call is recorded (advice, first page, pages)."""

    PAGE = 2 * MIB

    def __init__(self, page_s: float, cheap_pages: int = 0) -> None:
        self.page_s = page_s
        self.cheap_pages = cheap_pages  # the first pages placed cost 0.5 ms (a pool just freed)
        self.placed = 0
        self.now = 0.0
        self.calls: list[tuple[int, int, int]] = []

    def clock(self) -> float:
        return self.now

    def advise(self, address: int, length: int, advice: int) -> int:
        if advice in (huge_pages.MADV_COLLAPSE, huge_pages.MADV_POPULATE_WRITE):
            pages = -(-length // self.PAGE)
            cost = 0.0005 if self.placed < self.cheap_pages else self.page_s
            self.now += cost * pages
            self.placed += pages
        self.calls.append((advice, address // self.PAGE, -(-length // self.PAGE)))
        return 0

    def pager(self) -> huge_pages.HugePager:
        return huge_pages.HugePager(advise=self.advise, clock=self.clock, page=self.PAGE)

    def of(self, advice: int) -> list[tuple[int, int]]:
        return [(first, pages) for kind, first, pages in self.calls if kind == advice]


@pytest.fixture
def thp_on(monkeypatch):
    monkeypatch.setattr(huge_pages, "available", lambda: True)


def test_where_huge_pages_are_cheap_all_memory_moves_and_the_cache_is_born_on_them(thp_on):
    kernel = FakeKernel(page_s=0.0005)
    pager = kernel.pager()
    backed = pager.back([(10 * kernel.PAGE, 20 * kernel.PAGE)])
    assert backed.collapsed == backed.advised == 20 * kernel.PAGE and not backed.note
    assert kernel.of(huge_pages.MADV_COLLAPSE) == [(10 + i, 1) for i in range(20)]

    kernel.calls.clear()
    cache = pager.zeros((9 * kernel.PAGE + 100,), torch.uint8)  # 10 pages, the last one part
    assert cache.numel() == 9 * kernel.PAGE + 100 and not cache.any()
    first = cache.data_ptr() // kernel.PAGE
    # Committed four pages at a time, each chunk advised first, so it faulted in huge.
    chunks = [(first, 4), (first + 4, 4), (first + 8, 2)]
    assert kernel.calls == [
        call
        for chunk in chunks
        for call in ((huge_pages.MADV_HUGEPAGE, *chunk), (huge_pages.MADV_POPULATE_WRITE, *chunk))
    ]
    assert pager.committed_huge == cache.nbytes and pager.cheap


def test_where_huge_pages_are_slow_the_start_leaves_them_to_khugepaged(thp_on):
    kernel = FakeKernel(page_s=0.024)  # the VM of benchmarks/README.md
    pager = kernel.pager()
    backed = pager.back([(10 * kernel.PAGE, 20 * kernel.PAGE), (100 * kernel.PAGE, 5)])
    # Four pages timed, then no more moved; all of it advised for khugepaged.
    assert kernel.of(huge_pages.MADV_COLLAPSE) == [(10 + i, 1) for i in range(4)]
    assert backed.collapsed == 4 * kernel.PAGE and backed.advised == 21 * kernel.PAGE
    assert "24 ms each" in backed.note and not pager.cheap

    # Weights get a budget of time however slow: pages go on until 0.3 s have passed.
    more = kernel.pager().back([(10 * kernel.PAGE, 40 * kernel.PAGE)], budget_s=0.3)
    assert more.collapsed == 13 * kernel.PAGE  # the thirteenth starts at 0.288 s
    assert 0.3 <= more.seconds < 0.3 + 0.024 and "24 ms each" in more.note

    kernel.calls.clear()
    cache = pager.zeros((6 * kernel.PAGE,), torch.uint8)
    first = cache.data_ptr() // kernel.PAGE
    # Committed on small pages first (not yet advised), then advised.
    assert kernel.calls == [
        (huge_pages.MADV_POPULATE_WRITE, first, 6),
        (huge_pages.MADV_HUGEPAGE, first, 6),
    ]
    assert pager.committed_huge == 0 and not cache.any()


def test_a_cache_that_turns_out_slow_commits_the_rest_on_small_pages(thp_on):
    kernel = FakeKernel(page_s=0.024, cheap_pages=8)
    pager = kernel.pager()
    cache = pager.zeros((20 * kernel.PAGE,), torch.uint8)
    first = cache.data_ptr() // kernel.PAGE
    # Two cheap chunks, and the slow one that told, on huge pages; the rest on small ones.
    committed = kernel.of(huge_pages.MADV_POPULATE_WRITE)
    assert committed == [(first, 4), (first + 4, 4), (first + 8, 4), (first + 12, 8)]
    assert kernel.calls[-1] == (huge_pages.MADV_HUGEPAGE, first + 12, 8)
    assert pager.committed_huge == 12 * kernel.PAGE and not pager.cheap


def _runner(llm: LLM):
    return llm.engine.executor.worker.runner


@needs_thp
def test_an_engine_keeps_weights_and_cache_on_huge_pages_with_the_same_tokens(
    tiny_llama_dir, monkeypatch
):
    """bf16, so that the linears are packed (oneDNN's memory) as in a served CPU engine."""
    monkeypatch.setattr(huge_pages, "SLOW_PAGE_S", 10.0)  # however slow they are here
    page = huge_pages.huge_page_bytes()
    prompts = [[5, 9, 33, 71, 2, 8, 101, 17] * 3, [44, 45, 46, 47]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    tokens = {}
    for huge in (False, True):
        llm = LLM(
            model=str(tiny_llama_dir),
            dtype="bfloat16",
            max_model_len=128,
            kv_cache_memory=64 * MIB,
            cpu_huge_pages=huge,
        )
        try:
            runner = _runner(llm)
            caches = [t for pair in runner.kv_caches for t in pair]
            on_huge = huge_pages.huge_bytes_in([(t.data_ptr(), t.nbytes) for t in caches])
            if huge:
                assert all(t.data_ptr() % page == 0 for t in caches)
                assert on_huge >= sum(t.nbytes for t in caches) - len(caches) * page
                weights = huge_pages.model_extents(runner.model)
                assert huge_pages.huge_bytes_in(weights) > 0
            else:
                assert runner.huge_pager is None
            outputs = llm.generate(prompts, params)
            tokens[huge] = [o.outputs[0].token_ids for o in outputs]
        finally:
            llm.close()
    assert tokens[True] == tokens[False]
