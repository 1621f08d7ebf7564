"""Load a Hugging Face model folder (config.json + *.safetensors) into our fused modules."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from tidegate.engine.attention.backend import AttentionBackend
from tidegate.engine.model.config import (
    MULTIMODAL_PARTS,
    TEXT_OF_MULTIMODAL,
    ModelConfig,
    checkpoint_files,
)
from tidegate.engine.model.layers import Fp8Layout, Linear, MergedLinear, fp8_linears
from tidegate.engine.model.llama import LlamaForCausalLM
from tidegate.engine.model.moe import EXPERT_PROJECTIONS, FusedExperts
from tidegate.engine.model.quantization import (
    KV_SCALE_NAME,
    UNUSED_SCALE_SUFFIXES,
    DequantizedSlice,
    is_scale,
    kv_cache_scale,
    kv_cache_scales,
    resolve_weight_format,
    scaled_weight,
)

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Checkpoint projection name -> (our fused module, shard id).
_FUSED = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
}
# Parameters that hold FP8 weights' scales: filled with their weights, never named apart.
FP8_SCALES = ("weight_scale", "gate_up_scale", "down_scale")
_FUSED_NAME = re.compile(r"\.(" + "|".join(_FUSED) + r")\.")
# One expert's projection: mlp.experts.<e>.<gate_proj|up_proj|down_proj|w1|w3|w2>.weight.
_EXPERT_NAME = re.compile(
    r"\.mlp\.experts\.(\d+)\.(" + "|".join(EXPERT_PROJECTIONS) + r")\.weight$"
)
# A multimodal checkpoint's language model under our names: transformers 4 saved it as
# language_model.model.* (and language_model.lm_head), transformers 5 reads model.language_model.*;
# the vision tower and the projector are not read.
_LANGUAGE_MODEL = re.compile(r"^(?:language_model\.model\.|model\.language_model\.)")
_LANGUAGE_MODEL_HEAD = "language_model.lm_head."
_VISION_PARTS = re.compile(r"^(?:model\.)?(?:" + "|".join(MULTIMODAL_PARTS) + r")\.")


def resolve_dtype(name: str, config: ModelConfig) -> torch.dtype:
    """The dtype for --dtype `name`; "auto" is the checkpoint's, float32 if it names none."""
    if name == "auto":
        name = config.torch_dtype or "float32"
        if name not in DTYPES:
            raise ValueError(f"config.json names dtype {name!r}; pass --dtype explicitly")
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r} is not supported; choose auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype,
    device: torch.device,
    attn_backend: AttentionBackend,
    config: ModelConfig | None = None,
    quantization: str = "auto",
    kv_cache_dtype: torch.dtype | None = None,
) -> tuple[LlamaForCausalLM, ModelConfig]:
    """Build the model on `device` in `dtype` and fill it from the folder's safetensors.

    `config` saves re-reading config.json when the caller has it already. `quantization` is
    the engine's --quantization: how FP8 checkpoints are held, and whether others are
    quantized to FP8 as they load (quantization.py). With an FP8 `kv_cache_dtype` the
    attention layers use the checkpoint's calibrated KV-cache scales, if it has them.
    """
    model_dir = Path(model_dir)
    if config is None:
        config = ModelConfig.from_pretrained(model_dir)
    weight_format = resolve_weight_format(quantization, config.fp8, device)
    layout = None
    if weight_format == "fp8":
        layout = Fp8Layout(config.fp8, triton=attn_backend.name == "triton")
    scales = _checkpoint_scales(model_dir, config) if config.fp8 is not None else {}
    previous_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # layers create their parameters in the default dtype
    try:
        with torch.device(device), fp8_linears(layout):
            model = LlamaForCausalLM(config, attn_backend)
    finally:
        torch.set_default_dtype(previous_dtype)
    if layout is not None and config.fp8 is not None:
        _unquantized_stay(model, scales)
    kv_scales = load_weights(model, _checkpoint_tensors(model_dir), scales)
    if kv_scales and kv_cache_dtype is not None and kv_cache_dtype.itemsize == 1:
        model.use_kv_cache_scales(kv_scales)
    elif kv_scales:
        logger.info(
            "%s has calibrated KV-cache scales; a %s KV cache does not use them "
            "(--kv-cache-dtype fp8 does)",
            model_dir,
            kv_cache_dtype or dtype,
        )
    return model.eval(), config


def load_weights(
    model: LlamaForCausalLM,
    tensors: Iterator[tuple[str, Any]],
    scales: dict[tuple[str, str | None], torch.Tensor] | None = None,
) -> dict[str, tuple[float, float]]:
    """Copy (HF name, tensor) pairs into the model; every parameter must be filled exactly.
    Returns the checkpoint's calibrated KV-cache scales, (k_scale, v_scale) by attention
    module (empty without any), which are no parameter.

    A tensor may also be a lazy safetensors slice: each layer's loader reads only the rows
    or columns its tensor-parallel rank keeps. Under pipeline parallelism the tensors of other
    stages are skipped. `scales` are an FP8 checkpoint's weight scales by our parameter name
    and shard: such a weight goes into an FP8 linear with its scale, or is multiplied out
    as it is read into any other parameter.
    """
    params = dict(model.named_parameters())  # a tied lm_head appears once, as the embedding
    expected = {_shard_key(name, shard) for name, shard in _expected_shards(model)}
    # Merged linears' parameters: a fused checkpoint tensor (no shard id) fills every shard.
    fused = {
        f"{module_name}.{attr}": list(module.output_sizes)
        for module_name, module in model.named_modules()
        if isinstance(module, MergedLinear)
        for attr in ("weight", "bias")
        if getattr(module, attr) is not None
    }
    loaded: set[str] = set()
    unexpected: list[str] = []
    tied = model.config.tie_word_embeddings
    multimodal = model.config.architecture in TEXT_OF_MULTIMODAL
    fp8 = model.config.fp8
    kv_scales: dict[str, dict[str, float]] = {}
    for checkpoint_name, tensor in tensors:
        hf_name = _text_name(checkpoint_name, multimodal)
        if hf_name is None:
            continue  # served as a text model: images are refused before the engine
        kv_scale = KV_SCALE_NAME.match(hf_name)
        if kv_scale is not None:
            kinds = kv_scales.setdefault(kv_scale["attention"], {})
            kinds[kv_scale["kind"]] = kv_cache_scale(checkpoint_name, tensor)
            continue
        if fp8 is not None and (is_scale(hf_name) or hf_name.endswith(UNUSED_SCALE_SUFFIXES)):
            continue  # weight scales were read up front; activation scales are not used
        if hf_name.endswith("rotary_emb.inv_freq") or (tied and hf_name == "lm_head.weight"):
            continue  # recomputed buffers, and the copy of a tied embedding
        name, shard = _our_name(hf_name)
        if not model.holds(name):
            continue  # another pipeline stage's
        scale = (scales or {}).get((name, shard))
        if tied and name == "model.embed_tokens.weight" and name not in params:
            name = "lm_head.weight"  # the last stage's own copy of a tied embedding
        param = params.get(name)
        if param is None:
            unexpected.append(checkpoint_name)
            continue
        with torch.no_grad():
            if scale is None:
                param.weight_loader(param, tensor, shard)  # copy_ converts the dtype
            elif hasattr(param, "scale_loader"):  # an FP8 linear's weight
                param.weight_loader(param, tensor, shard)
                param.scale_loader(scale, fp8, shard)
            else:
                param.weight_loader(param, DequantizedSlice(tensor, scale, fp8), shard)
        filled = fused.get(name, [None]) if shard is None else [shard]
        loaded.update(_shard_key(name, s) for s in filled)
    missing = sorted(expected - loaded)
    if unexpected or missing:
        raise ValueError(
            f"checkpoint does not match {model.config.architecture}: "
            f"missing {missing[:8]}{' ...' if len(missing) > 8 else ''}, "
            f"unexpected {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}"
        )
    return kv_cache_scales(kv_scales)


def _text_name(hf_name: str, multimodal: bool) -> str | None:
    """A checkpoint name as a text model's (a multimodal checkpoint's language model under
    our names), or None for a part of a multimodal model that is not read."""
    if not multimodal:
        return hf_name
    if _VISION_PARTS.match(hf_name):
        return None
    hf_name = _LANGUAGE_MODEL.sub("model.", hf_name, count=1)
    if hf_name.startswith(_LANGUAGE_MODEL_HEAD):
        hf_name = "lm_head." + hf_name.removeprefix(_LANGUAGE_MODEL_HEAD)
    return hf_name


def _checkpoint_scales(
    model_dir: Path, config: ModelConfig
) -> dict[tuple[str, str | None], torch.Tensor]:
    """Every weight scale of an FP8 checkpoint, by the (parameter, shard) of its weight: read
    whole before the weights (they are small: 1/16,384 of a weight's elements for 128 x 128
    blocks), as a weight is scaled when it is read, wherever its scale is stored."""
    multimodal = config.architecture in TEXT_OF_MULTIMODAL
    scales = {}
    for file in checkpoint_files(model_dir):
        with safe_open(model_dir / file, framework="pt", device="cpu") as f:
            for checkpoint_name in f.keys():  # noqa: SIM118 - safe_open handles are not mappings
                hf_name = _text_name(checkpoint_name, multimodal)
                if hf_name is not None and is_scale(hf_name):
                    scales[_our_name(scaled_weight(hf_name))] = f.get_tensor(checkpoint_name)
    if not scales:
        raise ValueError(
            f"config.json says the checkpoint is quantized ({config.fp8.method}), but no "
            f"weight in {model_dir} has a scale"
        )
    return scales


def _unquantized_stay(model: LlamaForCausalLM, scales: dict[tuple[str, str | None], Any]) -> None:
    """Linears built for FP8 whose weights the checkpoint left unquantized (every shard of
    them needs a scale) hold their weights in the model's dtype, as the checkpoint has them."""
    for name, module in model.named_modules():
        if isinstance(module, Linear) and module.weight_scale is not None:
            shards = getattr(module, "output_sizes", None) or [None]
            whole = (f"{name}.weight", None) in scales  # a fused checkpoint tensor's
            if not whole and not all((f"{name}.weight", shard) in scales for shard in shards):
                module.hold_full_precision()
        elif isinstance(module, FusedExperts) and module.gate_up_scale is not None:
            params = ("gate_up_proj", "down_proj")
            keys = [(f"{name}.{p}", s) for p in params for s in module.checkpoint_shards(p)]
            if not all(key in scales for key in keys):
                module.hold_full_precision()


def _our_name(hf_name: str) -> tuple[str, str | None]:
    # Mixtral's sparse block is every other model's `mlp`.
    hf_name = hf_name.replace(".block_sparse_moe.", ".mlp.", 1)
    match = _EXPERT_NAME.search(hf_name)
    if match is not None:
        kind = EXPERT_PROJECTIONS[match.group(2)]
        stacked = "down_proj" if kind == "down" else "gate_up_proj"
        return hf_name[: match.start()] + f".mlp.experts.{stacked}", f"{kind}.{match.group(1)}"
    match = _FUSED_NAME.search(hf_name)
    if match is None:
        return hf_name, None
    fused, shard = _FUSED[match.group(1)]
    return hf_name.replace(match.group(0), f".{fused}.", 1), shard


def _expected_shards(model: LlamaForCausalLM) -> Iterator[tuple[str, str | None]]:
    modules = dict(model.named_modules())
    for name, _ in model.named_parameters():
        owner_name, attr = name.rsplit(".", 1)
        if attr in FP8_SCALES:
            continue  # an FP8 linear's scale is filled with its weight
        owner = modules[owner_name]
        if hasattr(owner, "checkpoint_shards"):
            yield from ((name, s) for s in owner.checkpoint_shards(attr))
            continue
        shards = getattr(owner, "output_sizes", None)
        yield from ((name, s) for s in shards) if shards else [(name, None)]


def _shard_key(name: str, shard: str | None) -> str:
    return name if shard is None else f"{name}[{shard}]"


def _checkpoint_tensors(model_dir: Path) -> Iterator[tuple[str, Any]]:
    """(name, lazy slice) from every file, in the order the index (or the file names) gives."""
    files = checkpoint_files(model_dir)
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    for file in files:
        with safe_open(model_dir / file, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open handles are not mappings
                yield name, f.get_slice(name)
