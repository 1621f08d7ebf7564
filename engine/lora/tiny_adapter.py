"""Write a deterministic random LoRA adapter (PEFT's folder layout) for a model folder.

`tidegate make-tiny-adapter` writes one for tests and demos: PEFT loads it as it loads any
adapter (`PeftModel.from_pretrained`), which is how tests judge the engine's LoRA path. The
weights are large enough that greedy outputs differ clearly from the base model's.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from tidegate.engine.lora.adapter import (
    CONFIG_FILE,
    MLP_TARGETS,
    TARGETS,
    WEIGHTS_FILE,
    model_targets,
    projection_shape,
)
from tidegate.engine.model.config import ModelConfig


def make_tiny_adapter(
    model_dir: str | Path,
    out_dir: str | Path,
    rank: int = 8,
    alpha: float | None = None,
    seed: int = 0,
    targets: list[str] | None = None,
    use_rslora: bool = False,
) -> Path:
    """Write the adapter folder to out_dir; the same arguments always give the same bytes.
    `targets` default to every projection, as the model's modules name them (Phi-3's fused
    qkv_proj and gate_up_proj)."""
    if rank < 1:
        raise ValueError(f"rank must be at least 1, got {rank}")
    config = ModelConfig.from_pretrained(Path(model_dir))
    targets = list(model_targets(config)) if targets is None else list(targets)
    unknown = sorted(set(targets) - set(TARGETS))
    if unknown:
        raise ValueError(f"unknown targets {unknown}; choose from {', '.join(TARGETS)}")
    dtype = getattr(torch, config.torch_dtype or "float32")
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for proj in TARGETS:  # model order, whatever order `targets` came in
            sparse = proj in MLP_TARGETS and config.is_sparse_layer(layer)
            if proj not in targets or sparse:  # a mixture of experts has no such projection
                continue
            in_features, out_features = projection_shape(config, proj)
            group = "mlp" if proj in MLP_TARGETS else "self_attn"
            prefix = f"base_model.model.model.layers.{layer}.{group}.{proj}"
            a = torch.randn(rank, in_features, generator=generator) / math.sqrt(in_features)
            b = torch.randn(out_features, rank, generator=generator) / math.sqrt(rank)
            tensors[f"{prefix}.lora_A.weight"] = a.to(dtype)
            tensors[f"{prefix}.lora_B.weight"] = b.to(dtype)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    settings = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(Path(model_dir).resolve()),
        "r": rank,
        "lora_alpha": rank if alpha is None else alpha,
        "lora_dropout": 0.0,
        "target_modules": [proj for proj in TARGETS if proj in targets],
        "bias": "none",
        "use_rslora": use_rslora,
        "fan_in_fan_out": False,
        "inference_mode": True,
    }
    (out / CONFIG_FILE).write_text(json.dumps(settings, indent=2) + "\n", encoding="utf-8")
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    (out / WEIGHTS_FILE).chmod((out / CONFIG_FILE).stat().st_mode & 0o777)
    return out
