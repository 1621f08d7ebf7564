"""The `cpu` attention backend: a C++ paged-attention kernel, compiled on first use.

The kernel (paged_attention.cpp, beside this file) reads each sequence's keys and values in place through
the block table, for decodes and prefill chunks alike, in one call per layer for the whole
flat batch; the torch backend instead copies every context out of the cache first. It is
built with torch's extension loader (ninja and a C++ compiler, which the CPU engine already
needs for inductor) for this machine's instruction set, and cached under
~/.cache/tidegate/cpu_kernels (or $TIDEGATE_CPU_KERNELS_DIR), so later processes only load it.

Its cache is not in the standard layout: each layer's k_cache and v_cache are
`[num_blocks, num_kv_heads, block_size, head_dim]` (`PackedKVLayout`), and within one block
and KV head the keys are stored transposed into words of two dims, `[block_size/16]
[head_dim/2][16][2]`, and the values in pairs of keys, `[block_size/16][8][head_dim][2]`
(the same order in every dtype). The cache holds the model's dtype, or FP8 (float8_e4m3fn,
`--kv-cache-dtype fp8`: a quarter of float32's bytes), which the kernel widens as it reads.
That is the order in which AMX tiles and AVX512_BF16 dot products (vdpbf16ps) take their
operands, so the decode kernel loads keys and values straight from the cache, with no
transposing or packing per step. KV transfer converts blocks to the standard layout and back.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from functools import cache
from pathlib import Path

import torch

from tidegate.engine.attention.backend import AttentionMetadata, KVLayout

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("paged_attention.cpp")
HEAD_SIZES = (32, 64, 80, 96, 128, 256)
KEY_CHUNK = 16  # a block size must be a multiple of this
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# What to compile for: the build machine's own ISA (default), or a fixed level for tests and
# for caches shared between different CPUs.
ISA_FLAGS = {
    "native": ["-march=native"],
    "avx512": ["-march=x86-64-v4"],
    "avx2": ["-march=x86-64-v3"],
}
_COMMON_FLAGS = [
    "-O3",
    # at::parallel_for is a header template over OpenMP: without -fopenmp it runs on one
    # thread. The libgomp it links is torch's own, already loaded (same soname).
    "-fopenmp",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-mprefer-vector-width=512",  # GCC otherwise keeps AVX-512 code to 256-bit vectors
]
_lock = threading.Lock()
# Longest chunk the kernel takes where the CPU has AMX: SDPA runs longer ones on oneDNN's
# tile kernels, 2.4-3.7x faster than the kernel on a Sapphire Rapids. Without AMX the kernel
# measured faster at every chunk length (an AVX-512 EPYC: 1.3x on 512 tokens after 2,048,
# 2.1x on a fresh 512-token prompt), so there it takes every chunk (benchmarks/README.md).
AMX_MAX_KERNEL_QUERY_LEN = 64


class CpuKernelUnavailable(RuntimeError):
    """The kernel cannot be built here (no compiler, no ninja, not x86-64)."""


def cpu_kernel_isa() -> str:
    isa = os.environ.get("TIDEGATE_CPU_ISA", "native")
    if isa not in ISA_FLAGS:
        raise ValueError(f"TIDEGATE_CPU_ISA={isa!r}; choose one of {', '.join(ISA_FLAGS)}")
    return isa


@cache
def load_cpu_kernels() -> None:
    """Build (first time only) and load the kernels for the ISA of `cpu_kernel_isa()`."""
    build_cpu_extension(SOURCE, "tidegate_cpu", cpu_kernel_isa())

    # What torch.compile traces layer_attention as: an opaque op with the query's shape.
    @torch.library.register_fake("tidegate_cpu::layer_attention")
    def _(query, key, value, layer, scale, sliding_window, logits_soft_cap=0.0):
        return torch.empty_like(query)


@cache
def build_cpu_extension(source: Path, prefix: str, isa: str) -> None:
    """Build (first time only, cached) and load a C++ file of torch ops for this ISA; other
    layers' kernels (engine/lora/lora_delta.cpp) are built the same way."""
    import platform

    if platform.machine() not in ("x86_64", "AMD64"):
        raise CpuKernelUnavailable(f"the CPU kernels target x86-64, not {platform.machine()}")
    try:
        import ninja  # noqa: F401  (torch's loader runs it)
        from torch.utils import cpp_extension
    except ImportError as error:
        raise CpuKernelUnavailable(f"building the CPU kernels needs {error.name}") from error
    name = f"{prefix}_{isa}_{_build_key(source, isa)}"
    build_dir = _cache_root() / name
    build_dir.mkdir(parents=True, exist_ok=True)
    with _lock:  # one build per process; torch's loader locks between processes
        try:
            cpp_extension.load(
                name=name,
                sources=[str(_source_copy(source, build_dir))],
                extra_cflags=[*_COMMON_FLAGS, *ISA_FLAGS[isa]],
                extra_ldflags=["-fopenmp"],
                build_directory=str(build_dir),
                is_python_module=False,
                verbose=False,
            )
        except (RuntimeError, OSError, FileNotFoundError) as error:
            raise CpuKernelUnavailable(f"building the CPU kernels failed: {error}") from error
    logger.debug("CPU kernels of %s loaded from %s", source.name, build_dir)


def cpu_kernels_available() -> bool:
    """Whether the kernels load here; the reason is logged once when they do not."""
    try:
        load_cpu_kernels()
    except CpuKernelUnavailable as error:
        _warn_once(str(error))
        return False
    return True


@cache
def _warn_once(reason: str) -> None:
    logger.warning("CPU attention kernels unavailable (%s); using the torch backend", reason)


def _cache_root() -> Path:
    root = os.environ.get("TIDEGATE_CPU_KERNELS_DIR")
    return Path(root) if root else Path.home() / ".cache" / "tidegate" / "cpu_kernels"


def _source_copy(source: Path, build_dir: Path) -> Path:
    """The source as the build folder keeps it, copied there once (the folder's name carries
    the source's hash). Ninja rebuilds when a source's path changes or its file is newer than
    the build: compiling the checkout's file rebuilt the kernels in every other checkout (a
    fresh clone for CI, a worktree) and after every git checkout that touched it, though the
    build key was the same."""
    copy = build_dir / source.name
    text = source.read_bytes()
    if not copy.is_file() or copy.read_bytes() != text:
        partial = build_dir / f".{source.name}.{os.getpid()}"
        partial.write_bytes(text)
        partial.replace(copy)  # atomic: a process building beside this one sees all of it
    return copy


def _build_key(source: Path, isa: str) -> str:
    """Source, compiler flags, torch version and (for `native`) this CPU's features: a
    change rebuilds."""
    digest = hashlib.sha256(source.read_bytes())
    digest.update(" ".join([*_COMMON_FLAGS, *ISA_FLAGS[isa]]).encode())
    digest.update(torch.__version__.encode())
    if isa == "native":
        digest.update(_cpu_flags().encode())
    return digest.hexdigest()[:12]


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    import platform

    return platform.processor()


def pack_kv(keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Standard blocks `[n, block_size, Hkv, D]` -> the packed layout `[n, Hkv, block_size, D]`.

    Per block and head, key t, dim d sits at `((t//16)*(D/2) + d//2)*32 + (t%16)*2 + d%2`,
    value t, dim d at `((t//16)*8 + (t%16)//2)*2D + d*2 + t%2`.
    """
    n, block_size, heads, dim = keys.shape
    chunks, pairs = block_size // KEY_CHUNK, KEY_CHUNK // 2
    k = keys.reshape(n, chunks, KEY_CHUNK, heads, dim // 2, 2).permute(0, 3, 1, 4, 2, 5)
    v = values.reshape(n, chunks, pairs, 2, heads, dim).permute(0, 4, 1, 2, 5, 3)
    return k.reshape(n, heads, block_size, dim), v.reshape(n, heads, block_size, dim)


def unpack_kv(keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed blocks `[n, Hkv, block_size, D]` -> standard `[n, block_size, Hkv, D]`."""
    n, heads, block_size, dim = keys.shape
    chunks, pairs = block_size // KEY_CHUNK, KEY_CHUNK // 2
    k = keys.reshape(n, heads, chunks, dim // 2, KEY_CHUNK, 2).permute(0, 2, 4, 1, 3, 5)
    v = values.reshape(n, heads, chunks, pairs, dim, 2).permute(0, 2, 3, 5, 1, 4)
    return k.reshape(n, block_size, heads, dim), v.reshape(n, block_size, heads, dim)


class PackedKVLayout(KVLayout):
    """The cpu backend's cache layout (module docstring): keys transposed into pairs of
    dims, values into pairs of keys, per (block, KV head)."""

    name = "cpu-packed"

    def shape(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
    ) -> tuple[int, ...]:
        if block_size % KEY_CHUNK or head_dim % 2:
            raise ValueError(
                f"the packed KV layout needs a block size that is a multiple of {KEY_CHUNK} "
                f"and an even head size, not {block_size} and {head_dim}"
            )
        return (num_blocks, num_kv_heads, block_size, head_dim)

    def to_standard(
        self, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return unpack_kv(keys, values)

    def from_standard(
        self, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return pack_kv(keys, values)


PACKED_KV_LAYOUT = PackedKVLayout()


def default_max_kernel_query_len() -> int:
    """The longest chunk the kernel takes on this CPU (0: every chunk)."""
    return AMX_MAX_KERNEL_QUERY_LEN if "amx_bf16" in _cpu_flags().split() else 0


class CpuAttentionBackend:
    """Paged attention for mixed prefill/decode batches with the C++ kernel.

    Decodes and chunks go to the kernel, the whole batch in one call. Where the CPU has AMX,
    a chunk longer than `max_kernel_query_len` is compute-bound and oneDNN's tile kernels run
    it faster than the kernel's vector loops (benchmarks/cpu_attention.py): in bf16 as flash
    attention on brgemm straight from the packed tiles, in other dtypes as SDPA over its
    context gathered into the standard order (paged_attention.cpp, attend_long_chunks).
    `max_kernel_query_len` 0 sends every chunk to the kernel. So does a call with a sliding
    window or a soft cap: the oneDNN and SDPA paths have neither, and both are per call (per
    layer), so one backend serves windowed and full layers alike.

    The caches are in the packed layout (`kv_layout`, module docstring) that the kernel reads.
    """

    name = "cpu"
    cuda_graph_safe = False  # a CPU backend: there are no CUDA graphs to capture
    kv_layout = PACKED_KV_LAYOUT

    def __init__(self, max_kernel_query_len: int | None = None) -> None:
        load_cpu_kernels()
        if max_kernel_query_len is None:
            max_kernel_query_len = default_max_kernel_query_len()
        self.max_kernel_query_len = max_kernel_query_len

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> None:
        """Store each token's key/value at its slot; tokens with a negative slot are skipped."""
        torch.ops.tidegate_cpu.reshape_and_cache(
            key, value, k_cache, v_cache, meta.slot_mapping[: meta.num_tokens]
        )

    def attend(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        softmax_scale: float,
        sliding_window: int = 0,
        logits_soft_cap: float = 0.0,
    ) -> torch.Tensor:
        """Causal attention of each new token over its sequence's cached keys (only the last
        `sliding_window` of them, itself included, when > 0; scores capped at
        `logits_soft_cap` when > 0)."""
        # The long-chunk paths have no window and no cap: the op sends such a call's chunks
        # all to the kernel.
        return torch.ops.tidegate_cpu.attend(
            query,
            k_cache,
            v_cache,
            meta.query_start_loc_cpu[: meta.num_seqs + 1],
            meta.seq_lens_cpu[: meta.num_seqs],
            meta.block_table[: meta.num_seqs],
            meta.num_tokens,
            softmax_scale,
            sliding_window,
            logits_soft_cap,
            self.max_kernel_query_len,
        )

    # -- The compiled path: one C++ op per layer (custom_op.attention_context) -----------

    @property
    def layer_op(self):
        """write_kv then attend for one layer, in C++, over the step set by begin_step:
        (query, key, value, layer, scale, sliding_window, logits_soft_cap) -> out."""
        return torch.ops.tidegate_cpu.layer_attention

    def begin_step(
        self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata
    ) -> None:
        """Hand the step's caches and metadata to the C++ side for `layer_op`."""
        torch.ops.tidegate_cpu.begin_step(
            [k for k, _ in kv_caches],
            [v for _, v in kv_caches],
            meta.query_start_loc_cpu[: meta.num_seqs + 1],
            meta.seq_lens_cpu[: meta.num_seqs],
            meta.block_table[: meta.num_seqs],
            meta.slot_mapping[: meta.num_tokens],
            self.max_kernel_query_len,
        )

    def end_step(self) -> None:
        torch.ops.tidegate_cpu.end_step()
