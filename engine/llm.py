"""The offline API: `LLM(model=DIR).generate(prompts, params)`."""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Sequence
from typing import Any

from tidegate.engine.config import EngineArgs
from tidegate.engine.core.engine_core import EngineCore
from tidegate.engine.errors import RequestRefusedError
from tidegate.engine.input_processor import InputProcessor, model_eos_token_ids
from tidegate.engine.lora.registry import LoRARegistry
from tidegate.engine.messages import LoRARequest
from tidegate.engine.output_processor import OutputProcessor
from tidegate.engine.outputs import (
    ClassificationOutput,
    EmbeddingOutput,
    RequestOutput,
    ScoringOutput,
)
from tidegate.engine.pooling import (
    CLASSIFIER_POOLING,
    check_dimensions,
    finish_embedding,
    read_pooling_config,
)
from tidegate.engine.sampling_params import SamplingParams
from tidegate.engine.scoring import (
    class_probabilities,
    cosine_similarity,
    read_score_activation,
    score_pairs,
)
from tidegate.engine.tokenizer import Tokenizer

Prompt = str | list[int]


class LLM:
    """Generate text from a local model folder in this process."""

    def __init__(self, model: str, **engine_args: Any) -> None:
        self.args = EngineArgs(model=model, **engine_args)
        if self.args.data_parallel_size_local != 1:
            raise ValueError(
                f"data_parallel_size_local {self.args.data_parallel_size_local}: the offline "
                "LLM runs one engine core; data parallelism is a serving feature "
                "(tidegate serve --data-parallel-size-local)"
            )
        if self.args.kv_role != "none":
            raise ValueError(
                f"kv_role {self.args.kv_role!r}: KV transfer pairs serving instances behind "
                "`tidegate router` (tidegate serve --kv-role); the offline LLM takes 'none'"
            )
        self.engine = EngineCore(self.args)
        # Worker processes (tensor_parallel_size > 1) stop on close(), when this object is
        # collected, or at interpreter exit, whichever comes first.
        self._finalizer = weakref.finalize(self, self.engine.shutdown)
        self.tokenizer = Tokenizer(self.args.tokenizer or self.args.model)
        self.input_processor = InputProcessor(
            tokenizer=self.tokenizer,
            vocab_size=self.engine.model_config.vocab_size,
            max_model_len=self.engine.max_model_len,
            eos_token_ids=model_eos_token_ids(self.engine.model_config, self.tokenizer),
            priority_scheduling=self.args.scheduling_policy == "priority",
            classifier=self.engine.model_config.is_classifier,
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()
        self.loras = LoRARegistry(
            self.engine.model_config, self.args.max_lora_rank, reserved_names=[model]
        )

    def load_lora(self, name: str, path: str) -> LoRARequest:
        """Check a PEFT adapter folder and serve it under `name` (needs enable_lora)."""
        if not self.args.enable_lora:
            raise ValueError("this LLM was made without enable_lora=True; it serves no adapters")
        return self.loras.load(name, path)

    def close(self) -> None:
        """Stop the worker processes, if any; idempotent."""
        self._finalizer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def get_tokenizer(self) -> Tokenizer:
        return self.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        cache_salt: str | None = None,
        lora_request: LoRARequest | str | Sequence[LoRARequest | str | None] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for each prompt (text or token ids); outputs come back in prompt order.

        `lora_request` is an adapter from `load_lora` (or its name) for every prompt, or a
        list with one per prompt (None: the base model). `priority`, one per prompt, orders
        them under scheduling_policy "priority" (lower first).
        """
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"got {len(params_list)} sampling params for {len(prompts)} prompts; "
                    "give one, or one per prompt"
                )
        loras = self._loras_per_prompt(lora_request, len(prompts))
        priorities = list(priority) if priority is not None else [0] * len(prompts)
        if len(priorities) != len(prompts):
            raise ValueError(f"got {len(priorities)} priorities for {len(prompts)} prompts")
        # Validate everything before queuing anything, so a bad prompt leaves nothing behind.
        requests = [
            self.input_processor.process(
                f"offline-{next(self._ids)}",
                prompt,
                params,
                cache_salt,
                lora_request=lora,
                priority=rank,
            )
            for prompt, params, lora, rank in zip(
                prompts, params_list, loras, priorities, strict=True
            )
        ]
        order = {request.request_id: i for i, request in enumerate(requests)}
        for request, prompt in zip(requests, prompts, strict=True):
            self.output_processor.add_request(request, prompt if isinstance(prompt, str) else None)
            self.engine.add_request(request)
        results: list[RequestOutput | None] = [None] * len(requests)
        try:
            while self.engine.has_unfinished_requests() or self.engine.waits_for_grammar():
                if not self.engine.has_unfinished_requests():
                    self.engine.wait_for_grammars()  # nothing can run until one compiles
                    continue
                for output in self._step():
                    if output.finished and output.request_id in order:
                        results[order[output.request_id]] = output
        except BaseException:
            # Interrupted or failed: leave no request (and no KV block) behind.
            self._abort([request.request_id for request in requests])
            raise
        return [r for r in results if r is not None]

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        pooling: str = "auto",
        normalize: bool | None = None,
        dimensions: int | None = None,
        lora_request: LoRARequest | str | Sequence[LoRARequest | str | None] | None = None,
    ) -> list[EmbeddingOutput]:
        """An embedding of each prompt (text or token ids), in prompt order: its final hidden
        states pooled as the model folder says (pooling.py) unless `pooling` ("last", "mean")
        does, its first `dimensions` values kept, normalised unless `normalize` is False (or
        the folder does not normalise and `normalize` is None)."""
        if self.engine.model_config.is_classifier:
            raise ValueError(
                "this model is a sequence classifier: what it pools is its labels' logits, "
                "not an embedding (classify and score use them)"
            )
        config = read_pooling_config(self.args.model, pooling)
        check_dimensions(dimensions, self.engine.model_config.hidden_size)
        unit = config.normalize if normalize is None else normalize
        outputs = self.generate(prompts, config.sampling_params(), lora_request=lora_request)
        return [
            EmbeddingOutput(
                prompt_token_ids=output.prompt_token_ids,
                embedding=finish_embedding(output.pooled or [], unit, dimensions),
            )
            for output in outputs
        ]

    def classify(
        self,
        prompts: Prompt | Sequence[Prompt],
        lora_request: LoRARequest | str | Sequence[LoRARequest | str | None] | None = None,
    ) -> list[ClassificationOutput]:
        """A sequence classifier's verdict on each prompt (text or token ids), in prompt
        order: each label's logit, their probabilities (scoring.class_probabilities) and the
        likeliest label."""
        labels = self._classifier_labels()
        outputs = self.generate(prompts, CLASSIFIER_POOLING, lora_request=lora_request)
        results = []
        for output in outputs:
            logits = output.pooled or []
            probs = class_probabilities(logits)
            label = labels[max(range(len(probs)), key=probs.__getitem__)]
            results.append(ClassificationOutput(output.prompt_token_ids, logits, probs, label))
        return results

    def score(
        self,
        text_1: str | list[str],
        text_2: str | list[str],
        lora_request: LoRARequest | str | None = None,
    ) -> list[ScoringOutput]:
        """Scores of text pairs (one text_1 with each text_2, or two lists pairwise): a
        cross-encoder's (a one-label classifier's) activated logit of each pair read as one
        prompt, or an embedding model's cosine similarity of the two texts' vectors."""
        pairs = score_pairs(text_1, text_2)
        config = self.engine.model_config
        if config.is_classifier:
            if len(config.labels) != 1:
                raise ValueError(
                    f"this classifier has {len(config.labels)} labels; a score comes from a "
                    "one-label classifier (a cross-encoder) or an embedding model"
                )
            activation = read_score_activation(self.args.model, 1)
            prompts = [self.tokenizer.encode_pair(a, b) for a, b in pairs]
            outputs = self.generate(prompts, CLASSIFIER_POOLING, lora_request=lora_request)
            return [
                ScoringOutput(activation((o.pooled or [0.0])[0]), len(o.prompt_token_ids))
                for o in outputs
            ]
        texts = list(dict.fromkeys(text for pair in pairs for text in pair))
        embedded = self.embed(texts, lora_request=lora_request)
        by_text = dict(zip(texts, embedded, strict=True))
        return [
            ScoringOutput(
                cosine_similarity(by_text[a].embedding, by_text[b].embedding),
                len(by_text[a].prompt_token_ids) + len(by_text[b].prompt_token_ids),
            )
            for a, b in pairs
        ]

    def _classifier_labels(self) -> tuple[str, ...]:
        labels = self.engine.model_config.labels
        if not labels:
            raise ValueError(
                f"{self.args.model} is not a sequence classifier (its architecture ends in an "
                "LM head): it generates and embeds; classify needs *ForSequenceClassification"
            )
        return labels

    def _loras_per_prompt(
        self, lora: LoRARequest | str | Sequence[LoRARequest | str | None] | None, count: int
    ) -> list[LoRARequest | None]:
        if lora is None or isinstance(lora, LoRARequest | str):
            loras = [lora] * count
        else:
            loras = list(lora)
            if len(loras) != count:
                raise ValueError(f"got {len(loras)} LoRA requests for {count} prompts")
        resolved = []
        for item in loras:
            if item is not None and not self.args.enable_lora:
                raise ValueError("this LLM was made without enable_lora=True")
            if isinstance(item, str):
                item = self.loras.require(item)
            resolved.append(item)
        return resolved

    def _step(self) -> list[RequestOutput]:
        engine_outputs = self.engine.step()
        refused = next((out for out in engine_outputs if out.error is not None), None)
        if refused is not None:
            raise RequestRefusedError(refused.error)
        outputs, to_abort = self.output_processor.process_outputs(engine_outputs)
        if to_abort:
            self.engine.abort_requests(to_abort)
        return outputs

    def _abort(self, request_ids: list[str]) -> None:
        self.engine.abort_requests(request_ids)
        for request_id in request_ids:
            self.output_processor.abort(request_id)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or several, through the chat template."""
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        prompts = []
        for conversation in conversations:
            text = self.tokenizer.apply_chat_template(conversation, add_generation_prompt=True)
            # The template writes BOS itself; encoding must not add a second one.
            prompts.append(self.tokenizer.encode(text, add_special_tokens=False))
        return self.generate(prompts, sampling_params)

    def stats(self) -> dict[str, float]:
        """Block counts, prefix-cache counters, preemptions and queue sizes."""
        return self.engine.stats()
