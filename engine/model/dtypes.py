"""The dtype `--dtype auto` runs a model in: the checkpoint's, except where the CPU emulates it.

On x86, bf16 matmuls are native only with AVX512_BF16 or AMX, fp16 ones with AVX512_FP16 or
AMX-FP16. Without them oneDNN converts on the fly: on a 2-core Ice Lake Xeon (AVX-512 and
VNNI, no AVX512_BF16) a bf16 [2048, 768] x [768, 2048] matmul ran at 61 GFLOP/s against
fp32's 324, and the small model's offline throughput in bf16 was a third of fp32's
(benchmarks/README.md, "dtype on CPUs without bf16"). Many cloud CPUs are such (Skylake,
Cascade Lake and Ice Lake Xeons, AMD before Zen 4). There `auto` upcasts a 16-bit
checkpoint to float32, exactly (every bf16 and fp16 value is a float32 value), when twice
its weights and the KV cache fit in the memory this process may use, with room to spare;
else it keeps the checkpoint's dtype and the log says why. An explicit --dtype is always
taken as given.
"""

from __future__ import annotations

import logging
import os
import platform
from pathlib import Path
from typing import TYPE_CHECKING

from tidegate.engine.model.config import checkpoint_files

if TYPE_CHECKING:
    from tidegate.engine.config import EngineArgs
    from tidegate.engine.model.config import ModelConfig

logger = logging.getLogger(__name__)

# A 16-bit dtype -> the x86 CPU flags (any one) that compute it natively.
NATIVE_FLAGS = {
    "bfloat16": ("avx512_bf16", "amx_bf16"),
    "float16": ("avx512_fp16", "amx_fp16"),
}
# Upcast only when the float32 weights and the KV cache take at most this share of the
# memory available: the rest is activations, the tokenizer, the API server, the page cache.
FLOAT32_MEMORY_SHARE = 0.6


def auto_dtype(
    checkpoint_dtype: str | None,
    device_type: str,
    weight_bytes: int,
    kv_cache_bytes: int,
    cpu_flags: frozenset[str] | None = None,
    available_memory: int | None = None,
) -> tuple[str, str | None]:
    """(dtype, why it is not the checkpoint's or None) for --dtype auto.

    `weight_bytes`: the checkpoint's weights as stored (16-bit), times the copies the machine
    holds; `kv_cache_bytes`: the KV caches in float32; `cpu_flags` and `available_memory` are
    read from the machine unless given.
    """
    dtype = checkpoint_dtype or "float32"
    if device_type != "cpu" or dtype not in NATIVE_FLAGS:
        return dtype, None
    flags = cpu_x86_flags() if cpu_flags is None else cpu_flags
    if not flags or any(flag in flags for flag in NATIVE_FLAGS[dtype]):
        return dtype, None  # not x86 (or unknown), or native: the checkpoint's dtype
    native = " or ".join(f.upper() for f in NATIVE_FLAGS[dtype])
    memory = available_memory_bytes() if available_memory is None else available_memory
    need = 2 * weight_bytes + kv_cache_bytes
    if memory is not None and need > FLOAT32_MEMORY_SHARE * memory:
        return dtype, (
            f"this CPU has no {native}, so {dtype} matmuls are emulated (several times slower "
            f"than float32), but float32 weights and KV cache ({need / 2**30:.1f} GiB) do not "
            f"fit in {FLOAT32_MEMORY_SHARE:.0%} of the {memory / 2**30:.1f} GiB available: "
            f"running in {dtype}"
        )
    return "float32", (
        f"the checkpoint is {dtype}, but this CPU has no {native}, so {dtype} matmuls would be "
        "emulated (several times slower than float32): running in float32 (exact; the weights "
        "take twice the memory). Pass --dtype to choose"
    )


def with_auto_dtype(args: EngineArgs, model_config: ModelConfig) -> EngineArgs:
    """`args` with --dtype auto replaced by the dtype `auto_dtype` picks (logged when it is
    not the checkpoint's); other dtypes as given."""
    if args.dtype != "auto":
        return args
    if (model_config.torch_dtype or "float32") not in NATIVE_FLAGS:
        # Nothing to judge: no device lookup (nor torch import) in this process.
        return args.model_copy(update={"dtype": model_config.torch_dtype or "float32"})
    from tidegate.engine.config import DEFAULT_KV_CACHE_MEMORY
    from tidegate.engine.device import runs_on_cpu

    if args.num_gpu_blocks is not None:
        per_token = 2 * model_config.num_hidden_layers * model_config.num_key_value_heads
        kv_bytes = args.num_gpu_blocks * args.block_size * per_token * model_config.head_dim * 4
    else:
        kv_bytes = args.kv_cache_memory or DEFAULT_KV_CACHE_MEMORY
    copies = args.data_parallel_size_local  # each engine core of the pod loads the weights
    stored = checkpoint_bytes(args.model)
    if model_config.fp8 is not None and args.quantization != "fp8":
        stored *= 2  # an FP8 checkpoint is multiplied out to 16 bits or more as it loads
    dtype, why = auto_dtype(
        model_config.torch_dtype,
        "cpu" if runs_on_cpu(args.device) else "cuda",
        copies * stored,
        copies * kv_bytes,
    )
    if why is not None:
        (logger.info if dtype == "float32" else logger.warning)("dtype auto: %s", why)
    return args.model_copy(update={"dtype": dtype})


def cpu_x86_flags() -> frozenset[str]:
    """This x86 CPU's feature flags from /proc/cpuinfo; empty elsewhere or if unreadable."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return frozenset()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def available_memory_bytes() -> int | None:
    """Memory this process may still take: the host's MemAvailable, capped by what its
    cgroup's limit leaves (a pod's memory limit); None if neither can be read."""
    candidates = []
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    candidates.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    cgroup = Path("/sys/fs/cgroup")
    try:
        limit = (cgroup / "memory.max").read_text().strip()
        if limit != "max":
            used = int((cgroup / "memory.current").read_text())
            candidates.append(max(0, int(limit) - used))
    except (OSError, ValueError):
        pass
    return min(candidates) if candidates else None


def checkpoint_bytes(model_dir: str | os.PathLike[str]) -> int:
    """Bytes of the files the loader reads the folder's weights from (as stored)."""
    return sum((Path(model_dir) / name).stat().st_size for name in checkpoint_files(model_dir))
