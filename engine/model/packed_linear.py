"""bf16 linear weights kept in oneDNN's blocked layout on CPU.

`F.linear` on a CPU bf16 weight hands oneDNN a plain [out, in] matrix, which it reorders into
its blocked layout on every call: at decode batch sizes that copy costs about as much as the
product itself. Reordering once, after loading, makes the matmuls of a 64-token decode step
1.2-1.3x faster and of a single-token one 2-4x, with bitwise the same results: oneDNN runs
the same kernel on the same blocks, only the per-call copy is gone. (On 2 cores with
avx512_bf16: [64, 768] x [768, 2048] 0.62 -> 0.49 ms; a 32000 x 768 LM head for one token
3.07 -> 0.76 ms.)
The packed tensor replaces the weight, so memory does not grow. (fp32 linears go through a
different library on CPU, whose packed form does not give identical results: left as is.)

In compiled graphs the packed product is an op of its own, which torch.compile treats as a
black box with a known shape, as inductor cannot lower oneDNN's op on a weight that is not a
constant of the graph: `tidegate_linear::packed_linear`, defined in C++ (packed_linear.cpp,
built on first use like the attention kernels), or where that cannot be built, the Python
custom op `tidegate::packed_linear`, about 12 us a call slower.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch
from torch import nn

logger = logging.getLogger(__name__)

PACKED_DTYPES = (torch.bfloat16,)


def can_pack(weight: torch.Tensor) -> bool:
    """Whether `weight` is a CPU bf16 matrix that oneDNN can pack on this machine."""
    return (
        weight.device.type == "cpu"
        and weight.dtype in PACKED_DTYPES
        and weight.dim() == 2
        and cpu_packs_bf16()
    )


@functools.cache
def cpu_packs_bf16() -> bool:
    """True when this torch has oneDNN's packed linear and this CPU runs its bf16 path.

    oneDNN's bf16 kernels need AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT; an AVX2-only CPU
    (many AMD EPYC and older Xeon hosts) refuses to pack, and bf16 linears stay plain there.
    """
    mkldnn = torch.ops.mkldnn
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(mkldnn, "_reorder_linear_weight")
        and hasattr(mkldnn, "_is_mkldnn_bf16_supported")
        and bool(mkldnn._is_mkldnn_bf16_supported())
    )


CPP_SOURCE = Path(__file__).with_name("packed_linear.cpp")
# Whether the C++ op is loaded: a plain global, which torch.compile reads as a constant.
_cpp_op_loaded = False


@functools.cache
def load_cpp_packed_linear() -> bool:
    """Build (first time only) and load the C++ op; False where it cannot be built here."""
    global _cpp_op_loaded
    from tidegate.engine.attention.cpu_attention import (
        CpuKernelUnavailable,
        build_cpu_extension,
        cpu_kernel_isa,
    )

    try:
        build_cpu_extension(CPP_SOURCE, "tidegate_linear", cpu_kernel_isa())
    except CpuKernelUnavailable as error:
        logger.info("packed linears go through a Python op (%s)", error)
        return False

    @torch.library.register_fake("tidegate_linear::packed_linear")
    def _(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return x.new_empty((*x.shape[:-1], packed.shape[0]))

    _cpp_op_loaded = True
    return True


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W.T + bias, with W packed by `pack`."""
    if torch.compiler.is_compiling():
        if _cpp_op_loaded:
            return torch.ops.tidegate_linear.packed_linear(x, packed, bias)
        return torch.ops.tidegate.packed_linear(x, packed, bias)
    # Eagerly, oneDNN's op directly: a custom op's Python dispatch costs ~20 us a call.
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@torch.library.custom_op("tidegate::packed_linear", mutates_args=())
def _packed_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@_packed_linear.register_fake
def _(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], packed.shape[0]))


def pack(weight: torch.Tensor) -> torch.Tensor:
    """The [out, in] weight in oneDNN's layout (an opaque mkldnn tensor of the same shape)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach())


def pack_linear_weights(model: nn.Module) -> int:
    """Pack the weight of every module that has a `packed` slot, if it can; returns how many.

    A weight shared with another module (an LM head tied to the embedding, which needs the
    plain table for lookups) is left plain: packing it would keep two copies.
    """
    owners: dict[int, int] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            owners[id(param)] = owners.get(id(param), 0) + 1
    count = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if not hasattr(module, "packed") or weight is None or not can_pack(weight):
            continue
        if owners[id(weight)] > 1:
            continue
        module.packed = pack(weight)
        load_cpp_packed_linear()
        # The plain weight goes: the packed one is the only copy.
        module.weight = None
        count += 1
    return count
