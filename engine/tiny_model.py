"""Write a deterministic random-weight model folder for tests and demos: Llama, Mistral (with
a sliding window), Qwen2, Qwen3, Gemma 2 and 3, or the mixture-of-experts Qwen3-MoE and
Mixtral.

The folder is a normal Hugging Face model (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json with a chat template, generation_config.json), so transformers loads it
too; that is how tests judge the engine. `quantize` writes the decoder layers' linears as an
FP8 checkpoint instead, in one of the layouts the engine reads (QUANTIZATIONS). The tokenizer is a byte-level BPE trained offline on
`data/tiny_corpus.txt`, so nothing is ever downloaded.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from tidegate.engine.model.config import SEQUENCE_CLASSIFIERS, ModelConfig

CORPUS = Path(__file__).parent / "data" / "tiny_corpus.txt"
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
# Each turn is "<|role|>\n{content}</s>\n"; content may be a string or a list of text parts.
# With tools (Hermes' style): a system turn lists them in <tools></tools> and asks for
# <tool_call> blocks; an assistant turn writes its calls as such blocks, and a tool result is a
# user turn in <tool_response></tool_response>. Without tools the text is what it always was.
# The generation prompt honours Qwen3's enable_thinking variable (chat_template_kwargs).
_CONTENT = (
    "{% if content is string %}{{ content }}"
    "{% elif content %}{% for part in content %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
)
CHAT_TEMPLATE = (
    "{% macro render_content(content) %}" + _CONTENT + "{% endmacro %}"
    "{{ bos_token }}"
    "{% if tools %}"
    "{{ '<|system|>\\n' }}"
    "{% if messages[0]['role'] == 'system' %}"
    "{{ render_content(messages[0]['content']) + '\\n\\n' }}"
    "{% endif %}"
    "{{ '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{% for tool in tools %}{{ '\\n' + (tool | tojson) }}{% endfor %}"
    "{{ '\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call>\' }}'
    "{{ eos_token + '\\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if not (tools and loop.first and message['role'] == 'system') %}"
    "{% if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('roles must be system, user, assistant or tool') }}"
    "{% endif %}"
    "{% if message['role'] == 'tool' %}"
    "{{ '<|user|>\\n<tool_response>\\n' + render_content(message['content']) }}"
    "{{ '\\n</tool_response>' }}"
    "{% else %}"
    "{{ '<|' + message['role'] + '|>\\n' + render_content(message['content']) }}"
    "{% endif %}"
    "{% if message['role'] == 'assistant' and message['tool_calls'] is defined %}"
    "{% for call in message['tool_calls'] or [] %}"
    "{% set call = call['function'] if call['function'] is defined else call %}"
    "{% if message['content'] or not loop.first %}{{ '\\n' }}{% endif %}"
    "{{ '<tool_call>\\n{\"name\": ' + (call['name'] | tojson) + ', \"arguments\": ' }}"
    "{% if call['arguments'] is string %}{{ call['arguments'] }}"
    "{% else %}{{ call['arguments'] | tojson }}{% endif %}"
    "{{ '}\\n</tool_call>' }}"
    "{% endfor %}"
    "{% endif %}"
    "{{ eos_token + '\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}"
    # As Qwen3's template: enable_thinking false (chat_template_kwargs) opens the reply with
    # an empty thinking block.
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
    "{% endif %}"
)
SIZES: dict[str, dict[str, Any]] = {
    "tiny": {
        "vocab_size": 1024,
        # head_dim 32: the smallest vLLM's CPU attention accepts, so peers run the same folder.
        "hidden_size": 128,
        "intermediate_size": 384,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "dtype": "float32",
    },
    "small": {  # ~125M parameters (Llama; ~100M for Qwen2 with tied embeddings)
        "vocab_size": 32000,
        "hidden_size": 768,
        "intermediate_size": 2048,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "num_key_value_heads": 4,
        "dtype": "bfloat16",
    },
}
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "mistral": "MistralForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
}
# config.json's model_type where it is not the --arch name.
_MODEL_TYPES = {"gemma3": "gemma3_text"}
# What each architecture adds to the shape of SIZES, by size. Qwen3's heads are wider than
# hidden_size / heads (as Qwen3's own: 128-wide heads on 1,024 hidden features in the 0.6B).
# Qwen3-MoE's first layer stays dense (mlp_only_layers), so both kinds of layer are tested.
_ARCH_SHAPES: dict[str, dict[str, dict[str, Any]]] = {
    "qwen3": {"tiny": {"head_dim": 64}, "small": {"head_dim": 128}},
    "qwen3_moe": {
        "tiny": {
            "head_dim": 64,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [0],
        },
        "small": {
            "head_dim": 64,
            "num_experts": 16,
            "num_experts_per_tok": 4,
            "moe_intermediate_size": 512,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        },
    },
    # Sliding windows shorter than the tests' prompts, not a multiple of the block size, so
    # windows start mid-block: every layer of Mistral, Gemma 3's by its layer_types.
    "mistral": {"tiny": {"sliding_window": 40}, "small": {"sliding_window": 256}},
    # Gemma 2: every other layer windowed, and attention scores capped low enough (real
    # models: 50) that the cap bends many of them, so a missed or misplaced cap shows.
    "gemma2": {
        "tiny": {
            "head_dim": 64,
            "query_pre_attn_scalar": 48,
            "sliding_window": 24,
            "layer_types": ["sliding_attention", "full_attention"],
            "attn_logit_softcapping": 2.0,
            "final_logit_softcapping": 30.0,
        },
        "small": {
            "sliding_window": 256,
            "layer_types": ["sliding_attention", "full_attention"],
            "query_pre_attn_scalar": 64,
            "attn_logit_softcapping": 50.0,
            "final_logit_softcapping": 30.0,
        },
    },
    # Gemma 3: a scale that is not head_dim's, and a final logit cap (Gemma 2's; Gemma 3's
    # configuration class takes it too), so both paths are exercised.
    "gemma3": {
        "tiny": {
            "head_dim": 64,
            "query_pre_attn_scalar": 48,
            "sliding_window": 24,
            "layer_types": ["sliding_attention", "full_attention"],
            "final_logit_softcapping": 30.0,
        },
        "small": {
            "sliding_window": 256,
            "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
            "query_pre_attn_scalar": 64,
        },
    },
    # Mixtral's intermediate_size is each expert's.
    "mixtral": {
        "tiny": {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 192},
        "small": {"num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 1024},
    },
}
# Weights ~ N(0, (GAIN / sqrt(fan_in))^2): large enough that greedy picks win by clear logit
# margins (float noise never flips them), small enough that generations do not collapse.
GAIN = 2.0


def make_tiny_model(
    out_dir: str | Path,
    arch: str = "llama",
    size: str = "tiny",
    seed: int = 0,
    rope_scaling: dict[str, Any] | None = None,
    quantize: str | None = None,
    num_labels: int = 0,
) -> Path:
    """Write the model folder to out_dir; the same arguments always give the same bytes.

    With `num_labels`, a sequence classifier (the architecture's *ForSequenceClassification:
    a `score` head of that many labels in place of the LM head, the same decoder weights)."""
    if quantize is not None and quantize not in QUANTIZATIONS:
        raise ValueError(
            f"quantize {quantize!r} is not supported; choose {', '.join(QUANTIZATIONS)}"
        )
    if arch not in ARCHITECTURES:
        raise ValueError(f"arch {arch!r} is not supported; choose {', '.join(ARCHITECTURES)}")
    if size not in SIZES:
        raise ValueError(f"size {size!r} is not supported; choose {', '.join(SIZES)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(SIZES[size]["vocab_size"])
    config = _config(arch, size, tokenizer.get_vocab_size(), rope_scaling)
    tokenizer.save(str(out / "tokenizer.json"), pretty=True)
    weights = _random_weights(config, tokenizer.get_vocab_size(), seed)
    if arch == "phi3":
        _fuse_projections(weights, config["num_hidden_layers"])
    if num_labels:
        _as_classifier(config, weights, num_labels, seed)
    if quantize is not None:
        block = 32 if size == "tiny" else 128
        config["quantization_config"] = QUANTIZATIONS[quantize](weights, block)
    _write_json(out / "config.json", config)
    _write_json(out / "tokenizer_config.json", _tokenizer_config(config))
    _write_json(out / "special_tokens_map.json", _special_tokens_map())
    _write_json(
        out / "generation_config.json",
        {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID},
    )
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    # safetensors writes 0600; give it the permissions of the files written above.
    (out / "model.safetensors").chmod((out / "config.json").stat().st_mode & 0o777)
    return out


def _as_classifier(
    config: dict[str, Any], weights: dict[str, torch.Tensor], num_labels: int, seed: int
) -> None:
    """Make the folder a sequence classifier: its *ForSequenceClassification architecture,
    labels, and a random `score` head [num_labels, hidden] instead of the LM head."""
    name = config["architectures"][0].replace("ForCausalLM", "ForSequenceClassification")
    if name not in SEQUENCE_CLASSIFIERS or num_labels < 1:
        raise ValueError(f"no sequence classifier of {num_labels} labels for {name}")
    labels = [f"LABEL_{i}" for i in range(num_labels)]
    config["architectures"] = [name]
    config["id2label"] = dict(enumerate(labels))
    config["label2id"] = {label: i for i, label in enumerate(labels)}
    config["pad_token_id"] = PAD_ID  # transformers' classifiers find each row's last token by it
    weights.pop("lm_head.weight", None)
    hidden = config["hidden_size"]
    generator = torch.Generator().manual_seed(seed + 1)
    score = torch.randn(num_labels, hidden, generator=generator) * GAIN / math.sqrt(hidden)
    weights["score.weight"] = score.to(getattr(torch, config["torch_dtype"]))


def train_tokenizer(vocab_size: int) -> Tokenizer:
    """A byte-level BPE over the shipped corpus (it may stop short of vocab_size)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    # Like Llama's tokenizers: <s> in front of every encoded text unless asked not to.
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s>:0 $A:0", pair="<s>:0 $A:0 <s>:1 $B:1", special_tokens=[("<s>", BOS_ID)]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = CORPUS.read_text(encoding="utf-8").splitlines(keepends=True)
    tokenizer.train_from_iterator(lines, trainer=trainer)
    return tokenizer


def _config(
    arch: str, size: str, tokenizer_vocab: int, rope_scaling: dict[str, Any] | None
) -> dict[str, Any]:
    shape = dict(SIZES[size])
    dtype = shape.pop("dtype")
    # A tokenizer trained on a small corpus stops short of a large vocab; the rest are padding.
    shape["vocab_size"] = max(shape["vocab_size"], tokenizer_vocab)
    shape["head_dim"] = shape["hidden_size"] // shape["num_attention_heads"]
    shape.update(_ARCH_SHAPES.get(arch, {}).get(size, {}))
    config = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": _MODEL_TYPES.get(arch, arch),
        **shape,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": rope_scaling,
        # Tiny Qwen2 and Qwen3 exercise tied embeddings; the others keep a separate lm_head
        # (Gemma ties it; here the untied head keeps random generations varied, see below).
        "tie_word_embeddings": arch in ("qwen2", "qwen3"),
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "initializer_range": 0.02,
        "torch_dtype": dtype,
        "use_cache": True,
    }
    if arch == "llama":
        config.update(attention_bias=False, mlp_bias=False)
    elif arch == "mixtral":
        config.update(sliding_window=None)
    elif arch == "mistral":
        pass
    elif arch == "phi3":
        # Phi-4-mini's shape of RoPE: the first 3/4 of each head rotated, LongRoPE factors
        # (short up to the 512 pretraining positions, long beyond), and Phi-3-mini's window on
        # every layer.
        rotary_pairs = int(shape["head_dim"] * 0.75) // 2
        config.update(
            partial_rotary_factor=0.75,
            original_max_position_embeddings=512,
            rope_scaling={
                "rope_type": "longrope",
                "short_factor": [1.0 + 0.05 * i for i in range(rotary_pairs)],
                "long_factor": [1.0 + 0.5 * i for i in range(rotary_pairs)],
            },
            sliding_window=64,
            attention_bias=False,
        )
    elif arch == "gemma2":
        del config["hidden_act"]  # Gemma names it hidden_activation
        config.update(hidden_activation="gelu_pytorch_tanh", attention_bias=False)
        _repeat_layer_types(config)
    elif arch == "gemma3":
        # Gemma names its activation hidden_activation and keys RoPE by layer type: the
        # sliding layers' local base frequency differs from the full layers'.
        del config["hidden_act"], config["rope_theta"], config["rope_scaling"]
        _repeat_layer_types(config)
        full = {"rope_type": "default", "rope_theta": 1_000_000.0}
        if rope_scaling:
            full.update(rope_scaling)
        config.update(
            hidden_activation="gelu_pytorch_tanh",
            rope_parameters={
                "full_attention": full,
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            },
            attention_bias=False,
            attn_logit_softcapping=None,
        )
    else:
        config.update(
            use_sliding_window=False,
            sliding_window=None,
            max_window_layers=shape["num_hidden_layers"],
        )
    return config


def _fuse_projections(weights: dict[str, torch.Tensor], layers: int) -> None:
    """Phi-3's checkpoint names: q, k and v stacked in `qkv_proj`, gate and up in
    `gate_up_proj`."""
    for i in range(layers):
        p = f"model.layers.{i}."
        for fused, parts in (
            ("self_attn.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
            ("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj")),
        ):
            tensors = [weights.pop(f"{p}{part}.weight") for part in parts]
            weights[f"{p}{fused}.weight"] = torch.cat(tensors)


def _repeat_layer_types(config: dict[str, Any]) -> None:
    """Gemma's layer_types from the pattern _ARCH_SHAPES gives, over every layer."""
    pattern = config["layer_types"]
    config["layer_types"] = [pattern[i % len(pattern)] for i in range(config["num_hidden_layers"])]


def _random_weights(
    config: dict[str, Any], tokenizer_vocab: int, seed: int
) -> dict[str, torch.Tensor]:
    """Checkpoint tensors under Hugging Face names, drawn in a fixed order from `seed`."""
    generator = torch.Generator().manual_seed(seed)
    hidden = config["hidden_size"]
    q_size = config["num_attention_heads"] * config["head_dim"]
    kv_size = config["num_key_value_heads"] * config["head_dim"]
    dtype = getattr(torch, config["torch_dtype"])

    def normal(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * std).to(dtype)

    def linear(out_features: int, in_features: int) -> torch.Tensor:
        return normal(out_features, in_features, std=GAIN / math.sqrt(in_features))

    gemma = config["model_type"] in ("gemma2", "gemma3_text")

    def norm(size: int = hidden) -> torch.Tensor:
        # Gemma stores an RMSNorm's weight as w - 1.
        return (float(not gemma) + normal(size, std=0.1)).to(dtype)

    # Which layers have experts, how many and how wide: as the engine reads config.json.
    model = ModelConfig.from_dict(config)
    embedding = linear(config["vocab_size"], hidden)
    if gemma:
        # Gemma multiplies the embedding by sqrt(hidden): drawn as large as the others', each
        # token's own embedding would swamp the residual stream, and generations repeat it.
        embedding /= math.sqrt(hidden)
    weights = {"model.embed_tokens.weight": embedding}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights[p + "input_layernorm.weight"] = norm()
        for name, out_features in (("q", q_size), ("k", kv_size), ("v", kv_size)):
            weights[f"{p}self_attn.{name}_proj.weight"] = linear(out_features, hidden)
            if config["model_type"] == "qwen2":
                weights[f"{p}self_attn.{name}_proj.bias"] = normal(out_features, std=0.1)
        if config["model_type"] in ("qwen3", "qwen3_moe", "gemma3_text"):
            weights[p + "self_attn.q_norm.weight"] = norm(config["head_dim"])
            weights[p + "self_attn.k_norm.weight"] = norm(config["head_dim"])
        weights[p + "self_attn.o_proj.weight"] = linear(hidden, q_size)
        weights[p + "post_attention_layernorm.weight"] = norm()
        if gemma:
            weights[p + "pre_feedforward_layernorm.weight"] = norm()
            weights[p + "post_feedforward_layernorm.weight"] = norm()
        weights.update(_mlp_weights(config, model, i, linear))
    weights["model.norm.weight"] = norm()
    if not config["tie_word_embeddings"]:
        weights["lm_head.weight"] = linear(config["vocab_size"], hidden)
    # Padding ids have no text: zero output rows give them logit 0, far below the top real
    # token, so greedy decoding never produces them.
    head = weights.get("lm_head.weight", weights["model.embed_tokens.weight"])
    head[tokenizer_vocab:] = 0
    return weights


def _mlp_weights(
    config: dict[str, Any],
    model: ModelConfig,
    layer: int,
    linear: Callable[[int, int], torch.Tensor],
) -> dict[str, torch.Tensor]:
    """One layer's feed-forward under its checkpoint names: a SwiGLU MLP, or a router and
    experts (Qwen3-MoE's `mlp.experts.<e>.gate_proj`, Mixtral's `block_sparse_moe.experts.<e>.w1`)."""
    hidden = config["hidden_size"]
    p = f"model.layers.{layer}."
    if not model.is_sparse_layer(layer):
        inter = config["intermediate_size"]
        return {
            p + "mlp.gate_proj.weight": linear(inter, hidden),
            p + "mlp.up_proj.weight": linear(inter, hidden),
            p + "mlp.down_proj.weight": linear(hidden, inter),
        }
    assert model.moe is not None
    experts, inter = model.moe.num_experts, model.moe.intermediate_size
    if config["model_type"] == "mixtral":
        block, names = "block_sparse_moe", ("w1", "w3", "w2")
    else:
        block, names = "mlp", ("gate_proj", "up_proj", "down_proj")
    weights = {f"{p}{block}.gate.weight": linear(experts, hidden)}
    for e in range(experts):
        gate, up, down = (f"{p}{block}.experts.{e}.{name}.weight" for name in names)
        weights[gate] = linear(inter, hidden)
        weights[up] = linear(inter, hidden)
        weights[down] = linear(hidden, inter)
    return weights


def _tokenizer_config(config: dict[str, Any]) -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "additional_special_tokens": SPECIAL_TOKENS[3:],
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": config["max_position_embeddings"],
        # Byte-level BPE reproduces text exactly; HF's space clean-up would break that.
        "clean_up_tokenization_spaces": False,
    }


def _special_tokens_map() -> dict[str, Any]:
    return {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "additional_special_tokens": SPECIAL_TOKENS[3:],
    }


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


# --- FP8 checkpoints -------------------------------------------------------------------------

FP8_MAX = 448.0  # float8_e4m3fn's largest finite value


def _quantized_names(weights: dict[str, torch.Tensor]) -> list[str]:
    """The decoder layers' linear weights, as quantizers pick them: not the embedding, the LM
    head, norms, or a mixture's router (`mlp.gate`, `block_sparse_moe.gate`)."""
    return [
        name
        for name, tensor in weights.items()
        if ".layers." in name and tensor.dim() == 2 and not name.endswith(".gate.weight")
    ]


def _fp8(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (weight.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def _quantize_blocks(weights: dict[str, torch.Tensor], block: int) -> dict[str, Any]:
    """transformers' fine-grained FP8 (DeepSeek-V3, Qwen3-FP8): a float32 scale per block x
    block tile in `weight_scale_inv`, activations quantized per token at run time."""
    for name in _quantized_names(weights):
        weight = weights[name].float()
        rows, cols = weight.shape
        tiles = torch.nn.functional.pad(weight, (0, -cols % block, 0, -rows % block))
        tiles = tiles.view(tiles.shape[0] // block, block, tiles.shape[1] // block, block)
        scale = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
        full = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[:rows, :cols]
        weights[name] = _fp8(weight, full)
        weights[name.removesuffix(".weight") + ".weight_scale_inv"] = scale
    return {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [block, block],
    }


def _quantize_channels(weights: dict[str, torch.Tensor], block: int) -> dict[str, Any]:
    """llm-compressor's FP8_DYNAMIC (compressed-tensors): a scale per output channel in
    `weight_scale` [out, 1], activations per token at run time."""
    for name in _quantized_names(weights):
        weight = weights[name].float()
        scale = weight.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / FP8_MAX
        weights[name] = _fp8(weight, scale)
        weights[name.removesuffix(".weight") + ".weight_scale"] = scale
    return _compressed_tensors("channel", {"strategy": "token", "dynamic": True})


def _quantize_tensors(weights: dict[str, torch.Tensor], block: int) -> dict[str, Any]:
    """llm-compressor's FP8 (compressed-tensors, static): one scale per tensor in
    `weight_scale` [1], and a calibrated activation scale in `input_scale` [1]."""
    for name in _quantized_names(weights):
        weight = weights[name].float()
        scale = (weight.abs().amax() / FP8_MAX).reshape(1)
        weights[name] = _fp8(weight, scale)
        prefix = name.removesuffix(".weight")
        weights[prefix + ".weight_scale"] = scale
        weights[prefix + ".input_scale"] = torch.tensor([0.01])
    return _compressed_tensors("tensor", {"strategy": "tensor", "dynamic": False})


def _compressed_tensors(strategy: str, activations: dict[str, Any]) -> dict[str, Any]:
    scheme = {"num_bits": 8, "type": "float", "symmetric": True}
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "ignore": ["lm_head", "re:.*mlp.gate$"],
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {**scheme, "strategy": strategy, "dynamic": False},
                "input_activations": {**scheme, **activations},
            }
        },
    }


QUANTIZATIONS: dict[str, Callable[[dict[str, torch.Tensor], int], dict[str, Any]]] = {
    "fp8-block": _quantize_blocks,
    "fp8-channel": _quantize_channels,
    "fp8-tensor": _quantize_tensors,
}
