"""Fixtures shared by all tests (tiny random-weight models written once per session), and the
marks that decide what `make test-quick` runs."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from tidegate.engine.tiny_model import make_tiny_model
from tidegate.engine.worker.compilation import configure_inductor

# Engines the tests start (here and in the servers they spawn) run eager unless a test asks
# for a level: compiling each one would cost the suite 6-35 s per engine. The compiled paths
# have their own tests (tests/engine/test_compilation.py, test_cuda_graphs.py).
os.environ.setdefault("TIDEGATE_COMPILATION_LEVEL", "0")
# The suite runs servers beside other tests on 2 cores: OpenMP's idle threads must sleep at
# once, or an engine core that runs its model spins on the cores its own socket threads and
# the tests need (several times slower per step; docs/architecture.md, section 2).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# `make test-quick` runs -m "not e2e and not model and not slow": the units, for iteration.
# The marks are given here from where a test lives and what it uses, so that a new test is
# classified without anyone remembering to mark it: under tests/e2e/ or in a *_e2e.py module,
# e2e; asking for a model folder (as an argument, or as the parameter a test hands to
# request.getfixturevalue), model.
MODEL_FIXTURES = frozenset(
    {
        "tiny_llama_dir",
        "tiny_qwen2_dir",
        "tiny_qwen3_dir",
        "tiny_qwen3_moe_dir",
        "tiny_mixtral_dir",
        "tiny_fp8_model",
        "tiny_phi3_dir",
    }
)
# Modules elsewhere whose tests start servers, engines or commands in processes of their own.
STARTS_PROCESSES = frozenset(
    {
        "tests/benchmarks/test_scenarios.py",
        "tests/packaging/test_wheel.py",
        "tests/test_cli.py",
        "tests/engine/test_http_server.py",
        "tests/engine/test_malloc.py",
        "tests/engine/test_pipeline_parallel.py",
        "tests/engine/test_tensor_parallel.py",
        "tests/operator/test_operator_cli.py",
        "tests/router/test_router_cli.py",
    }
)
# Units too heavy to iterate with: kernels in Triton's interpreter on CPU (40 s on 2 cores),
# checkov's scans (once make test has installed it).
SLOW_MODULES = frozenset(
    {"tests/engine/test_triton_attention.py", "tests/operator/test_pod_security.py"}
)


# End-to-end modules whose assertions hold at any speed (status codes, error bodies, tokens,
# cache isolation): they run with the rest on both cores.
TIMING_FREE_E2E = frozenset(
    {
        "tests/e2e/test_async_scheduling_serve.py",
        "tests/e2e/test_errors.py",
        "tests/e2e/test_fuzzed_requests.py",
        "tests/e2e/test_lora_serve.py",
        "tests/e2e/test_openai_client.py",
        "tests/e2e/test_scoring_serve.py",
        "tests/e2e/test_spec_decode_serve.py",
        "tests/e2e/test_tenancy.py",
    }
)
# End-to-end modules whose timings assume a quiet machine: a long prompt's arrival against the
# steady streams' ITL, request deadlines, 429s before any admitted request ends, RSS between
# soak rounds, one data-parallel core killed while both serve a stream (beside another module,
# one core's first token came so late that the other's 3,000-token stream had ended: 2 runs of
# 3). `make test` runs them last, by themselves (the `alone` mark), with any test elsewhere
# that carries the `alone` mark by hand.
QUIET_E2E = frozenset(
    {
        "tests/e2e/test_bench_serve.py",
        "tests/e2e/test_data_parallel_serve.py",
        "tests/e2e/test_limits.py",
        "tests/e2e/test_soak.py",
        # Six clients on a canary and its stable processes: beside another up module, that
        # one's scale-down came after its streams had ended (its timing, not its logic).
        "tests/e2e/test_up_canary.py",
    }
)
# The other e2e modules (faults, restarts, P/D, `tidegate up`) kill processes and
# wait for exits and restarts within deadlines of 10 s and more: they hold with one other such
# module beside them, but not beside the whole suite's compiles. `make test` runs them two at a
# time, between the rest and the quiet ones (the `paired` mark). Each spends about half its
# time waiting for a process to start, exit or restart, so a second one uses the idle core:
# 194 s one after the other, 128 s two at a time, on a 2-core machine.


def pytest_sessionstart(session: pytest.Session) -> None:
    """Build the CPU attention (and LoRA) kernels before any test starts an engine that would: the
    first build takes 20-60 s on 2 busy cores, inside some server's start-up timeout."""
    from tidegate.engine.attention.cpu_attention import cpu_kernels_available
    from tidegate.engine.lora.ops import fused_kernel_available

    cpu_kernels_available()
    fused_kernel_available()  # the LoRA kernel, which every adapter-serving engine loads


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark e2e, model and slow tests by the rules above."""
    for item in items:
        path = item.path.relative_to(config.rootpath).as_posix()
        if path.startswith("tests/e2e/") or path.endswith("_e2e.py") or path in STARTS_PROCESSES:
            item.add_marker(pytest.mark.e2e)
        if path in QUIET_E2E:
            item.add_marker(pytest.mark.alone)
        elif item.get_closest_marker("alone") is not None:
            pass  # a quiet-machine test in a module that otherwise runs paired
        elif path.startswith("tests/e2e/") and path not in TIMING_FREE_E2E:
            item.add_marker(pytest.mark.paired)
        if path in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)
        callspec = getattr(item, "callspec", None)
        params = callspec.params.values() if callspec else ()
        asked = set(getattr(item, "fixturenames", ())) | {p for p in params if isinstance(p, str)}
        if asked & MODEL_FIXTURES:
            item.add_marker(pytest.mark.model)


@pytest.fixture(scope="session", autouse=True)
def inductor_settings() -> str:
    """Whatever compiles in a test, here or in a process it starts, does so with the engine's
    settings: its own cache directory, not the machine-wide one where another torch install
    may have left precompiled headers that break ours."""
    # A fixture, not an import-time call: it imports triton, which must come after the test
    # modules that set TRITON_INTERPRET have been collected.
    return configure_inductor()


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama folder (untied embeddings, no biases), seed 0."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), arch="llama", size="tiny")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen2 folder (q/k/v biases, tied embeddings), seed 0."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), arch="qwen2", size="tiny")


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3 folder (q/k norms, heads wider than hidden / heads, tied embeddings)."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"), arch="qwen3", size="tiny")


@pytest.fixture(scope="session")
def tiny_qwen3_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3-MoE folder: layer 0 dense, layer 1 eight experts, two per token."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen3-moe"), arch="qwen3_moe", size="tiny")


@pytest.fixture(scope="session")
def tiny_mistral_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Mistral folder: every layer a 40-token sliding window."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-mistral"), arch="mistral", size="tiny")


@pytest.fixture(scope="session")
def tiny_gemma2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Gemma 2 folder: a 24-token window then a full layer, scores capped at 2."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-gemma2"), arch="gemma2", size="tiny")


@pytest.fixture(scope="session")
def tiny_gemma3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Gemma 3 folder: a 24-token sliding-window layer, then a full-attention one."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-gemma3"), arch="gemma3", size="tiny")


@pytest.fixture(scope="session")
def tiny_phi3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Phi-3 folder: fused qkv_proj and gate_up_proj, 3/4 of each head rotated by
    LongRoPE (512 pretraining positions), every layer a 64-token window."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-phi3"), arch="phi3", size="tiny")


@pytest.fixture(scope="session")
def tiny_mixtral_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Mixtral folder: four experts per layer, two per token (block_sparse_moe names)."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-mixtral"), arch="mixtral", size="tiny")


@pytest.fixture(scope="session")
def tiny_fp8_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, str], Path]:
    """FP8 checkpoints of the tiny models: (arch, quantize) -> folder, written once a session.
    quantize is one of tiny_model.QUANTIZATIONS: fp8-block (32 x 32 blocks, transformers' fp8),
    fp8-channel or fp8-tensor (compressed-tensors)."""
    folders: dict[tuple[str, str], Path] = {}

    def folder(arch: str, quantize: str) -> Path:
        if (arch, quantize) not in folders:
            out = tmp_path_factory.mktemp(f"tiny-{arch}-{quantize}")
            folders[arch, quantize] = make_tiny_model(out, arch=arch, quantize=quantize)
        return folders[arch, quantize]

    return folder
