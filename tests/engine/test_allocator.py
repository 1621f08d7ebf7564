"""Engine cores on CPU are spawned with tcmalloc where the machine has it, else glibc's malloc."""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

import pytest

from tidegate.engine import allocator
from tidegate.engine.allocator import (
    allocator_in_use,
    child_environment,
    find_tcmalloc,
    preload_for,
    runs_on_cpu,
)


@pytest.fixture
def lib_dir(tmp_path: Path) -> Path:
    """A library folder holding a (fake) tcmalloc; only its path is ever used."""
    (tmp_path / "libtcmalloc_minimal.so.4").write_bytes(b"")
    return tmp_path


def test_finds_the_minimal_library_first_and_the_full_one_otherwise(tmp_path: Path) -> None:
    full, minimal = tmp_path / "full", tmp_path / "minimal"
    full.mkdir()
    minimal.mkdir()
    (full / "libtcmalloc.so.4").write_bytes(b"")
    assert find_tcmalloc([str(full)]) == str(full / "libtcmalloc.so.4")
    (minimal / "libtcmalloc_minimal.so.4").write_bytes(b"")
    assert find_tcmalloc([str(full), str(minimal)]) == str(minimal / "libtcmalloc_minimal.so.4")
    assert find_tcmalloc([str(tmp_path / "none")]) is None


def test_auto_preloads_tcmalloc_on_cpu_before_what_was_preloaded(lib_dir: Path) -> None:
    path = str(lib_dir / "libtcmalloc_minimal.so.4")
    assert preload_for("auto", "cpu", "", [str(lib_dir)]) == path
    assert preload_for("tcmalloc", "cpu", "/opt/libfoo.so", [str(lib_dir)]) == (
        f"{path}:/opt/libfoo.so"
    )


def test_the_system_malloc_a_gpu_or_a_users_malloc_leave_ld_preload_alone(lib_dir: Path) -> None:
    dirs = [str(lib_dir)]
    assert preload_for("system", "cpu", "", dirs) is None
    assert preload_for("auto", "cuda", "", dirs) is None
    assert preload_for("auto", "cpu", "/usr/lib/libjemalloc.so.2", dirs) is None
    # Asked for by name, tcmalloc is used on a GPU host too.
    assert preload_for("tcmalloc", "cuda", "", dirs) == str(lib_dir / "libtcmalloc_minimal.so.4")


def test_without_the_library_auto_falls_back_and_tcmalloc_says_how_to_install_it(
    tmp_path: Path,
) -> None:
    assert preload_for("auto", "cpu", "", [str(tmp_path)]) is None
    with pytest.raises(ValueError, match="apt-get install libtcmalloc-minimal4"):
        preload_for("tcmalloc", "cpu", "", [str(tmp_path)])


def test_auto_device_is_cpu_unless_a_gpu_is_visible(monkeypatch: pytest.MonkeyPatch) -> None:
    assert runs_on_cpu("cpu") and not runs_on_cpu("cuda")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert runs_on_cpu("auto")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert runs_on_cpu("auto") == (not Path("/dev/nvidiactl").exists())


def test_the_preload_lasts_only_for_the_spawn(
    lib_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(allocator, "LIBRARY_DIRS", (str(lib_dir),))
    monkeypatch.setenv("LD_PRELOAD", "/opt/libfoo.so")
    with child_environment("auto", "cpu"):
        assert os.environ["LD_PRELOAD"] == f"{lib_dir}/libtcmalloc_minimal.so.4:/opt/libfoo.so"
    assert os.environ["LD_PRELOAD"] == "/opt/libfoo.so"
    monkeypatch.delenv("LD_PRELOAD")
    with child_environment("auto", "cpu"):
        assert "LD_PRELOAD" in os.environ
    assert "LD_PRELOAD" not in os.environ


def test_reads_the_malloc_from_the_process_maps(tmp_path: Path) -> None:
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f01 r-xp 0 08:01 1 /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4\n")
    assert allocator_in_use(str(maps)) == "tcmalloc"
    maps.write_text("7f00-7f01 r-xp 0 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6\n")
    assert allocator_in_use(str(maps)) == "system"
    assert allocator_in_use(str(tmp_path / "missing")) == "system"


def _report_malloc(queue: multiprocessing.Queue) -> None:
    queue.put(allocator_in_use())


def spawn_and_report(name: str) -> str:
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    with child_environment(name, "cpu"):
        child = ctx.Process(target=_report_malloc, args=(queue,))
        child.start()
    try:
        return queue.get(timeout=60)
    finally:
        child.join(timeout=30)


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/<pid>/maps")
def test_a_spawned_engine_process_runs_on_tcmalloc_where_the_machine_has_it() -> None:
    # Real processes: the child maps the library the parent's environment named. Machines
    # without libtcmalloc-minimal4 (the library is an OS package) spawn on glibc's malloc.
    expected = "tcmalloc" if find_tcmalloc() else "system"
    assert spawn_and_report("auto") == expected
    assert spawn_and_report("system") == "system"
