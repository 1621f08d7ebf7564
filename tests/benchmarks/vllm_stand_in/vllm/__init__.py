"""Stand-in for vLLM's offline `LLM` as `benchmarks/peers/vllm_embed.py` calls it: Tidegate's
engine under vLLM's names (`LLM(runner="pooling", pooler_config=...)`, `embed`, the engine's
shutdown)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

__version__ = "stand-in"


class LLM:
    def __init__(
        self,
        model: str,
        runner: str,
        dtype: str,
        max_model_len: int,
        seed: int,
        pooler_config: Any,
    ) -> None:
        from tidegate.engine import LLM as Tidegate

        if runner != "pooling" or pooler_config.pooling_type != "LAST":
            raise ValueError("the stand-in embeds by the last token only")
        self.llm = Tidegate(model=model, dtype=dtype, max_model_len=max_model_len)
        self.normalize = pooler_config.use_activation
        # vLLM's way to stop the engine's processes: llm.llm_engine.engine_core.shutdown().
        self.llm_engine = SimpleNamespace(engine_core=SimpleNamespace(shutdown=self.llm.close))

    def embed(self, prompts: list[dict[str, list[int]]], use_tqdm: bool = True) -> list:
        ids = [prompt["prompt_token_ids"] for prompt in prompts]
        outputs = self.llm.embed(ids, pooling="last", normalize=self.normalize)
        return [SimpleNamespace(outputs=SimpleNamespace(embedding=o.embedding)) for o in outputs]
