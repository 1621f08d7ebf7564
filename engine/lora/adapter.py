"""A LoRA adapter folder (PEFT's layout), read and checked against the base model.

PEFT saves `adapter_config.json` (rank `r`, `lora_alpha`, `use_rslora`, `target_modules`)
and `adapter_model.safetensors`, whose tensors are named like
`base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight` ([r, in]) and
`...lora_B.weight` ([out, r]). The delta of a projection is `B @ A @ x * scaling`, with
scaling `alpha / r`, or `alpha / sqrt(r)` with rsLoRA. Phi-3's modules are fused in the
checkpoint (`qkv_proj`, `gate_up_proj`), so its adapters are too: one A and a B whose rows
are q's, k's and v's (gate's and up's) in turn, which is B's row blocks each with the same A
(`FUSED_TARGETS`, split so by the workers).

Everything here reads headers and JSON only, never torch: the API server checks a folder
completely (every tensor's name, shape and dtype) before it accepts the adapter, so a broken
folder is refused with a 400 and nothing is half-loaded. The workers then read the weights
(`engine/lora/manager.py`).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tidegate.engine.model.config import MULTIMODAL_PARTS, ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# The projections an adapter may target: every linear of the decoder layers, by the names of
# most models' modules, and Phi-3's fused ones.
UNFUSED_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FUSED_TARGETS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
TARGETS = (*UNFUSED_TARGETS, *FUSED_TARGETS)
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj", "gate_up_proj")  # a dense layer's only
# Architectures whose checkpoints (and so PEFT's adapters) fuse q/k/v and gate/up.
_FUSED_ARCHITECTURES = ("Phi3ForCausalLM",)
_SAFETENSORS_DTYPES = {"F32", "F16", "BF16"}
# layers.<i>.<self_attn|mlp>.<proj>.lora_<A|B>[.<adapter name>].weight
_TENSOR_NAME = re.compile(
    r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(" + "|".join(TARGETS) + r")\.lora_([AB])"
    r"(?:\.[A-Za-z0-9_-]+)?\.weight$"
)

# A multimodal model's vision parts (Gemma 3 4B and up), and the tower's inner vision_model,
# under any PEFT prefix.
_VISION_PART = re.compile(r"(?:^|\.)(?:" + "|".join((*MULTIMODAL_PARTS, "vision_model")) + r")\.")


class LoRAError(ValueError):
    """An adapter folder that cannot be served: the message says what is wrong."""


@dataclass(frozen=True)
class AdapterInfo:
    """What a checked adapter folder holds."""

    path: str
    rank: int
    alpha: float
    use_rslora: bool
    # (layer, projection) pairs the folder holds an A and a B for.
    modules: frozenset[tuple[int, str]]
    digest: str

    @property
    def scaling(self) -> float:
        """The factor of B @ A: alpha / r, or alpha / sqrt(r) with rsLoRA."""
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

    @property
    def targets(self) -> list[str]:
        """The projection names it adapts, in model order."""
        present = {proj for _, proj in self.modules}
        return [proj for proj in TARGETS if proj in present]


def model_targets(config: ModelConfig) -> tuple[str, ...]:
    """The projections as the model's own modules name them (what PEFT targets)."""
    if config.architecture in _FUSED_ARCHITECTURES:
        return ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    return UNFUSED_TARGETS


def projection_shape(config: ModelConfig, proj: str) -> tuple[int, int]:
    """(in_features, out_features) of a projection of the whole (unsharded) model."""
    if proj in FUSED_TARGETS:
        parts = [projection_shape(config, part) for part in FUSED_TARGETS[proj]]
        return parts[0][0], sum(out for _, out in parts)
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    hidden, inter = config.hidden_size, config.intermediate_size
    return {
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }[proj]


def split_fused(config: ModelConfig, proj: str, a: Any, b: Any) -> list[tuple[str, Any, Any]]:
    """A fused projection's (A, B) as its parts' (name, A, B): B's row blocks, each with the
    same A (B @ A's rows are B's rows times A). Others as they are."""
    if proj not in FUSED_TARGETS:
        return [(proj, a, b)]
    parts, start = [], 0
    for part in FUSED_TARGETS[proj]:
        rows = projection_shape(config, part)[1]
        parts.append((part, a, b[start : start + rows]))
        start += rows
    return parts


def read_adapter(path: str | Path, config: ModelConfig, max_lora_rank: int) -> AdapterInfo:
    """Check an adapter folder against the base model; a LoRAError names the first problem."""
    folder = Path(path)
    if not folder.is_dir():
        raise LoRAError(f"adapter path {str(path)!r} is not a directory")
    settings = _read_config(folder / CONFIG_FILE)
    rank = settings.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise LoRAError(f"{CONFIG_FILE}: r must be a positive integer, got {rank!r}")
    if rank > max_lora_rank:
        raise LoRAError(
            f"adapter rank {rank} exceeds this server's max_lora_rank {max_lora_rank}; "
            "start the server with a larger --max-lora-rank"
        )
    alpha = settings.get("lora_alpha", rank)
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise LoRAError(f"{CONFIG_FILE}: lora_alpha must be a number, got {alpha!r}")
    _refuse_unsupported(settings)
    weights = folder / WEIGHTS_FILE
    if not weights.is_file():
        other = sorted(p.name for p in folder.glob("adapter_model.*"))
        hint = f" (found {', '.join(other)}: only safetensors is read)" if other else ""
        raise LoRAError(f"adapter folder {str(path)!r} has no {WEIGHTS_FILE}{hint}")
    modules = _check_tensors(read_safetensors_header(weights), config, rank)
    return AdapterInfo(
        path=str(folder),
        rank=rank,
        alpha=float(alpha),
        use_rslora=bool(settings.get("use_rslora", False)),
        modules=frozenset(modules),
        digest=folder_digest(folder),
    )


def _read_config(file: Path) -> dict[str, Any]:
    try:
        settings = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise LoRAError(f"adapter folder has no {CONFIG_FILE}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise LoRAError(f"{CONFIG_FILE} cannot be read: {error}") from None
    if not isinstance(settings, dict):
        raise LoRAError(f"{CONFIG_FILE} must hold a JSON object")
    peft_type = settings.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise LoRAError(f"{CONFIG_FILE}: peft_type {peft_type!r} is not served; only LORA")
    return settings


def _refuse_unsupported(settings: dict[str, Any]) -> None:
    """PEFT options that change the maths beyond B @ A * scaling: refused, not ignored."""
    problems = []
    if settings.get("use_dora"):
        problems.append("use_dora (DoRA)")
    if settings.get("bias", "none") not in ("none", None):
        problems.append(f"bias {settings['bias']!r} (only 'none')")
    if settings.get("fan_in_fan_out"):
        problems.append("fan_in_fan_out")
    if settings.get("modules_to_save"):
        problems.append("modules_to_save (whole modules replaced)")
    if settings.get("rank_pattern") or settings.get("alpha_pattern"):
        problems.append("rank_pattern/alpha_pattern (per-module ranks)")
    if problems:
        raise LoRAError(
            f"{CONFIG_FILE} uses options this server does not serve: {', '.join(problems)}"
        )


def read_safetensors_header(file: Path) -> dict[str, dict[str, Any]]:
    """Tensor name -> {dtype, shape, data_offsets} from a safetensors file's JSON header."""
    try:
        with open(file, "rb") as f:
            size_bytes = f.read(8)
            if len(size_bytes) != 8:
                raise LoRAError(f"{file.name} is not a safetensors file (too short)")
            (size,) = struct.unpack("<Q", size_bytes)
            file_size = file.stat().st_size
            if size > min(file_size - 8, 100 << 20):
                raise LoRAError(f"{file.name} is not a safetensors file (bad header length)")
            header = json.loads(f.read(size))
    except OSError as error:
        raise LoRAError(f"{file.name} cannot be read: {error.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise LoRAError(f"{file.name} is not a safetensors file (bad header)") from None
    if not isinstance(header, dict):
        raise LoRAError(f"{file.name} is not a safetensors file (bad header)")
    header.pop("__metadata__", None)
    end = max((t.get("data_offsets", [0, 0])[1] for t in header.values()), default=0)
    if 8 + size + end > file_size:
        raise LoRAError(f"{file.name} is truncated: its tensors need {end:,} bytes of data")
    return header


def _check_tensors(
    header: dict[str, dict[str, Any]], config: ModelConfig, rank: int
) -> set[tuple[int, str]]:
    """The (layer, projection) pairs of a complete, well-shaped set of A and B tensors."""
    seen: dict[tuple[int, str], set[str]] = {}
    for name, meta in header.items():
        if _VISION_PART.search(name):
            # A multimodal model's vision tower has layers.<i>.self_attn.q_proj too: refused
            # by name, not mistaken for the language model's layer.
            raise LoRAError(
                f"{name!r} adapts the vision tower or projector; this server serves the "
                "language model only (target its modules alone)"
            )
        match = _TENSOR_NAME.search(name)
        if match is None:
            raise LoRAError(
                f"{WEIGHTS_FILE} holds {name!r}, which is not a LoRA A/B weight of a "
                f"projection this server adapts ({', '.join(TARGETS)})"
            )
        layer, proj, which = int(match.group(1)), match.group(2), match.group(3)
        if layer >= config.num_hidden_layers:
            raise LoRAError(
                f"{name!r} adapts layer {layer}; the base model has {config.num_hidden_layers}"
            )
        if proj in MLP_TARGETS and config.is_sparse_layer(layer):
            raise LoRAError(
                f"{name!r} adapts {proj} of layer {layer}, a mixture-of-experts layer: its "
                "experts are not adapted (adapters may target attention, and the MLPs of "
                "dense layers)"
            )
        if meta.get("dtype") not in _SAFETENSORS_DTYPES:
            raise LoRAError(f"{name!r} has dtype {meta.get('dtype')!r}; expected F32, F16 or BF16")
        in_features, out_features = projection_shape(config, proj)
        expected = [rank, in_features] if which == "A" else [out_features, rank]
        if list(meta.get("shape", [])) != expected:
            raise LoRAError(
                f"{name!r} has shape {meta.get('shape')}; this base model and rank {rank} "
                f"need {expected}"
            )
        parts = seen.setdefault((layer, proj), set())
        if which in parts:
            raise LoRAError(
                f"{WEIGHTS_FILE} holds two lora_{which} weights for layer {layer} {proj}"
            )
        parts.add(which)
    for layer, proj in seen:
        for part in FUSED_TARGETS.get(proj, ()):
            if (layer, part) in seen:
                raise LoRAError(
                    f"{WEIGHTS_FILE} adapts layer {layer} {part} twice: on its own and in {proj}"
                )
    lonely = sorted(key for key, parts in seen.items() if len(parts) != 2)
    if lonely:
        layer, proj = lonely[0]
        raise LoRAError(f"layer {layer} {proj} has only one of lora_A and lora_B")
    if not seen:
        raise LoRAError(f"{WEIGHTS_FILE} holds no LoRA weights")
    return set(seen)


def folder_digest(folder: Path) -> str:
    """sha256 of the adapter's config and weights: equal digests mean equal adapters."""
    h = hashlib.sha256(b"tidegate.lora.v1\x00")
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        h.update(name.encode() + b"\x00")
        with open(folder / name, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
    return h.hexdigest()
