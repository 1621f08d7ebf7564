"""The model runner: keeps per-request state, runs the model on a flat batch, samples."""

from __future__ import annotations

import functools
import logging
import queue
import time
from collections.abc import Callable, Iterator

import numpy as np
import torch

from tidegate.engine import huge_pages
from tidegate.engine.attention import AttentionMetadata, get_attention_backend
from tidegate.engine.attention.backend import kv_cache_dtype
from tidegate.engine.config import EngineArgs
from tidegate.engine.distributed.parallel_state import (
    broadcast,
    get_pp_size,
    get_tp_rank,
    is_first_stage,
    is_last_stage,
    kv_head_shard,
    recv_from_previous_stage,
    send_to_next_stage,
)
from tidegate.engine.lora.manager import LoRAManager
from tidegate.engine.messages import (
    GrammarBitmask,
    LogprobsLists,
    ModelRunnerOutput,
    SchedulerOutput,
)
from tidegate.engine.model.config import ModelConfig
from tidegate.engine.model.loader import load_model, resolve_dtype
from tidegate.engine.model.packed_linear import pack_linear_weights
from tidegate.engine.spec_decode.verify import accepted_tokens
from tidegate.engine.worker import compilation
from tidegate.engine.worker.cuda_graphs import DecodeGraphs, Graph, cuda_graph_factory
from tidegate.engine.worker.input_batch import CachedRequestState, InputBuilder, PersistentBatch
from tidegate.engine.worker.sampler import (
    Sampler,
    SamplerOutput,
    build_sampling_metadata,
    position_seed,
    token_logprobs,
)

logger = logging.getLogger(__name__)

# Rows of prompt logits computed at once for prompt_logprobs: 256 x a 128k vocabulary in
# float32 is 128 MiB.
_PROMPT_LOGPROBS_ROWS = 256
# The token that ends a pooling request (SamplingParams.pooling): never sampled, and dropped
# with the request's text; its vector is what the request is for.
POOLED_TOKEN = 0


class ModelRunner:
    """Turns a SchedulerOutput into sampled tokens; knows tensors, not queues."""

    def __init__(
        self,
        args: EngineArgs,
        model_config: ModelConfig,
        max_model_len: int,
        device: torch.device,
    ) -> None:
        self.args = args
        self.device = device
        self.max_model_len = max_model_len
        # LongRoPE's factors (Phi-3) depend on the longest context served.
        model_config = model_config.at_context_length(max_model_len)
        self.model_config = model_config
        self.dtype = resolve_dtype(args.dtype, self.model_config)
        self.kv_cache_dtype = kv_cache_dtype(args.kv_cache_dtype, self.dtype)
        self.attn_backend = get_attention_backend(
            args.attention_backend,
            device,
            head_dim=model_config.head_dim,
            block_size=args.block_size,
            dtype=self.dtype,
            kv_cache_dtype=self.kv_cache_dtype,
        )
        self.model, _ = load_model(
            args.model,
            self.dtype,
            device,
            self.attn_backend,
            config=model_config,
            quantization=args.quantization,
            kv_cache_dtype=self.kv_cache_dtype,
        )
        # bf16 linears on CPU: oneDNN's layout once, not a reorder per call (bitwise equal),
        # and the row counts that run faster in pieces measured up to a step's tokens.
        self.num_packed_linears = pack_linear_weights(
            self.model, max_rows=args.step_token_capacity(max_model_len)
        )
        self.lora: LoRAManager | None = None
        if args.enable_lora:
            # Before compiling: the adapted linears' graph includes the LoRA op.
            self.lora = LoRAManager(
                self.model,
                model_config,
                max_loras=args.max_loras,
                max_lora_rank=args.max_lora_rank,
                max_cpu_loras=args.max_cpu_loras,
                max_num_tokens=args.step_token_capacity(max_model_len),
                # With triton attention (CUDA, or CPU tests in the interpreter), LoRA in
                # Triton too: kernels that read only static buffers, as CUDA graphs need.
                use_triton=self.attn_backend.name == "triton",
            )
        # The weights, for the worker's lifetime: onto huge pages (fewer TLB misses).
        self.huge_pager = None
        if device.type == "cpu" and args.cpu_huge_pages:
            self.huge_pager = huge_pages.HugePager()
            backed = self.huge_pager.back(
                huge_pages.model_extents(self.model), budget_s=huge_pages.WEIGHTS_BUDGET_S
            )
            if backed.advised:
                logger.info(
                    "weights on huge pages: %.0f of %.0f MiB in %.2f s%s",
                    backed.collapsed / 2**20,
                    backed.advised / 2**20,
                    backed.seconds,
                    f" ({backed.note})" if backed.note else "",
                )
        self.compilation_level = compilation.resolve_compilation_level(
            args, device, self.attn_backend.cuda_graph_safe
        )
        # Pipeline parallelism: the stages this one sits between (hidden states in and out).
        self.first_stage, self.last_stage = is_first_stage(), is_last_stage()
        no_graphs = compilation.why_no_cuda_graphs(model_config, get_pp_size())
        if self.compilation_level == 2 and no_graphs is not None:
            logger.info("%s: no CUDA graphs, compilation level 1", no_graphs)
            self.compilation_level = 1
        # What the previous stage sent for the step being run (None on the first stage, and
        # in warm-up, which runs on zeros).
        self._stage_input: torch.Tensor | None = None
        self.compiler = compilation.ModelCompiler(args.compile_cache_dir)
        if self.compilation_level >= 1:
            # The decoder stack only: the LM head and the sampler run on few rows.
            self.compiler.compile(self.model.model)
        self.sampler = Sampler()
        # Key/value heads this rank caches: all, its share, or one replicated head.
        self.num_kv_heads = kv_head_shard(model_config.num_key_value_heads)[1]
        self.requests: dict[str, CachedRequestState] = {}
        # Held requests whose prompt logprobs have not gone out yet with their first token.
        self.prompt_logprobs_pending: set[str] = set()
        # Held requests with pooling whose vector has not gone out yet with their first token.
        self.pooling_pending: set[str] = set()
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.block_size = args.block_size
        max_blocks_per_seq = -(-max_model_len // args.block_size)
        self.batch = PersistentBatch(args.max_num_seqs, max_model_len, max_blocks_per_seq)
        self.inputs = InputBuilder(
            max_num_tokens=args.step_token_capacity(max_model_len),
            max_num_seqs=args.max_num_seqs,
            max_blocks_per_seq=max_blocks_per_seq,
            block_size=args.block_size,
            device=device,
        )
        self.decode_graphs: DecodeGraphs | None = None
        # Async scheduling: bitmasks of steps that started before their rows were known, in
        # step order (the engine core hands each over once the step before it is applied).
        self.deferred_bitmasks: queue.SimpleQueue[bytes] = queue.SimpleQueue()

    # -- KV cache ---------------------------------------------------------------------------

    def kv_cache_bytes_per_block(self) -> int:
        """Bytes one block takes across all layers, keys and values."""
        cfg = self.model_config
        elem = self.kv_cache_dtype.itemsize
        per_layer = 2 * self.block_size * self.num_kv_heads * cfg.head_dim * elem
        return per_layer * self.model.num_local_layers

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate the paged caches: per layer, keys and values in the attention backend's
        `kv_layout` ([blocks, block, heads, dim] for torch and triton; cpu packs them)."""
        cfg = self.model_config
        layout = self.attn_backend.kv_layout
        shape = layout.shape(num_blocks, self.block_size, self.num_kv_heads, cfg.head_dim)
        # Zeros, not empty: padded attention reads masked slots, and 0 * NaN would poison it.
        # On CPU, on huge pages: attention reads the cache scattered by the block tables.
        if self.huge_pager is not None:
            allocate = functools.partial(self.huge_pager.zeros, shape, self.kv_cache_dtype)
        else:
            allocate = functools.partial(
                torch.zeros, shape, dtype=self.kv_cache_dtype, device=self.device
            )
        self.kv_caches = [(allocate(), allocate()) for _ in range(self.model.num_local_layers)]
        if self.huge_pager is not None and huge_pages.available():
            logger.info(
                "KV cache on huge pages: %.0f of %.0f MiB at start%s",
                self.huge_pager.committed_huge / 2**20,
                sum(k.nbytes + v.nbytes for k, v in self.kv_caches) / 2**20,
                "" if self.huge_pager.cheap else f" ({self.huge_pager.slow_note()})",
            )

    def _forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        hidden = None
        if not self.first_stage:
            hidden = self._stage_input
            if hidden is None:  # warm-up: the shapes matter, not the values
                hidden = torch.zeros(
                    len(input_ids),
                    self.model_config.hidden_size,
                    dtype=self.dtype,
                    device=self.device,
                )
        return self.model(input_ids, positions, self.kv_caches, meta, hidden)

    @torch.inference_mode()
    def warm_up(self) -> float:
        """Compile the model's graphs before the first request; returns the seconds it took.

        When compiling fails at a level nobody asked for (the device's default), the model
        runs eager with a warning rather than keep the server down; an asked-for level fails.
        """
        if self.compilation_level == 0:
            return 0.0
        start = time.perf_counter()
        try:
            return compilation.warm_up(
                self._forward,
                max_num_tokens=len(self.inputs.input_ids),
                block_size=self.block_size,
                device=self.device,
            )
        except Exception as error:
            if compilation.level_was_given(self.args):
                raise
            logger.warning(
                "compiling the model failed, so it runs eager (%s: %s); --compilation-level 0 "
                "skips compiling, --compilation-level %d makes this an error",
                type(error).__name__,
                str(error).strip().splitlines()[0][:300] if str(error).strip() else "",
                self.compilation_level,
            )
            compilation.uncompile(self.model.model)
            self.compilation_level = 0
            return time.perf_counter() - start

    @torch.inference_mode()
    def capture_decode_graphs(self, new_graph: Callable[[], Graph] | None = None) -> float:
        """Capture the decode-only steps (level 2); returns the seconds it took.

        `new_graph` makes the graphs: CUDA graphs sharing one pool unless given (tests on CPU
        give a stand-in that replays by calling again).
        """
        if new_graph is None:
            new_graph = cuda_graph_factory(self.device)
        capacity = min(self.args.max_num_seqs, len(self.inputs.input_ids))
        self.decode_graphs = DecodeGraphs(
            sizes=compilation.capture_sizes(capacity),
            max_blocks_per_seq=self.inputs.block_table.shape[1],
            max_seq_len=self.max_model_len,
            device=self.device,
            new_graph=new_graph,
        )
        return self.decode_graphs.capture(self._forward)

    # -- one step ---------------------------------------------------------------------------

    def _update_states(self, so: SchedulerOutput) -> None:
        """Apply what changed since the last step to the persistent batch, row by row."""
        batch = self.batch
        for req_id in so.finished_req_ids:
            state = self.requests.pop(req_id, None)
            if state is not None:
                batch.remove(state.row)
            self.prompt_logprobs_pending.discard(req_id)
            self.pooling_pending.discard(req_id)
        for new in so.scheduled_new_reqs:
            params = new.sampling_params
            row = batch.add(new.prompt_token_ids, new.block_ids, new.num_computed_tokens)
            if params.prompt_logprobs is not None:
                self.prompt_logprobs_pending.add(new.req_id)
            if params.pooling is not None:
                self.pooling_pending.add(new.req_id)
            self.requests[new.req_id] = CachedRequestState(
                req_id=new.req_id,
                row=row,
                prompt_token_ids=new.prompt_token_ids,
                sampling_params=params,
                lora_request=new.lora_request,
            )
        for cached in so.scheduled_cached_reqs:
            row = self.requests[cached.req_id].row
            if cached.resumed_from_preemption:
                batch.set_blocks(row, cached.new_block_ids)
            else:
                batch.append_blocks(row, cached.new_block_ids)
            batch.num_computed_tokens[row] = cached.num_computed_tokens
            if cached.new_token_ids and not self.last_stage:
                # Sampled on the last stage: this stage learns them from the plan.
                end = cached.num_computed_tokens + so.num_scheduled_tokens[cached.req_id]
                batch.set_tokens(row, cached.new_token_ids, end)

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and return the tokens sampled for requests whose prompt is complete."""
        self._update_states(so)
        if so.is_empty:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        req_ids = list(so.num_scheduled_tokens)
        states = [self.requests[req_id] for req_id in req_ids]
        rows = np.fromiter((state.row for state in states), np.int64, len(states))
        num_scheduled = list(so.num_scheduled_tokens.values())
        guesses = so.scheduled_spec_decode_tokens
        num_guesses = None
        if guesses:
            # Speculative decoding: the guesses are this step's inputs after the last token.
            num_guesses = np.zeros(len(states), dtype=np.int64)
            for i, state in enumerate(states):
                proposal = guesses.get(state.req_id)
                if proposal:
                    self.batch.write_guesses(state.row, proposal)
                    num_guesses[i] = len(proposal)
        step = self.inputs.build(self.batch, rows, num_scheduled, num_guesses)
        if self.lora is not None:
            self.lora.prepare([state.lora_request for state in states], num_scheduled)
        size = self.decode_graphs.size_for(num_scheduled) if self.decode_graphs else None
        if not self.first_stage:
            self._stage_input = recv_from_previous_stage(
                len(step.input_ids), self.model_config.hidden_size, self.dtype, self.device
            )
        if size is not None:
            hidden = self.decode_graphs.run(step, size)
        else:
            hidden = self._forward(step.input_ids, step.positions, step.attn_metadata)
        self._stage_input = None
        if not self.last_stage:
            # The next stage goes on with this step while this one takes the next.
            send_to_next_stage(hidden)
            self.batch.num_computed_tokens[rows] += num_scheduled
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        sampled: list[list[int]] = [[] for _ in req_ids]
        logprobs: dict[str, LogprobsLists] = {}
        prompt_logprobs: dict[str, LogprobsLists] = {}
        pooled: dict[str, list[float]] = {}
        if self.prompt_logprobs_pending:
            self._prompt_logprobs(hidden, states, rows, num_scheduled)
        if self.pooling_pending:
            self._pool(hidden, states, rows, num_scheduled)
        if step.sampling_rows:
            sampling = [states[i] for i in step.sampling_rows]
            proposed = [guesses.get(s.req_id, []) for s in sampling] if guesses else None
            # A pooling request's one token only ends it: it is not sampled (no LM head row;
            # a classifier has no LM head), and any guesses it had count as rejected.
            drawn = [j for j, s in enumerate(sampling) if s.sampling_params.pooling is None]
            kept = [[POOLED_TOKEN] for _ in sampling]
            output = None
            if drawn:
                sub = [sampling[j] for j in drawn]
                sub_proposed = [proposed[j] for j in drawn] if proposed is not None else None
                # A sampling request has a row of logits per position it samples at.
                counts = [len(p) + 1 for p in proposed] if proposed is not None else None
                indices = step.logits_indices
                if len(sub) < len(sampling):
                    starts = np.cumsum([0, *(counts or [1] * len(sampling))])
                    picked = [k for j in drawn for k in range(starts[j], starts[j + 1])]
                    indices = indices[torch.as_tensor(picked, device=indices.device)]
                logits = self.model.compute_logits(hidden[indices])
                logit_rows = sub
                if sub_proposed is not None:
                    logit_rows = [
                        s for s, p in zip(sub, sub_proposed, strict=True) for _ in range(len(p) + 1)
                    ]
                grammar = self._grammar_rows(so.grammar, logit_rows, logits.device)
                output, tokens = self._sample_on_rank_0(logits, sub, grammar, sub_proposed)
                sub_kept = (
                    [[token] for token in tokens]
                    if sub_proposed is None
                    else accepted_tokens(tokens, sub_proposed)
                )
                for j, new in zip(drawn, sub_kept, strict=True):
                    kept[j] = new
            if proposed is None:
                self.batch.append_tokens(rows[step.sampling_rows], [new[0] for new in kept])
            else:
                self.batch.append_token_lists(rows[step.sampling_rows].tolist(), kept)
            for row, state, new in zip(step.sampling_rows, sampling, kept, strict=True):
                state.output_token_ids.extend(new)
                sampled[row] = new
                if state.req_id in self.prompt_logprobs_pending:
                    prompt_logprobs[state.req_id] = LogprobsLists(
                        *(state.prompt_logprobs or ([], [], []))
                    )
                    state.prompt_logprobs = None
                    self.prompt_logprobs_pending.discard(state.req_id)
                if state.req_id in self.pooling_pending:
                    pooled[state.req_id] = self._pooled_vector(state)
            if output is not None and output.logprobs is not None:
                logprobs = self._logprobs_lists(output, sub, [kept[j] for j in drawn], sub_proposed)
            if proposed is not None:
                # Guesses not kept were computed from wrong tokens: they count as not computed.
                for row, proposal, new in zip(step.sampling_rows, proposed, kept, strict=True):
                    self.batch.num_computed_tokens[rows[row]] -= len(proposal) + 1 - len(new)
        self.batch.num_computed_tokens[rows] += num_scheduled
        return ModelRunnerOutput(
            req_ids=req_ids,
            sampled_token_ids=sampled,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            pooled=pooled,
        )

    def _prompt_logprobs(
        self,
        hidden: torch.Tensor,
        states: list[CachedRequestState],
        rows: np.ndarray,
        num_scheduled: list[int],
    ) -> None:
        """The logprobs of the prompt tokens this step's chunks predict (the hidden state at
        position p predicts token p + 1), added to each asking request's state.

        Such requests take no prefix-cache hits, so their chunks cover the prompt from the
        start; a chunk recomputed after a preemption adds nothing twice. Every rank computes
        the logits (the vocab-parallel LM head gathers across them); slices of at most
        _PROMPT_LOGPROBS_ROWS rows bound the float32 [rows, vocab] memory.
        """
        chunks = self._pending_chunks(self.prompt_logprobs_pending, states, rows, num_scheduled)
        for state, begin, size, row_of in chunks:
            ids, values, ranks = state.prompt_logprobs or ([], [], [])
            # The next position whose prediction is missing, and the chunk's last one that
            # predicts a prompt token (the prompt's last position predicts the first output).
            first = max(begin, len(ids))
            last = min(begin + size, len(state.prompt_token_ids) - 1)
            if first > len(ids):
                raise RuntimeError(f"prompt logprobs of {state.req_id} skip a position")
            for lo in range(first, last, _PROMPT_LOGPROBS_ROWS):
                hi = min(lo + _PROMPT_LOGPROBS_ROWS, last)
                flat = row_of + lo
                logits = self.model.compute_logits(hidden[flat : flat + hi - lo]).float()
                targets = torch.tensor(
                    state.prompt_token_ids[lo + 1 : hi + 1], dtype=torch.int64, device=logits.device
                )
                more = token_logprobs(logits, targets, state.sampling_params.prompt_logprobs)
                for gathered, new in zip((ids, values, ranks), more, strict=True):
                    gathered.extend(new)
            state.prompt_logprobs = (ids, values, ranks)

    def _pool(
        self,
        hidden: torch.Tensor,
        states: list[CachedRequestState],
        rows: np.ndarray,
        num_scheduled: list[int],
    ) -> None:
        """Pool the final hidden states of this step's prompt chunks for the requests that ask
        (SamplingParams.pooling): keep the last prompt token's, or add the chunk's to the sum.

        A mean-pooled request takes no prefix-cache hits, so its chunks cover the prompt from
        the start; a chunk recomputed after a preemption adds nothing twice. Copies, in
        float32: a CUDA graph's output buffer is overwritten by its next replay.
        """
        chunks = self._pending_chunks(self.pooling_pending, states, rows, num_scheduled)
        for state, begin, size, row_of in chunks:
            num_prompt = len(state.prompt_token_ids)
            end = min(begin + size, num_prompt)
            if state.sampling_params.pooling == "last":
                if begin < num_prompt <= begin + size:
                    state.pooled = hidden[row_of + num_prompt - 1].to(torch.float32, copy=True)
                continue
            first = max(begin, state.pooled_upto)
            if first > state.pooled_upto:
                raise RuntimeError(f"the mean pooling of {state.req_id} skips a position")
            if end > first:
                chunk = hidden[row_of + first : row_of + end].to(torch.float32).sum(dim=0)
                state.pooled = chunk if state.pooled is None else state.pooled + chunk
                state.pooled_upto = end

    def _pending_chunks(
        self,
        pending: set[str],
        states: list[CachedRequestState],
        rows: np.ndarray,
        num_scheduled: list[int],
    ) -> Iterator[tuple[CachedRequestState, int, int, int]]:
        """This step's chunks of the requests in `pending`, before the step's tokens count as
        computed: (state, the chunk's first position, its tokens, and `row_of`: position p's
        hidden state is row row_of + p of the step's flat batch)."""
        starts = np.cumsum([0, *num_scheduled])
        for i, state in enumerate(states):
            if state.req_id in pending:
                begin = int(self.batch.num_computed_tokens[rows[i]])
                yield state, begin, num_scheduled[i], int(starts[i]) - begin

    def _pooled_vector(self, state: CachedRequestState) -> list[float]:
        """The request's pooled vector, on the step that samples its first token."""
        if state.pooled is None:
            raise RuntimeError(f"{state.req_id} samples before its prompt was pooled")
        vector = state.pooled
        if state.sampling_params.pooling == "mean":
            vector = vector / len(state.prompt_token_ids)
        state.pooled = None
        self.pooling_pending.discard(state.req_id)
        if self.model_config.is_classifier:
            vector = self.model.classify(vector.unsqueeze(0))[0]  # the labels' logits
        return vector.tolist()

    def _grammar_rows(
        self, grammar: GrammarBitmask | None, rows: list[CachedRequestState], device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(sampling row indices, their int32 bitmask rows) of the step's constrained requests."""
        if grammar is None:
            return None
        data = grammar.bitmask
        if data is None:
            data = self.deferred_bitmasks.get()  # the engine core fills it meanwhile
        # A request's rows of logits in order; its id comes once per row in the bitmask too.
        positions: dict[str, list[int]] = {}
        for i, state in enumerate(rows):
            positions.setdefault(state.req_id, []).append(i)
        taken: dict[str, int] = {}
        indices = []
        for req_id in grammar.req_ids:
            of_request, k = positions.get(req_id, []), taken.get(req_id, 0)
            taken[req_id] = k + 1
            indices.append(of_request[k] if k < len(of_request) else -1)
        bitmask = torch.frombuffer(bytearray(data), dtype=torch.int32).view(-1, grammar.words)
        keep = [i for i, row in enumerate(indices) if row >= 0]
        if len(keep) < len(indices):  # a row that does not sample this step (cannot happen)
            bitmask = bitmask[keep]
            indices = [indices[i] for i in keep]
        if not indices:
            return None
        return (
            torch.tensor(indices, dtype=torch.int64, device=device),
            bitmask.to(device, non_blocking=True),
        )

    def _sample_on_rank_0(
        self,
        logits: torch.Tensor,
        rows: list[CachedRequestState],
        grammar: tuple[torch.Tensor, torch.Tensor] | None = None,
        proposed: list[list[int]] | None = None,
    ) -> tuple[SamplerOutput | None, list[int]]:
        """Rank 0 samples and sends its tokens to the other ranks, so that all append the same
        tokens and stay in lockstep (no rank depends on its own random state)."""
        output = None
        if get_tp_rank() == 0:
            output = self._sample(logits, rows, grammar, proposed)
            tokens = output.sampled_token_ids.to(logits.device, torch.int64)
        else:
            tokens = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
        return output, broadcast(tokens).tolist()

    def _sample(
        self,
        logits: torch.Tensor,
        rows: list[CachedRequestState],
        grammar: tuple[torch.Tensor, torch.Tensor] | None = None,
        proposed: list[list[int]] | None = None,
    ) -> SamplerOutput:
        """One token per row of logits: a request's row, or with guesses (speculative
        decoding) a row per position, sampled as if the guesses before it were its outputs."""
        params: list = []
        prompts: list[list[int]] = []
        outputs: list[list[int]] = []
        generators: dict[int, torch.Generator] = {}
        for i, state in enumerate(rows):
            guesses = proposed[i] if proposed is not None else ()
            seeded = state.sampling_params.seed is not None and not state.sampling_params.greedy
            for j in range(len(guesses) + 1):
                if seeded:
                    generators[len(params)] = self._position_generator(state, j)
                params.append(state.sampling_params)
                prompts.append(state.prompt_token_ids)
                outputs.append(
                    [*state.output_token_ids, *guesses[:j]] if j else state.output_token_ids
                )
        meta = build_sampling_metadata(
            params=params,
            prompt_token_ids=prompts,
            output_token_ids=outputs,
            generators=generators,
            vocab_size=logits.shape[-1],
            device=logits.device,
        )
        meta.grammar_bitmask = grammar
        return self.sampler(logits, meta)

    def _position_generator(self, state: CachedRequestState, offset: int) -> torch.Generator:
        """A seeded request's generator for the output position `offset` past its known
        tokens, seeded for that position alone: its draw does not depend on how many
        positions earlier steps sampled, so guesses (kept or not), batching and preemption
        leave a seeded request's tokens as they are."""
        while len(state.generators) <= offset:
            state.generators.append(torch.Generator(device=self.device))
        generator = state.generators[offset]
        seed = state.sampling_params.seed
        assert seed is not None
        generator.manual_seed(position_seed(seed, len(state.output_token_ids) + offset))
        return generator

    @staticmethod
    def _logprobs_lists(
        output: SamplerOutput,
        rows: list[CachedRequestState],
        kept: list[list[int]],
        proposed: list[list[int]] | None = None,
    ) -> dict[str, LogprobsLists]:
        """Logprobs of the tokens each request keeps: the rows of its first positions."""
        ids = output.logprob_token_ids.tolist()
        values = output.logprobs.tolist()
        ranks = output.sampled_token_ranks.tolist()
        result = {}
        first = 0
        for i, state in enumerate(rows):
            start, n = first, len(kept[i])
            first += 1 + (len(proposed[i]) if proposed is not None else 0)
            k = state.sampling_params.logprobs
            if k is None:
                continue
            result[state.req_id] = LogprobsLists(
                token_ids=[row[: k + 1] for row in ids[start : start + n]],
                logprobs=[row[: k + 1] for row in values[start : start + n]],
                sampled_token_ranks=ranks[start : start + n],
            )
        return result
