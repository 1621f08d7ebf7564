"""Compiled execution: level 1 gives eager's greedy tokens, and batch changes don't recompile."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from tidegate.engine import LLM, SamplingParams
from tidegate.engine.config import EngineArgs
from tidegate.engine.worker.compilation import (
    CPU_DEFAULT_LEVEL,
    CUDA_DEFAULT_LEVEL,
    LEVEL_ENV,
    MAX_CAPTURE_SIZE,
    ModelCompiler,
    capture_sizes,
    configure_inductor,
    default_cache_dir,
    inductor_default_cache_dir,
    is_decode_only,
    padded_size,
    resolve_cache_dir,
    resolve_compilation_level,
    torch_build_key,
)

# Small steps force chunked prompts and steps that mix prefill chunks with decodes.
ENGINE = dict(
    dtype="float32",
    num_gpu_blocks=256,
    max_num_batched_tokens=48,
    long_prefill_token_threshold=24,
    max_num_partial_prefills=2,
    enable_prefix_caching=True,
)


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(6, 900) for _ in range(n)]


# Qwen3-MoE: q/k norms in the graph, and the experts as an opaque op beside attention.
# Gemma 3: its norms, GeGLU and scaled embedding in the graph, windows in the attention op.
# Gemma 2: each layer's soft cap in the C++ layer op, and the final logits' cap.
@pytest.fixture(scope="module", params=["llama", "qwen2", "gemma3", "gemma2", "qwen3_moe"])
def engines(request) -> tuple[LLM, LLM]:
    """(eager, compiled) engines on the same tiny model."""
    model = request.getfixturevalue(f"tiny_{request.param}_dir")
    eager = LLM(model=str(model), compilation_level=0, **ENGINE)
    # Tidegate's own compile cache, as every compile uses (configure_inductor): warm after
    # the first run on a machine, which is what a restarted server sees too.
    compiled = LLM(model=str(model), compilation_level=1, **ENGINE)
    return eager, compiled


def runner(llm: LLM):
    return llm.engine.executor.worker.runner


@pytest.mark.slow
def test_compiled_greedy_tokens_equal_eager_with_chunks_mixed_steps_and_prefix_hits(engines):
    eager, compiled = engines
    assert runner(compiled).compilation_level == 1
    warmed_up = runner(compiled).compiler.num_graphs
    assert 1 <= warmed_up <= 2  # compiled at start-up, before any request
    prefix = tokens(1, 40)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    # Prompts of 1 to ~100 tokens: long ones are chunked while short ones already decode.
    rounds = [
        [tokens(10 + i, 1 + 23 * i) for i in range(5)],
        [[*prefix, *tokens(20 + i, 3 + i)] for i in range(4)],  # the first fills the cache
        [[*prefix, *tokens(30 + i, 9)] for i in range(3)],  # prefix hits
    ]
    for prompts in rounds:
        want = [o.outputs[0].token_ids for o in eager.generate(prompts, params)]
        got = [o.outputs[0].token_ids for o in compiled.generate(prompts, params)]
        assert got == want
    assert compiled.stats()["prefix_cache_hits"] >= 3 * len(prefix)
    # No request compiled anything new.
    assert runner(compiled).compiler.num_graphs == warmed_up


@pytest.mark.slow
def test_batch_size_changes_do_not_recompile(engines):
    _, compiled = engines
    warmed_up = runner(compiled).compiler.num_graphs
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    # 1 to 9 requests of assorted lengths: steps of every token count from 1 to 48.
    for n in range(1, 10):
        compiled.generate([tokens(100 * n + i, 1 + 5 * i) for i in range(n)], params)
    assert runner(compiled).compiler.num_graphs == warmed_up


def test_inductor_finds_the_cpu_vector_isa_with_the_checkout_root_on_the_path():
    # pytest puts the repository's root, which holds operator/, on sys.path. Inductor's ISA
    # probe is a `python -c` child with sys.path as its PYTHONPATH: that child took our package
    # for the standard library's `operator`, died, and every CPU kernel came out scalar.
    from torch._inductor.cpu_vec_isa import pick_vec_isa, x86_isa_checker
    from torch._inductor.utils import python_subprocess_env

    root = str(Path(__file__).resolve().parents[2])
    assert (Path(root) / "operator" / "__init__.py").is_file() and root in sys.path
    configure_inductor()
    probe = [sys.executable, "-c", "import operator; operator.eq"]
    child = subprocess.run(probe, env=python_subprocess_env(), capture_output=True, text=True)
    assert child.returncode == 0, child.stderr
    if x86_isa_checker():  # an x86 CPU with AVX2 or AVX-512, as CI's
        assert pick_vec_isa(), "inductor found no vector ISA on a CPU that has one"


def test_enforce_eager_is_level_0_and_contradictions_are_refused(tiny_llama_dir):
    cpu = torch.device("cpu")
    assert resolve_compilation_level(EngineArgs(model="m", enforce_eager=True), cpu) == 0
    assert resolve_compilation_level(EngineArgs(model="m", compilation_level=1), cpu) == 1
    with pytest.raises(ValidationError, match="enforce_eager contradicts compilation_level 1"):
        EngineArgs(model="m", enforce_eager=True, compilation_level=1)
    llm = LLM(model=str(tiny_llama_dir), enforce_eager=True, max_model_len=512)
    assert runner(llm).compilation_level == 0
    assert runner(llm).compiler.num_graphs == 0


def test_level_2_needs_cuda_and_a_capturable_backend(tiny_llama_dir):
    with pytest.raises(ValueError, match=r"compilation_level 2 captures CUDA graphs and needs"):
        LLM(model=str(tiny_llama_dir), compilation_level=2, max_model_len=512)
    cuda = torch.device("cuda")  # only resolved here, never used
    level_2 = EngineArgs(model="m", compilation_level=2, attention_backend="torch")
    with pytest.raises(ValueError, match=r"cannot capture the 'torch' attention backend"):
        resolve_compilation_level(level_2, cuda, cuda_graph_safe=False)
    assert resolve_compilation_level(level_2, cuda, cuda_graph_safe=True) == 2


def test_defaults_are_graphs_on_cuda_where_the_backend_allows_and_compiled_on_cpu():
    unset, no_env = EngineArgs(model="m"), {}
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert resolve_compilation_level(unset, cuda, True, no_env) == CUDA_DEFAULT_LEVEL == 2
    assert resolve_compilation_level(unset, cuda, False, no_env) == 1
    assert resolve_compilation_level(unset, cpu, False, no_env) == CPU_DEFAULT_LEVEL == 1
    eager = EngineArgs(model="m", enforce_eager=True)
    assert resolve_compilation_level(eager, cuda, True, no_env) == 0


def test_the_environment_sets_the_level_that_no_flag_gives():
    unset, cpu = EngineArgs(model="m"), torch.device("cpu")
    assert resolve_compilation_level(unset, cpu, environ={LEVEL_ENV: "0"}) == 0
    assert resolve_compilation_level(unset, cpu, environ={LEVEL_ENV: ""}) == CPU_DEFAULT_LEVEL
    level_1 = EngineArgs(model="m", compilation_level=1)
    assert resolve_compilation_level(level_1, cpu, environ={LEVEL_ENV: "0"}) == 1  # flag wins
    with pytest.raises(ValueError, match=r"compilation_level 2 captures CUDA graphs"):
        resolve_compilation_level(unset, cpu, environ={LEVEL_ENV: "2"})
    with pytest.raises(ValueError, match=r"TIDEGATE_COMPILATION_LEVEL='fast' is not a compil"):
        resolve_compilation_level(unset, cpu, environ={LEVEL_ENV: "fast"})


def test_capture_sizes_follow_vllm_and_end_at_the_batch_cap():
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(32) == [1, 2, 4, 8, 16, 24, 32]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(4096)[-1] == MAX_CAPTURE_SIZE  # larger decode batches run uncaptured


def test_a_batch_is_padded_to_the_next_captured_size():
    sizes = capture_sizes(32)
    assert [padded_size(n, sizes) for n in (1, 2, 3, 4, 5, 8, 9, 31, 32)] == [
        1, 2, 4, 4, 8, 8, 16, 32, 32,
    ]  # fmt: skip
    assert padded_size(33, sizes) is None  # too big: runs without a graph


def test_only_steps_of_single_token_requests_are_decode_only():
    assert is_decode_only([1, 1, 1])
    assert not is_decode_only([1, 5, 1])
    assert not is_decode_only([])


def test_the_flags_are_on_the_command_line():
    import argparse

    from tidegate.engine.entrypoints.args import add_engine_args, engine_args_from

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = engine_args_from(
        parser.parse_args(["--model", "m", "--compilation-level", "1", "--compile-cache-dir", "c"])
    )
    assert (args.compilation_level, args.compile_cache_dir) == (1, "c")
    assert engine_args_from(parser.parse_args(["--model", "m", "--enforce-eager"])).enforce_eager
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "m", "--compilation-level", "3"])


@pytest.mark.slow
def test_tensor_parallel_compiled_tokens_equal_eager(tiny_llama_dir):
    """Level 1 is the CPU default, so each rank's compiled shard must hold its all-reduces."""
    prompts = [tokens(200 + i, 5 + 17 * i) for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    eager = LLM(model=str(tiny_llama_dir), compilation_level=0, **ENGINE)
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, params)]
    compiled = LLM(
        model=str(tiny_llama_dir),
        compilation_level=1,
        tensor_parallel_size=2,
        **ENGINE,
    )
    got = [o.outputs[0].token_ids for o in compiled.generate(prompts, params)]
    assert got == want


class _Toy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x)) * 2


@pytest.mark.slow
def test_many_engines_in_one_process_all_stay_compiled():
    """Each compiler adds graphs to one dynamo cache; past its default limit (four engines'
    worth) dynamo used to fall back to eager without a word."""
    counts = []
    with torch.inference_mode():
        for _ in range(6):
            module, compiler = _Toy(), ModelCompiler()
            compiler.compile(module)
            for n in (1, 4, 7):
                module(torch.randn(n, 8))
            counts.append(compiler.num_graphs)
    assert counts == [2] * 6
    assert torch._dynamo.config.fail_on_recompile_limit_hit  # never silently eager
    assert not torch._inductor.config.cpp_cache_precompile_headers  # see configure_inductor


def test_a_default_level_that_fails_to_compile_runs_eager_an_asked_for_one_fails(
    tiny_llama_dir, monkeypatch, caplog
):
    from tidegate.engine.worker import compilation

    def broken(*args, **kwargs):
        raise RuntimeError("C++ compile error\nmore lines")

    monkeypatch.setattr(compilation, "warm_up", broken)
    monkeypatch.delenv(LEVEL_ENV)  # the CPU default (1) applies
    llm = LLM(model=str(tiny_llama_dir), max_model_len=512)
    assert runner(llm).compilation_level == 0
    assert runner(llm).model.model._compiled_call_impl is None  # runs eager
    assert "compiling the model failed, so it runs eager (RuntimeError: C++ compile error)" in (
        caplog.text
    )
    params = SamplingParams(temperature=0, max_tokens=3)
    assert len(llm.generate([[5, 6, 7]], params)[0].outputs[0].token_ids) == 3
    with pytest.raises(RuntimeError, match="C\\+\\+ compile error"):
        LLM(model=str(tiny_llama_dir), max_model_len=512, compilation_level=1)


def test_the_compile_cache_is_the_flag_else_the_users_variable_else_one_per_torch_build():
    home = {"HOME": "/home/u"}
    own = f"/home/u/.cache/tidegate/inductor/{torch_build_key()}"
    assert default_cache_dir(home) == own
    assert default_cache_dir({**home, "XDG_CACHE_HOME": "/xdg"}).startswith("/xdg/tidegate/")
    assert default_cache_dir({**home, "XDG_CACHE_HOME": "rel"}) == own  # XDG ignores relative
    assert resolve_cache_dir(None, home) == own
    assert resolve_cache_dir(None, {**home, "TORCHINDUCTOR_CACHE_DIR": "/mine"}) == "/mine"
    assert resolve_cache_dir("/flag", {**home, "TORCHINDUCTOR_CACHE_DIR": "/mine"}) == "/flag"
    # Importing torch._dynamo writes inductor's machine-wide default into the environment:
    # that is not the user's choice, and the machine-wide directory is what we stay out of.
    written_by_torch = {**home, "TORCHINDUCTOR_CACHE_DIR": inductor_default_cache_dir()}
    assert resolve_cache_dir(None, written_by_torch) == own
    key = torch_build_key()
    assert torch.__version__ in key and (torch.version.git_version or "unknown")[:12] in key


# Run in a process of its own whose temporary directory and user name put inductor's
# machine-wide cache under the test's folder: it poisons that cache, then compiles through
# ModelCompiler. Prints what inductor would have used, what it used, and the results.
POISONED_CACHE_CHILD = """
import json, os, sys
from pathlib import Path

from torch._inductor.runtime.cache_dir_utils import default_cache_dir

machine_wide = Path(default_cache_dir())
if not machine_wide.is_relative_to(sys.argv[1]):
    sys.exit(f"inductor's default {machine_wide} is outside the sandbox: not poisoning it")
headers = machine_wide / "precompiled_headers"
headers.mkdir(parents=True, exist_ok=True)
# Another torch's header and a precompiled one that is garbage; lock directories that are
# files (a compile without our settings fails on them: FileExistsError); garbage where
# inductor keeps kernels and FX graphs.
(headers / "cpp_prefix.h").write_text("#error precompiled by another torch\\n")
(headers / "cpp_prefix.h.gch").write_bytes(os.urandom(4096))
(headers / "locks").write_text("not a directory")
(machine_wide / "locks").write_text("not a directory")
for name in ("fxgraph/zz/garbage", "zz/czzgarbage.so", "aotautograd/garbage"):
    (machine_wide / name).parent.mkdir(parents=True, exist_ok=True)
    (machine_wide / name).write_bytes(os.urandom(512))


def snapshot():
    return sorted((str(p), p.read_bytes() if p.is_file() else b"")
                  for p in machine_wide.rglob("*"))


poisoned = snapshot()
import torch
from torch._inductor import codecache, config
from torch._inductor.runtime.cache_dir_utils import cache_dir

from tidegate.engine.worker.compilation import ModelCompiler

would_have = {
    "cache_dir": cache_dir(),
    "header_dir": codecache._HEADER_DIR,
    "precompiles_headers": config.cpp_cache_precompile_headers,
}


class Toy(torch.nn.Module):  # dynamo skips frames in torch's own files, nn.Sequential's too
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.sin(torch.relu(self.linear(x))) * 2  # a C++ kernel around the matmul


module = Toy()
x = torch.linspace(-3, 3, 5 * 8).reshape(5, 8)
with torch.inference_mode():
    want = module(x)
    compiler = ModelCompiler()
    compiler.compile(module)
    got = module(x)
print(json.dumps({
    "machine_wide": str(machine_wide),
    "would_have": would_have,
    "used": cache_dir(),
    "precompiles_headers": config.cpp_cache_precompile_headers,
    "graphs": compiler.num_graphs,
    "max_error": (got - want).abs().max().item(),
    "kernels": [str(p) for p in Path(cache_dir()).rglob("*.so")],
    "untouched": snapshot() == poisoned,
}))
"""


@pytest.mark.slow
def test_a_poisoned_machine_wide_inductor_cache_does_not_reach_our_compiles(tmp_path: Path):
    """What broke `make test` on a machine where vLLM's CPU build had compiled before: its
    precompiled headers in /tmp/torchinductor_<user>, reused by our kernels."""
    sandbox = tmp_path / "tmp"
    sandbox.mkdir()
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "XDG_CACHE_HOME")
    }
    env.update(TMPDIR=str(sandbox), LOGNAME="poisoned", USER="poisoned", HOME=str(tmp_path))
    child = subprocess.run(
        [sys.executable, "-c", POISONED_CACHE_CHILD, str(sandbox)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert child.returncode == 0, child.stderr[-3000:]
    report = json.loads(child.stdout.splitlines()[-1])
    machine_wide = str(sandbox / "torchinductor_poisoned")
    assert report["machine_wide"] == machine_wide
    # Left alone, inductor would have cached there and precompiled its headers there.
    assert report["would_have"] == {
        "cache_dir": machine_wide,
        "header_dir": f"{machine_wide}/precompiled_headers",
        "precompiles_headers": True,
    }
    # Through our settings it used Tidegate's directory, and never wrote to the poisoned one.
    ours = str(tmp_path / ".cache" / "tidegate" / "inductor" / torch_build_key())
    assert report["used"] == ours
    assert not report["precompiles_headers"]
    assert report["untouched"]
    assert report["kernels"] and all(k.startswith(ours + "/") for k in report["kernels"])
    assert report["graphs"] == 1 and report["max_error"] < 1e-5
