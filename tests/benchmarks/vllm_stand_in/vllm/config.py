"""Stand-in for `vllm.config.PoolerConfig` (an embedding's activation is its normalisation)."""

from dataclasses import dataclass


@dataclass
class PoolerConfig:
    pooling_type: str
    use_activation: bool
