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

Row splits. oneDNN's choice of threads depends on the product's shape, and for some row
counts it leaves one of the cores idle: on a 2-core Xeon with AMX, 512 rows through the
small model's down projection (768 x 2048) took 1.1 ms, as long as on one thread, while two
products of 256 rows took 0.29 ms each. Which row counts suffer differs by weight shape and
by machine, so `plan_row_splits` measures it once per weight shape, when the weights are
packed, and the C++ op runs the row counts that measured faster in pieces as pieces (a
512-token prefill of the small model 83 -> 76 ms, benchmarks/README.md).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterable
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
    if _cpp_op_loaded:
        # Compiled or eager: the C++ op, which applies the row splits.
        return torch.ops.tidegate_linear.packed_linear(x, packed, bias)
    if torch.compiler.is_compiling():
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


def pack_linear_weights(model: nn.Module, max_rows: int = 0) -> int:
    """Pack the weight of every module that has a `packed` slot, if it can; returns how many.

    A weight shared with another module (an LM head tied to the embedding, which needs the
    plain table for lookups) is left plain: packing it would keep two copies. With
    `max_rows` (the most tokens of a step), the row splits of each new weight shape are
    measured up to that many rows (`plan_row_splits`).
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
        # The plain weight goes: the packed one is the only copy.
        module.weight = None
        count += 1
    if count and load_cpp_packed_linear() and max_rows:
        start = time.perf_counter()
        packed = {tuple(m.packed.shape): m.packed for m in model.modules() if _is_packed(m)}
        plans = {}
        for (out_features, in_features), weight in packed.items():
            if (out_features, in_features, max_rows) not in _planned:
                plans[out_features, in_features] = plan = plan_row_splits(weight, max_rows)
                set_row_split(out_features, in_features, plan)
                _planned.add((out_features, in_features, max_rows))
        if plans:
            logger.info(
                "linear row splits measured in %.2f s (out x in: [(from rows, piece rows)]): %s",
                time.perf_counter() - start,
                "; ".join(f"{o}x{i}: {plan}" for (o, i), plan in plans.items()),
            )
    return count


def _is_packed(module: nn.Module) -> bool:
    return getattr(module, "packed", None) is not None


# Row counts the plans are measured at; between two, the lower one's choice holds.
PLAN_ROWS = (256, 320, 384, 448, 512, 640, 768, 1024, 1280, 1536, 2048, 3072, 4096, 6144, 8192)
PIECE_ROWS = 256  # the size of a piece (the fastest of 128, 256 and 384 for every shape)
# A split must be this much faster where measured, so that noise does not decide.
SPLIT_MARGIN = 0.8
# Shapes measured in this process, with the row limit: every engine of a process shares them.
_planned: set[tuple[int, int, int]] = set()


def plan_row_splits(
    packed: torch.Tensor,
    max_rows: int,
    budget_s: float = 0.3,
    timer: Callable[[Callable[[], object]], float] | None = None,
) -> list[tuple[int, int]]:
    """Measure where products with `packed` are faster in pieces; returns the plan for
    `set_row_split`: (from rows, piece rows) pairs, piece 0 meaning whole.

    Each row count of PLAN_ROWS up to `max_rows` runs whole and in pieces of PIECE_ROWS, and
    the faster (by SPLIT_MARGIN) decides; the measuring stops after `budget_s` (large weights
    keep the cores busy at any row count). `max_rows` itself, a full step's product (every
    step of a long prefill), is always measured: were the budget to stop the sweep short of
    it, the last choice measured would hold for every larger product (the small model's down
    projection measured up to 448 rows, where pieces win, and ran 2,048-row steps in eight
    pieces: 4.8 ms against 3.8 whole). `timer` is for tests.
    """
    out_features, in_features = packed.shape
    timer = timer or _fastest_seconds
    measured: dict[int, tuple[float, float]] = {}

    def measure(rows: int) -> None:
        run = functools.partial(
            torch.ops.tidegate_linear.packed_linear,
            torch.randn(rows, in_features, dtype=torch.bfloat16),
            packed,
            None,
        )
        set_row_split(out_features, in_features, [])
        whole = timer(run)
        set_row_split(out_features, in_features, [(0, PIECE_ROWS)])
        measured[rows] = (whole, timer(run))

    start = time.perf_counter()
    try:
        for rows in (r for r in PLAN_ROWS if PIECE_ROWS < r <= max_rows):
            measure(rows)
            if time.perf_counter() - start > budget_s:
                break
        if max_rows > PIECE_ROWS and max_rows not in measured:
            measure(max_rows)
    finally:
        set_row_split(out_features, in_features, [])
    return choose_row_splits(measured)


def choose_row_splits(measured: dict[int, tuple[float, float]]) -> list[tuple[int, int]]:
    """The plan from (whole, in pieces) times per row count: pieces from each row count
    where they were faster by SPLIT_MARGIN, whole again from the next one where not."""
    plan: list[tuple[int, int]] = []
    for rows in sorted(measured):
        whole, pieces = measured[rows]
        piece = PIECE_ROWS if pieces < SPLIT_MARGIN * whole else 0
        if (plan[-1][1] if plan else 0) != piece:
            plan.append((rows, piece))
    return plan


def set_row_split(out_features: int, in_features: int, plan: Iterable[tuple[int, int]]) -> None:
    """Tell the C++ op how to split products with weights of this shape."""
    plan = list(plan)
    torch.ops.tidegate_linear.set_row_split(
        out_features, in_features, [rows for rows, _ in plan], [piece for _, piece in plan]
    )


def _fastest_seconds(run: Callable[[], object], repeats: int = 5) -> float:
    """The fastest of `repeats` runs: noise (another process, an interrupt) only slows."""
    run()  # oneDNN builds the primitive of a new shape on its first call
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        samples.append(time.perf_counter() - start)
    return min(samples)
