"""Pipeline parallelism on CPU (gloo): the layers split into stages give the tokens one worker
gives (float32), with the stages overlapping on micro-batches or one step at a time, and over
two "nodes" that meet over TCP as the pods of a LeaderWorkerSet group do."""

from __future__ import annotations

import itertools
import signal
import time
from pathlib import Path

import httpx
import psutil
import pytest
from pydantic import ValidationError

from tests.e2e.client import wait_idle
from tests.e2e.server import ServerProcess
from tests.engine.test_tensor_parallel import CONSTRAINED
from tidegate.common.local_server import free_port, tidegate_command
from tidegate.engine import LLM, SamplingParams
from tidegate.engine.config import EngineArgs
from tidegate.engine.core.kv_cache_manager import KVCacheManager
from tidegate.engine.core.request import Request
from tidegate.engine.core.scheduler import Scheduler
from tidegate.engine.core.step_budget import StepLimits
from tidegate.engine.distributed.parallel_state import stage_layers
from tidegate.engine.messages import ModelRunnerOutput
from tidegate.engine.tiny_model import make_tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
LONG_PROMPT = "The tide comes in and the tide goes out, " * 12
PROMPTS = ["Hello, my name is", LONG_PROMPT, [5, 6, 7, 8, 9] * 20, "a b c", "one two three"]
ENGINE = {
    "max_model_len": 512,
    "max_num_batched_tokens": 64,
    "num_gpu_blocks": 128,
    "dtype": "float32",
}
# Stops, seeds, logprobs and the long prompt's prompt logprobs (over its chunks): all decided
# on the last stage, where the sampler runs (n > 1 is fanned out by the API server, before
# any stage).
MIXED = [
    SamplingParams(temperature=0, max_tokens=40, stop=["e"], include_stop_str_in_output=True),
    SamplingParams(temperature=0.9, seed=7, max_tokens=20, prompt_logprobs=1),
    SamplingParams(temperature=0.7, seed=11, max_tokens=30, logprobs=2),
    SamplingParams(temperature=0, max_tokens=3),
    SamplingParams(temperature=1.0, seed=5, max_tokens=25, top_k=20),
]


class _Logprobs:
    """A completion's logprobs, equal to another's within float32 noise: the ranks split the
    machine's threads differently, so the matmuls sum in another order (the tokens and the
    ranks of the candidates are exact)."""

    def __init__(self, steps: list[dict] | None) -> None:
        self.steps = [  # a prompt's first position has none
            {token: (lp.rank, lp.logprob) for token, lp in (step or {}).items()}
            for step in steps or []
        ]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _Logprobs) or len(self.steps) != len(other.steps):
            return False
        for mine, theirs in zip(self.steps, other.steps, strict=True):
            if mine.keys() != theirs.keys():
                return False
            for token, (rank, logprob) in mine.items():
                if theirs[token][0] != rank or theirs[token][1] != pytest.approx(logprob, abs=1e-4):
                    return False
        return True

    def __repr__(self) -> str:
        return repr(self.steps)[:200]


def _outputs(llm: LLM, prompts: list, params: list[SamplingParams] | SamplingParams) -> list:
    return [
        [
            (c.token_ids, c.finish_reason, _Logprobs(c.logprobs), _Logprobs(o.prompt_logprobs))
            for c in o.outputs
        ]
        for o in llm.generate(prompts, params)
    ]


def _generate(model_dir: Path, **engine: object) -> list:
    with LLM(str(model_dir), **{**ENGINE, **engine}) as llm:
        greedy = _outputs(llm, PROMPTS, GREEDY)
        mixed = _outputs(llm, PROMPTS, MIXED)
    return greedy + mixed


@pytest.fixture(scope="module")
def one_stage(tiny_llama_dir: Path) -> list:
    return _generate(tiny_llama_dir)


def test_two_stages_embed_as_one_does(tiny_llama_dir):
    """Only the last stage has the final hidden states; it pools them."""
    embeddings = {}
    for stages in (1, 2):
        with LLM(str(tiny_llama_dir), **ENGINE, pipeline_parallel_size=stages) as llm:
            embeddings[stages] = [
                o.embedding for pooling in ("last", "mean") for o in llm.embed(PROMPTS, pooling)
            ]
    for got, want in zip(embeddings[2], embeddings[1], strict=True):
        assert got == pytest.approx(want, abs=1e-5)


def test_two_stages_classify_as_one_does(tmp_path):
    """Only the last stage holds the score head; the first holds neither it nor an LM head."""
    folder = make_tiny_model(tmp_path / "classifier", arch="llama", num_labels=3)
    logits = {}
    for stages in (1, 2):
        with LLM(str(folder), **ENGINE, pipeline_parallel_size=stages) as llm:
            logits[stages] = [o.logits for o in llm.classify(PROMPTS)]
    for got, want in zip(logits[2], logits[1], strict=True):
        assert got == pytest.approx(want, abs=1e-5)


@pytest.mark.parametrize("micro_batching", [True, False])
def test_two_stages_generate_the_tokens_of_one(tiny_llama_dir, one_stage, micro_batching):
    two = _generate(
        tiny_llama_dir, pipeline_parallel_size=2, pipeline_micro_batching=micro_batching
    )
    assert two == one_stage
    [(_, _, _, prompt_logprobs)] = one_stage[len(PROMPTS) + 1]  # the long prompt's, chunked
    assert len(prompt_logprobs.steps) > ENGINE["max_num_batched_tokens"]


def test_two_stages_with_tied_embeddings_and_biases(tiny_qwen2_dir):
    """Qwen2's LM head is its embedding: the last stage loads the table the first one embeds
    with."""
    assert _generate(tiny_qwen2_dir, pipeline_parallel_size=2) == _generate(tiny_qwen2_dir)


def test_two_stages_of_a_mixture_of_experts(tiny_qwen3_moe_dir):
    """Qwen3-MoE: its dense first layer runs on one stage, its experts' layer on the other."""
    two = _generate(tiny_qwen3_moe_dir, pipeline_parallel_size=2)
    assert two == _generate(tiny_qwen3_moe_dir)


def test_two_stages_of_gemma3_keep_each_layers_window(tiny_gemma3_dir):
    """Gemma 3: the windowed layer 0 runs on the first stage and the full layer 1 on the
    second; each keeps its own window, RoPE and norms (windows are by the model's layer
    index, caches by the stage's)."""
    two = _generate(tiny_gemma3_dir, pipeline_parallel_size=2)
    assert two == _generate(tiny_gemma3_dir)


def test_two_stages_preempt_on_a_tight_pool_as_one_does(tiny_llama_dir):
    """Nine blocks for five requests: requests are preempted and recomputed, some with a step
    in flight in the other stage, and the earlier stage relearns their sampled tokens."""
    tight = {"num_gpu_blocks": 9, "max_model_len": 128, "block_size": 16}
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    prompts = ["Hello, my name is", "a b c", "one two three", [5, 6, 7] * 5, "x y"]
    results = []
    for pp in (1, 2):
        with LLM(str(tiny_llama_dir), **{**ENGINE, **tight}, pipeline_parallel_size=pp) as llm:
            results.append(_outputs(llm, prompts, params))
            preemptions = llm.stats()["num_preemptions"]
            assert llm.stats()["num_free_blocks"] == 9  # nothing leaked
        assert preemptions > 0
    assert results[1] == results[0]


def _adapters_and_grammars(model_dir: Path, adapters: list[Path], **engine: object) -> list:
    """Each prompt under the base model and each adapter in one batch; then two constrained
    requests (the grammar's bitmask reaches the last stage, which samples under it)."""
    with LLM(
        str(model_dir), enable_lora=True, max_loras=len(adapters), **{**ENGINE, **engine}
    ) as llm:
        loras = [None] + [llm.load_lora(p.name, str(p)) for p in adapters]
        prompts = [prompt for prompt in PROMPTS[:3] for _ in loras]
        adapted = llm.generate(prompts, GREEDY, lora_request=loras * 3)
        constrained = llm.generate(PROMPTS[:2], CONSTRAINED)
    return [o.outputs[0].token_ids for o in [*adapted, *constrained]]


def test_two_stages_serve_adapters_and_grammars_as_one_does(tiny_llama_dir, tmp_path):
    """Each stage adapts its own layers: the adapter's tensors of the other stage's layers are
    skipped as the base model's are."""
    from tidegate.engine.lora.tiny_adapter import make_tiny_adapter

    adapters = [
        make_tiny_adapter(tiny_llama_dir, tmp_path / "all", rank=8, seed=1),
        make_tiny_adapter(
            tiny_llama_dir, tmp_path / "some", rank=4, seed=2, targets=["k_proj", "down_proj"]
        ),
    ]
    one = _adapters_and_grammars(tiny_llama_dir, adapters)
    assert _adapters_and_grammars(tiny_llama_dir, adapters, pipeline_parallel_size=2) == one
    assert one[0] != one[1] != one[2]  # base, and each adapter, differ


@pytest.mark.slow
def test_two_ranks_by_two_stages_generate_the_tokens_of_one(tiny_llama_dir, one_stage):
    assert _generate(tiny_llama_dir, pipeline_parallel_size=2, tensor_parallel_size=2) == one_stage


# -- units ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("layers", "stages", "head", "expected"),
    [
        (2, 2, 0.67, [range(0, 1), range(1, 2)]),
        (126, 2, 0.0, [range(0, 63), range(63, 126)]),
        (10, 3, 0.0, [range(0, 4), range(4, 7), range(7, 10)]),
        (32, 1, 3.0, [range(0, 32)]),
        # The small benchmark model: its LM head weighs as much as 3.9 of its 12 layers.
        (12, 2, 3.91, [range(0, 8), range(8, 12)]),
        (80, 4, 1.23, [range(0, 21), range(21, 41), range(41, 61), range(61, 80)]),
        # A head heavier than a fair share still leaves the last stage one layer.
        (4, 2, 9.0, [range(0, 3), range(3, 4)]),
    ],
)
def test_stages_split_the_layers_evenly_the_last_less_its_lm_head(layers, stages, head, expected):
    assert [stage_layers(layers, s, stages, head) for s in range(stages)] == expected


def test_more_stages_than_layers_is_refused(tiny_llama_dir):
    with pytest.raises(ValueError, match="pipeline_parallel_size 3 is more than this model's 2"):
        LLM(str(tiny_llama_dir), pipeline_parallel_size=3, **ENGINE)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"nnodes": 3, "pipeline_parallel_size": 2}, "nnodes 3 must divide"),
        ({"nnodes": 2, "node_rank": 2, "pipeline_parallel_size": 2}, "node_rank 2 must be below"),
        (
            {"nnodes": 2, "pipeline_parallel_size": 2, "data_parallel_size_local": 2},
            "a model spread over nnodes > 1 runs one",
        ),
        ({"pipeline_parallel_size": 2, "kv_role": "producer"}, "does not run with pipeline"),
        (
            {"pipeline_parallel_size": 2, "distributed_executor_backend": "uni"},
            "needs 'mp'",
        ),
    ],
)
def test_what_stages_and_nodes_cannot_serve_is_refused(fields, message):
    with pytest.raises(ValidationError, match=message):
        EngineArgs(model="m", **fields)


def _scheduler(micro_batches: int) -> Scheduler:
    limits = StepLimits(
        max_num_batched_tokens=256,
        max_num_seqs=64,
        long_prefill_token_threshold=0,
        max_num_partial_prefills=1,
        max_long_partial_prefills=1,
        max_model_len=256,
    )
    return Scheduler(
        limits,
        KVCacheManager(num_blocks=64, block_size=4, enable_caching=True),
        async_scheduling=micro_batches > 1,
        pipeline_parallel_size=2,
        micro_batches=micro_batches,
    )


def _request(index: int) -> Request:
    return Request(
        request_id=f"r{index}",
        prompt_token_ids=[index + 1] * 3,
        sampling_params=SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
        eos_token_ids=[0],
    )


def test_micro_batches_take_turns_and_tell_earlier_stages_the_sampled_tokens():
    scheduler = _scheduler(micro_batches=2)
    for i in range(4):
        scheduler.add_request(_request(i))
    first = scheduler.schedule()
    second = scheduler.schedule()
    # Each micro-batch takes half the requests; none is in two steps in flight.
    assert list(first.num_scheduled_tokens) == ["r0", "r1"]
    assert list(second.num_scheduled_tokens) == ["r2", "r3"]
    # While both run, nothing is left to plan.
    assert scheduler.schedule().is_empty
    sampled = ModelRunnerOutput(req_ids=["r0", "r1"], sampled_token_ids=[[40], [41]])
    scheduler.update_from_output(first, sampled)
    third = scheduler.schedule()
    assert list(third.num_scheduled_tokens) == ["r0", "r1"]
    # A decode reads the token the last stage sampled: the first stage learns it here.
    assert {c.req_id: c.new_token_ids for c in third.scheduled_cached_reqs} == {
        "r0": [40],
        "r1": [41],
    }


def test_one_step_at_a_time_takes_every_request():
    scheduler = _scheduler(micro_batches=1)
    for i in range(4):
        scheduler.add_request(_request(i))
    step = scheduler.schedule()
    assert len(step.num_scheduled_tokens) == 4
    scheduler.update_from_output(
        step,
        ModelRunnerOutput(req_ids=list(step.num_scheduled_tokens), sampled_token_ids=[[9]] * 4),
    )
    assert all(c.new_token_ids == [9] for c in scheduler.schedule().scheduled_cached_reqs)


# -- serving ---------------------------------------------------------------------------------------


def _completion(base_url: str, model_dir: Path, prompt: str, max_tokens: int = 24) -> str:
    response = httpx.post(
        f"{base_url}/v1/completions",
        json={
            "model": str(model_dir),
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        },
        timeout=60,
    )
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


@pytest.fixture(scope="module")
def expected_texts(tiny_llama_dir: Path) -> list[str]:
    with LLM(str(tiny_llama_dir), **ENGINE) as llm:
        return [o.outputs[0].text for o in llm.generate(PROMPTS[:2], GREEDY)]


def test_serve_with_two_stages_answers_as_one_worker_does(tiny_llama_dir, tmp_path, expected_texts):
    server = ServerProcess(
        tiny_llama_dir, tmp_path, "--pipeline-parallel-size", "2", "--max-model-len", "512"
    ).wait_healthy()
    try:
        assert {"tidegate::worker_pp0_tp0", "tidegate::worker_pp1_tp0"} <= set(server.children())
        for prompt, text in zip(PROMPTS[:2], expected_texts, strict=True):
            assert _completion(server.base_url, tiny_llama_dir, prompt) == text
        # Streams dropped by their clients mid-way, with steps in flight in both stages: they
        # are aborted and their blocks freed, and the next request is answered as before.
        for _ in range(3):
            body = {
                "model": str(tiny_llama_dir),
                "prompt": LONG_PROMPT,
                "max_tokens": 300,
                "ignore_eos": True,
                "stream": True,
            }
            with httpx.stream(
                "POST", f"{server.base_url}/v1/completions", json=body, timeout=60
            ) as response:
                assert response.status_code == 200
                lines = response.iter_lines()
                assert sum(line.startswith("data: {") for line in itertools.islice(lines, 20))
        wait_idle(server.base_url)
        assert _completion(server.base_url, tiny_llama_dir, PROMPTS[0]) == expected_texts[0]
    finally:
        server.stop()


class _Node:
    """`tidegate serve --node-rank 1`: the second node's agent (its ranks, no HTTP)."""

    def __init__(self, master_port: int, log: Path) -> None:
        command = [
            *tidegate_command(),
            "serve",
            *("--nnodes", "2", "--node-rank", "1", "--master-port", str(master_port)),
        ]
        self.process = psutil.Popen(command, stdout=log.open("w"), stderr=-2)
        self.log = log

    def stop(self) -> None:
        if self.process.is_running():
            self.process.kill()
            self.process.wait(10)


def test_a_leader_and_a_node_answer_as_one_worker_does_and_fall_together(
    tiny_llama_dir, tmp_path, expected_texts
):
    """Two "nodes" on one machine: the leader serves and runs stage 0; the node, started after
    it, gets everything but the addresses in the handshake and runs stage 1. When the leader
    goes, the node stops its worker and exits 1 (the group restarts as a unit)."""
    master_port = free_port(consecutive=2)  # the rendezvous and the control channel beside it
    leader = ServerProcess(
        tiny_llama_dir,
        tmp_path,
        *("--pipeline-parallel-size", "2", "--max-model-len", "512"),
        *("--nnodes", "2", "--node-rank", "0", "--master-port", str(master_port)),
    )
    node = _Node(master_port, tmp_path / "node.log")
    try:
        leader.wait_healthy()
        titles = [" ".join(p.cmdline()).strip() for p in node.process.children(recursive=True)]
        assert [t for t in titles if t.startswith("tidegate::")] == ["tidegate::worker_pp1_tp0"]
        for prompt, text in zip(PROMPTS[:2], expected_texts, strict=True):
            assert _completion(leader.base_url, tiny_llama_dir, prompt) == text
        workers = [
            p for p in node.process.children(recursive=True) if "tidegate::" in p.cmdline()[0]
        ]
        leader_processes = list(leader.children().values())
        started = time.monotonic()
        # The API server, engine core and stage-0 worker all go, as when a pod is deleted.
        for process in [psutil.Process(leader.process.pid), *leader_processes]:
            process.send_signal(signal.SIGKILL)
        assert node.process.wait(30) == 1
        assert time.monotonic() - started < 30
        _, alive = psutil.wait_procs(workers, timeout=10)
        assert not alive
        assert "stopping this node's workers" in node.log.read_text()
    finally:
        node.stop()
        leader.stop()
