"""Compiled and captured execution: torch.compile of the model, CUDA graphs for decode steps.

Levels (`--compilation-level`, vLLM's numbering):

- 0: eager, as `--enforce-eager`.
- 1: `torch.compile` (inductor) of `LlamaModel`: embedding, every decoder layer and the final
  norm in one graph. Attention stays outside it as an opaque op (attention/custom_op.py), so
  paged attention keeps its per-step metadata. The token dimension is dynamic: one graph
  serves every batch of two or more tokens, and a second one the single-token batch (torch
  specialises sizes 0 and 1), so batch-size changes never recompile beyond those two.
- 2: level 1 plus CUDA graphs for decode-only steps (cuda_graphs.py), on CUDA with an
  attention backend that reads no host copies of the step's metadata (Triton).

Compiled artifacts are cached by inductor on disk (its FX graph and AOT autograd caches), in
a directory of Tidegate's own per torch build (configure_inductor), never the machine-wide
/tmp/torchinductor_<user> that every torch install on the machine writes to.
`--compile-cache-dir` points them at a directory that survives restarts (a volume in a pod),
which turns the second start's compilation into cache loads.
"""

from __future__ import annotations

import bisect
import hashlib
import logging
import os
import sys
import time
from collections.abc import Callable, Mapping

import torch
from torch import nn

from tidegate.engine.attention.backend import AttentionMetadata
from tidegate.engine.config import EngineArgs
from tidegate.engine.model.config import ModelConfig

logger = logging.getLogger(__name__)

# What an unset level means. On CPU, level 1 beat eager in 8 of 10 paired runs of
# `make bench-compile` (fresh processes, alternating; bf16, linears packed in both): median
# 1.07x on the tiny model, 1.05x on the small one (benchmarks/results/compile.json; an
# earlier run without packing: 1.19x and 1.09x, 9 of 10). It costs compilation at start-up:
# 25-45 s on a cold cache, 7-13 s with a warm one (Tidegate's default cache is under
# ~/.cache; --compile-cache-dir puts it on a volume).
CPU_DEFAULT_LEVEL = 1
# On CUDA, graphs for decode (vLLM's default too); level 1 where the backend can't be captured.
CUDA_DEFAULT_LEVEL = 2
# The level when no flag gives one: for jobs too short to win back a compile (test suites).
LEVEL_ENV = "TIDEGATE_COMPILATION_LEVEL"
# Graphs dynamo may keep for the model's forward in one process: 32 engines' worth.
RECOMPILE_LIMIT = 64
# Decode batches above this run without graphs (vLLM's default largest capture size too).
MAX_CAPTURE_SIZE = 512
# Where inductor reads its cache directory from (and where users name one).
CACHE_DIR_ENV = "TORCHINDUCTOR_CACHE_DIR"


def resolve_compilation_level(
    args: EngineArgs,
    device: torch.device,
    cuda_graph_safe: bool = False,
    environ: Mapping[str, str] = os.environ,
) -> int:
    """The level this worker runs at: the flag, else $TIDEGATE_COMPILATION_LEVEL, else the
    device's default.

    `cuda_graph_safe`: whether the attention backend can be captured in a CUDA graph.
    """
    if args.enforce_eager:
        return 0
    level = args.compilation_level
    if level is None and environ.get(LEVEL_ENV, "") != "":
        level = _level_from_env(environ[LEVEL_ENV])
    if level is None:
        if device.type != "cuda":
            return CPU_DEFAULT_LEVEL
        return CUDA_DEFAULT_LEVEL if cuda_graph_safe else 1
    if level == 2 and device.type != "cuda":
        raise ValueError(
            f"compilation_level 2 captures CUDA graphs and needs a CUDA device (the model is "
            f"on {device.type}); use 1 (torch.compile) or 0 (eager)"
        )
    if level == 2 and not cuda_graph_safe:
        raise ValueError(
            f"compilation_level 2 cannot capture the {args.attention_backend!r} attention "
            "backend, which reads host copies of each step's metadata; use "
            "--attention-backend triton, or compilation_level 1"
        )
    return level


def why_no_cuda_graphs(model_config: ModelConfig, pp_size: int) -> str | None:
    """What keeps this model's decode steps out of CUDA graphs (level 2 then runs as 1), or
    None when nothing does."""
    if pp_size > 1:
        # A stage after the first starts from received hidden states, which the decode graphs
        # have no static buffer for.
        return "pipeline parallelism"
    if model_config.moe is not None:
        # The experts' op reads on the host how many tokens each expert got (model/moe.py).
        return "mixture of experts"
    return None


def level_was_given(args: EngineArgs, environ: Mapping[str, str] = os.environ) -> bool:
    """Whether a flag or the environment chose the level (else the device default did)."""
    return (
        args.enforce_eager or args.compilation_level is not None or environ.get(LEVEL_ENV, "") != ""
    )


def _level_from_env(value: str) -> int:
    if value.strip() not in ("0", "1", "2"):
        raise ValueError(f"{LEVEL_ENV}={value!r} is not a compilation level: give 0, 1 or 2")
    return int(value)


def configure_inductor(cache_dir: str | None = None) -> str:
    """Apply the inductor settings of every Tidegate compile; returns the cache directory.

    ModelCompiler calls it, and so do the tests: call it before anything compiles.
    """
    directory = resolve_cache_dir(cache_dir)
    os.makedirs(directory, exist_ok=True)
    # Read by inductor and Triton each time they look up the cache, so setting them before
    # the first compile is enough; worker processes spawned later inherit them.
    os.environ[CACHE_DIR_ENV] = directory
    if cache_dir is not None:
        # Triton's kernels too, so that a volume keeps them across restarts.
        os.environ["TRITON_CACHE_DIR"] = os.path.join(directory, "triton")
    # Inductor's precompiled C++ headers live in the machine-wide default directory whatever
    # the cache directory (torch._inductor.codecache._HEADER_DIR), shared by every torch
    # install on the machine: one that another install had built was reused here, and every
    # CPU kernel then failed to compile ("at::vec has not been declared"). Without them a
    # cold compile took no longer on 2 cores (about 20 s for the tiny model).
    torch._inductor.config.cpp_cache_precompile_headers = False
    # Inductor asks a child `python -c` whether the CPU's vector ISA works, with this
    # process's sys.path as its PYTHONPATH. With a source checkout's root on that path
    # (pytest's pythonpath, `python -m` run from the root), the child found our operator/
    # folder as the standard library's `operator` and died at start-up; inductor then took
    # the CPU for one without vector instructions. It generated scalar kernels, and C++ it
    # could not compile ("at::vec has not been declared") when the FX graph cache held a
    # kernel generated by a process whose probe had worked.
    os.environ.setdefault(
        "TORCH_CUSTOM_PYTHONPATH",
        os.pathsep.join(p for p in sys.path if not _shadows_stdlib_operator(p)),
    )
    torch._inductor.config.fx_graph_cache = True
    torch._functorch.config.enable_autograd_cache = True
    return directory


def _shadows_stdlib_operator(path: str) -> bool:
    """Whether `path` holds a package named `operator` (this repository's root does)."""
    return os.path.isfile(os.path.join(path or os.curdir, "operator", "__init__.py"))


def resolve_cache_dir(cache_dir: str | None = None, environ: Mapping[str, str] = os.environ) -> str:
    """The compile cache: `cache_dir` (the flag), else $TORCHINDUCTOR_CACHE_DIR if the user
    set it, else default_cache_dir()."""
    if cache_dir is not None:
        return os.path.abspath(cache_dir)
    given = environ.get(CACHE_DIR_ENV, "")
    # Importing torch._dynamo resolves inductor's machine-wide default and writes it into the
    # environment: that value is torch's choice, not the user's.
    if given and os.path.abspath(given) != inductor_default_cache_dir():
        return os.path.abspath(given)
    return default_cache_dir(environ)


def default_cache_dir(environ: Mapping[str, str] = os.environ) -> str:
    """Tidegate's cache for this torch build: $XDG_CACHE_HOME/tidegate/inductor/<build>, where
    $XDG_CACHE_HOME defaults to ~/.cache."""
    base = environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(base):  # the XDG spec ignores a relative one
        base = os.path.join(environ.get("HOME") or os.path.expanduser("~"), ".cache")
    return os.path.join(base, "tidegate", "inductor", torch_build_key())


def torch_build_key() -> str:
    """Names this torch build: version, commit and where it is installed.

    Two installs of one version differ in the headers their kernels include, and in the flags
    they were built with (vLLM's CPU build compiles its own).
    """
    commit = (torch.version.git_version or "unknown")[:12]
    where = hashlib.sha256(os.path.dirname(torch.__file__).encode()).hexdigest()[:8]
    return f"torch-{torch.__version__}-{commit}-{where}"


def inductor_default_cache_dir() -> str:
    """The machine-wide directory inductor uses when nobody names one: /tmp/torchinductor_<user>."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir as inductor_default

    return os.path.abspath(inductor_default())


class ModelCompiler:
    """Compiles a module in place with inductor and counts the graphs it compiles."""

    def __init__(self, cache_dir: str | None = None) -> None:
        # --compile-cache-dir; None: configure_inductor's choice.
        self.cache_dir = cache_dir
        # Every call of the backend is one graph compiled (a first compile or a recompile).
        self.num_graphs = 0

    def compile(self, module: nn.Module) -> None:
        """torch.compile `module`'s forward with a dynamic token dimension."""
        configure_inductor(self.cache_dir)
        # Dynamo keeps one cache per code object: every engine in a process adds its two
        # graphs to the one of LlamaModel.forward (each compiler's backend is its own). Past
        # the per-frame limit (8: four engines) dynamo would run the model eagerly without a
        # word, as it did to the fifth engine of a benchmark: lift the limit, and make
        # reaching it an error rather than a silent fallback.
        dynamo = torch._dynamo.config
        dynamo.recompile_limit = max(dynamo.recompile_limit, RECOMPILE_LIMIT)
        dynamo.fail_on_recompile_limit_hit = True
        module.compile(backend=self._backend, dynamic=True)

    def _backend(self, graph: torch.fx.GraphModule, example_inputs: list) -> Callable:
        from torch._inductor.compile_fx import compile_fx

        compiled = compile_fx(graph, example_inputs)
        # Counted once compiled: dynamo may abandon an attempt and trace again (it does so to
        # specialise a Python float such as the softmax scale), which is not a second graph.
        self.num_graphs += 1
        return compiled


def uncompile(module: nn.Module) -> None:
    """Make `module` run eagerly again after ModelCompiler.compile."""
    module._compiled_call_impl = None


def warm_up(
    run: Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], object],
    max_num_tokens: int,
    block_size: int,
    device: torch.device,
) -> float:
    """Run the model on the shapes that compile its graphs; returns the seconds it took.

    Two steps: one sequence of several tokens (the dynamic graph) and one single-token decode
    (the size-1 specialisation). They write no KV (every slot is -1) and read only block 0.
    """
    start = time.perf_counter()
    for num_tokens in (min(max_num_tokens, 2 * block_size), 1):
        run(*dummy_step(num_tokens, block_size, device))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def dummy_step(
    num_tokens: int, block_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Input ids, positions and metadata of one fresh sequence of `num_tokens` tokens."""
    qsl = torch.tensor([0, num_tokens], dtype=torch.int32)
    seq_lens = torch.tensor([num_tokens], dtype=torch.int32)
    num_blocks = -(-num_tokens // block_size)
    meta = AttentionMetadata(
        query_start_loc=qsl.to(device),
        seq_lens=seq_lens.to(device),
        block_table=torch.zeros((1, num_blocks), dtype=torch.int32, device=device),
        slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=device),
        num_seqs=1,
        num_tokens=num_tokens,
        max_query_len=num_tokens,
        max_seq_len=num_tokens,
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
    )
    input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
    positions = torch.arange(num_tokens, dtype=torch.int64, device=device)
    return input_ids, positions, meta


# -- CUDA graphs for decode-only steps (level 2): which sizes, and padding up to one ----------


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture, as vLLM's: 1, 2, 4, then every multiple of 8 up to the cap.

    The cap is the most sequences a step may hold, at most MAX_CAPTURE_SIZE.
    """
    max_num_seqs = min(max_num_seqs, MAX_CAPTURE_SIZE)
    sizes = [n for n in (1, 2, 4) if n <= max_num_seqs]
    sizes += range(8, max_num_seqs + 1, 8)
    if sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


def padded_size(num_tokens: int, sizes: list[int]) -> int | None:
    """The smallest captured size holding `num_tokens`; None when the batch is too big."""
    i = bisect.bisect_left(sizes, num_tokens)
    return sizes[i] if i < len(sizes) else None


def is_decode_only(num_scheduled_tokens: list[int]) -> bool:
    """A step every request of which computes exactly one token (what graphs are captured for)."""
    return bool(num_scheduled_tokens) and all(n == 1 for n in num_scheduled_tokens)
