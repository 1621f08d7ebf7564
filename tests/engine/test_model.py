"""Our model code gives transformers' logits and greedy tokens on the same folder."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

from tidegate.engine import LLM, SamplingParams
from tidegate.engine.attention import TorchAttentionBackend
from tidegate.engine.attention.backend import AttentionMetadata
from tidegate.engine.model.config import ModelConfig
from tidegate.engine.model.loader import load_model, resolve_dtype
from tidegate.engine.tiny_model import make_tiny_model

BLOCK_SIZE = 16
NUM_BLOCKS = 64
FP32_ATOL = 1e-4


class PagedRun:
    """Drives our model like the engine does: flat batches over a paged KV cache."""

    def __init__(self, model_dir: Path, dtype: torch.dtype = torch.float32, seed: int = 0) -> None:
        self.model, self.config = load_model(
            model_dir, dtype, torch.device("cpu"), TorchAttentionBackend()
        )
        shape = (NUM_BLOCKS, BLOCK_SIZE, self.config.num_key_value_heads, self.config.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
            for _ in range(self.config.num_hidden_layers)
        ]
        self.free_blocks = list(range(NUM_BLOCKS))
        random.Random(seed).shuffle(self.free_blocks)  # non-contiguous block ids
        self.tables: dict[int, list[int]] = {}

    @torch.inference_mode()
    def step(self, chunks: list[tuple[int, list[int], int]]) -> list[torch.Tensor]:
        """Run (seq_id, new token ids, context_len) chunks together; logits per chunk."""
        ids, positions, slots, starts, seq_lens, tables = [], [], [], [0], [], []
        for seq_id, tokens, context_len in chunks:
            seq_len = context_len + len(tokens)
            table = self.tables.setdefault(seq_id, [])
            while len(table) * BLOCK_SIZE < seq_len:
                table.append(self.free_blocks.pop())
            ids += tokens
            positions += range(context_len, seq_len)
            slots += [
                table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
                for p in range(context_len, seq_len)
            ]
            starts.append(starts[-1] + len(tokens))
            seq_lens.append(seq_len)
            tables.append(table)
        width = max(len(t) for t in tables)
        query_start_loc = torch.tensor(starts, dtype=torch.int32)
        lens = torch.tensor(seq_lens, dtype=torch.int32)
        meta = AttentionMetadata(
            query_start_loc=query_start_loc,
            seq_lens=lens,
            block_table=torch.tensor(
                [t + [0] * (width - len(t)) for t in tables], dtype=torch.int32
            ),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            num_seqs=len(chunks),
            num_tokens=len(ids),
            max_query_len=max(len(c[1]) for c in chunks),
            max_seq_len=max(seq_lens),
            query_start_loc_cpu=query_start_loc.clone(),
            seq_lens_cpu=lens.clone(),
        )
        hidden = self.model(torch.tensor(ids), torch.tensor(positions), self.kv_caches, meta)
        logits = self.model.compute_logits(hidden)
        return [logits[starts[i] : starts[i + 1]] for i in range(len(chunks))]


def hf_logits(model_dir: Path, prompts: list[list[int]], dtype=torch.float32) -> list[torch.Tensor]:
    """transformers' logits for every position of each prompt, one prompt at a time."""
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    with torch.inference_mode():
        return [hf(torch.tensor([p])).logits[0].float() for p in prompts]


def random_prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 1000) for _ in range(n)] for n in lengths]


@pytest.fixture(params=["llama", "qwen2", "mistral", "gemma2", "gemma3"])
def model_dir(request) -> Path:
    """Mistral windows every layer (40 tokens) and Gemma one of two (24 tokens): shorter
    than the longer prompts, so the windows are exercised across chunks and decodes; Gemma 2
    caps its attention scores."""
    return request.getfixturevalue(f"tiny_{request.param}_dir")


def test_full_prompts_in_one_batch_match_transformers(model_dir):
    prompts = random_prompts([5, 40, 1, 17, 33])
    run = PagedRun(model_dir)
    got = run.step([(i, p, 0) for i, p in enumerate(prompts)])
    for ours, ref in zip(got, hf_logits(model_dir, prompts), strict=True):
        torch.testing.assert_close(ours, ref, atol=FP32_ATOL, rtol=0)


def test_chunked_prefill_and_mixed_decodes_match_transformers(model_dir):
    # Teacher forcing: sequences are fed in pieces; every position must match a full forward.
    seqs = random_prompts([45, 30, 12], seed=1)
    expected = hf_logits(model_dir, seqs)
    run = PagedRun(model_dir, seed=3)
    got: dict[int, list[torch.Tensor]] = {0: [], 1: [], 2: []}
    schedule = [
        [(0, 0, 20), (1, 0, 23), (2, 0, 5)],  # (seq, context_len, query_len): fresh prefills
        [(0, 20, 21), (1, 23, 1), (2, 5, 4)],  # chunk after context, a decode, another chunk
        [(2, 9, 1), (0, 41, 1), (1, 24, 1)],  # decodes in a different order
        [(1, 25, 3), (0, 42, 1), (2, 10, 1)],
        [(0, 43, 1), (2, 11, 1), (1, 28, 2)],
        [(0, 44, 1)],
    ]
    for step in schedule:
        chunks = [(s, seqs[s][c : c + q], c) for s, c, q in step]
        for (s, _, _), logits in zip(step, run.step(chunks), strict=True):
            got[s].append(logits)
    for s, seq in enumerate(seqs):
        ours = torch.cat(got[s])
        assert ours.shape[0] == len(seq)
        torch.testing.assert_close(ours, expected[s], atol=FP32_ATOL, rtol=0)


def test_greedy_generation_matches_transformers(model_dir):
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    texts = ["The weather today is", "def fibonacci(n):", "A language model server spends"]
    prompts = [tokenizer(t).input_ids for t in texts]
    max_new = 20
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    expected = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = hf.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False
        )
        expected.append(out[0, len(prompt) :].tolist())

    run = PagedRun(model_dir)
    eos = set(run.config.eos_token_ids)
    outputs = [
        [int(logits[-1].argmax())]
        for logits in run.step([(i, p, 0) for i, p in enumerate(prompts)])
    ]
    for _ in range(max_new - 1):
        live = [i for i, o in enumerate(outputs) if o[-1] not in eos and len(o) < max_new]
        if not live:
            break
        chunks = [(i, [outputs[i][-1]], len(prompts[i]) + len(outputs[i]) - 1) for i in live]
        for i, logits in zip(live, run.step(chunks), strict=True):
            outputs[i].append(int(logits[-1].argmax()))
    assert outputs == expected
    assert all(len(set(o)) > 3 for o in outputs), "random weights should not repeat one token"


ROPE_SCALINGS = {
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        # Short, so that the test's positions cover low, medium and high frequencies.
        "original_max_position_embeddings": 64,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
    "linear": {"rope_type": "linear", "factor": 2.0},
}


@pytest.mark.parametrize("kind", list(ROPE_SCALINGS))
def test_rope_scaling_matches_transformers(tmp_path, kind):
    model_dir = make_tiny_model(tmp_path, arch="llama", rope_scaling=ROPE_SCALINGS[kind])
    prompts = random_prompts([130, 7], seed=2)
    got = PagedRun(model_dir).step([(i, p, 0) for i, p in enumerate(prompts)])
    for ours, ref in zip(got, hf_logits(model_dir, prompts), strict=True):
        torch.testing.assert_close(ours, ref, atol=FP32_ATOL, rtol=0)


def test_gemma3_rope_scaling_is_the_full_layers_only(tmp_path):
    # As Gemma 3 4B and up: linear scaling on full-attention layers; sliding ones keep their
    # own base frequency unscaled.
    model_dir = make_tiny_model(tmp_path, arch="gemma3", rope_scaling=ROPE_SCALINGS["linear"])
    config = ModelConfig.from_pretrained(model_dir)
    assert config.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert config.local_rope == (10_000.0, None)
    prompts = random_prompts([70, 9], seed=5)
    got = PagedRun(model_dir).step([(i, p, 0) for i, p in enumerate(prompts)])
    for ours, ref in zip(got, hf_logits(model_dir, prompts), strict=True):
        torch.testing.assert_close(ours, ref, atol=FP32_ATOL, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_bfloat16_logits_close_to_float32(arch, request):
    model_dir = request.getfixturevalue(f"tiny_{arch}_dir")
    prompts = random_prompts([30, 1, 12], seed=4)
    chunks = [(i, p, 0) for i, p in enumerate(prompts)]
    full = torch.cat(PagedRun(model_dir).step(chunks))
    half = torch.cat(PagedRun(model_dir, dtype=torch.bfloat16).step(chunks))
    assert half.dtype == torch.float32
    assert (half - full).abs().max() < 0.05 * full.abs().max()
    assert (half.argmax(-1) == full.argmax(-1)).float().mean() > 0.9


def test_same_seed_gives_identical_files_across_processes(tmp_path, tiny_llama_dir):
    script = "import sys; from tidegate.engine.tiny_model import make_tiny_model; make_tiny_model(sys.argv[1])"
    subprocess.run([sys.executable, "-c", script, str(tmp_path / "again")], check=True)
    names = sorted(p.name for p in tiny_llama_dir.iterdir())
    assert names == sorted(p.name for p in (tmp_path / "again").iterdir())
    for name in names:
        assert (tiny_llama_dir / name).read_bytes() == (tmp_path / "again" / name).read_bytes(), (
            name
        )


def test_different_seed_gives_different_weights(tmp_path, tiny_llama_dir):
    other = make_tiny_model(tmp_path, arch="llama", seed=1)
    a, b = load_file(tiny_llama_dir / "model.safetensors"), load_file(other / "model.safetensors")
    assert a.keys() == b.keys()
    assert not torch.equal(a["model.embed_tokens.weight"], b["model.embed_tokens.weight"])
    assert (tiny_llama_dir / "tokenizer.json").read_bytes() == (
        other / "tokenizer.json"
    ).read_bytes()


@settings(max_examples=60, deadline=None)
@given(text=st.text(max_size=80))
def test_tokenizer_round_trips_any_text(tokenizer_pair, text):
    hf, raw = tokenizer_pair
    ids = hf(text, add_special_tokens=False).input_ids
    assert raw.encode(text, add_special_tokens=False).ids == ids
    assert hf.decode(ids) == text
    assert raw.decode(ids, skip_special_tokens=False) == text


@pytest.fixture(scope="module")
def tokenizer_pair(tiny_llama_dir):
    return AutoTokenizer.from_pretrained(tiny_llama_dir), Tokenizer.from_file(
        str(tiny_llama_dir / "tokenizer.json")
    )


def test_tokenizer_adds_bos_and_knows_special_tokens(tokenizer_pair):
    hf, _ = tokenizer_pair
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (1, 2, 0)
    assert hf("hello").input_ids[0] == 1
    assert hf.convert_tokens_to_ids("<|user|>") == 4


def test_chat_template_renders_turns(tokenizer_pair):
    hf, _ = tokenizer_pair
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": [{"type": "text", "text": "More?"}]},
    ]
    text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<s><|system|>\nBe brief.</s>\n<|user|>\nHi</s>\n<|assistant|>\nHello.</s>\n"
        "<|user|>\nMore?</s>\n<|assistant|>\n"
    )
    ids = hf.apply_chat_template(messages[:2], add_generation_prompt=False)["input_ids"]
    assert ids[:2] == [1, 3] and ids.count(2) == 2  # <s><|system|>, one </s> per turn
    with pytest.raises(Exception, match="roles must be"):
        hf.apply_chat_template([{"role": "robot", "content": "x"}], tokenize=False)


def test_config_reads_both_architectures(tiny_llama_dir, tiny_qwen2_dir):
    llama = ModelConfig.from_pretrained(tiny_llama_dir)
    qwen2 = ModelConfig.from_pretrained(tiny_qwen2_dir)
    assert (llama.qkv_bias, llama.tie_word_embeddings) == (False, False)
    assert (qwen2.qkv_bias, qwen2.o_proj_bias, qwen2.tie_word_embeddings) == (True, False, True)
    assert llama.head_dim == 32 and llama.num_key_value_heads == 2
    assert llama.eos_token_ids == [2] and llama.torch_dtype == "float32"
    assert resolve_dtype("auto", llama) == torch.float32
    assert resolve_dtype("bfloat16", llama) == torch.bfloat16


# Gemma 3 1B's config.json as published (transformers 4 keys): no layer_types, a window
# pattern, the local base frequency apart, defaults for head_dim and tied embeddings.
GEMMA3_1B = {
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "attention_bias": False,
    "attn_logit_softcapping": None,
    "bos_token_id": 2,
    "eos_token_id": [1, 106],
    "final_logit_softcapping": None,
    "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 1152,
    "intermediate_size": 6912,
    "max_position_embeddings": 32768,
    "num_attention_heads": 4,
    "num_hidden_layers": 26,
    "num_key_value_heads": 1,
    "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06,
    "rope_local_base_freq": 10000,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": 512,
    "sliding_window_pattern": 6,
    "torch_dtype": "bfloat16",
    "vocab_size": 262144,
}


@pytest.mark.parametrize(
    "changes",
    [{}, {"rope_scaling": {"rope_type": "linear", "factor": 8.0}, "sliding_window_pattern": 4}],
    ids=["1b", "4b-style"],
)
def test_gemma3_config_reads_as_transformers_does(changes):
    from transformers import Gemma3TextConfig

    raw = {**GEMMA3_1B, **changes}
    config = ModelConfig.from_dict(raw)
    reference = Gemma3TextConfig(**{k: v for k, v in raw.items() if k != "architectures"})
    sliding = [t == "sliding_attention" for t in reference.layer_types]
    assert config.layer_windows == tuple(512 if s else 0 for s in sliding)
    assert 0 < sum(sliding) < len(sliding)
    full, local = (reference.rope_parameters[k] for k in ("full_attention", "sliding_attention"))
    assert config.rope_theta == full["rope_theta"] and config.local_rope[0] == local["rope_theta"]
    assert (config.rope_scaling or {}).get("factor") == full.get("factor")
    assert config.head_dim == reference.head_dim == 256
    assert config.attention_scale == 256**-0.5 and config.hidden_act == "gelu_tanh"
    assert config.tie_word_embeddings and config.qk_norm and config.gemma_layout
    assert config.eos_token_ids == [1, 106] and config.max_model_len == 32768


# Gemma 2 2B's config.json as published: no layer_types (every other layer windowed).
GEMMA2_2B = {
    "architectures": ["Gemma2ForCausalLM"],
    "model_type": "gemma2",
    "attn_logit_softcapping": 50.0,
    "bos_token_id": 2,
    "eos_token_id": [1, 107],
    "final_logit_softcapping": 30.0,
    "head_dim": 256,
    "hidden_act": "gelu_pytorch_tanh",
    "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "max_position_embeddings": 8192,
    "num_attention_heads": 8,
    "num_hidden_layers": 26,
    "num_key_value_heads": 4,
    "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000.0,
    "sliding_window": 4096,
    "torch_dtype": "float32",
    "vocab_size": 256000,
}


def test_gemma2_config_reads_as_transformers_does():
    from transformers import Gemma2Config

    config = ModelConfig.from_dict(GEMMA2_2B)
    reference = Gemma2Config(**{k: v for k, v in GEMMA2_2B.items() if k != "architectures"})
    sliding = [t == "sliding_attention" for t in reference.layer_types]
    assert config.layer_windows == tuple(4096 if s else 0 for s in sliding)
    assert config.layer_windows[:2] == (4096, 0)  # the first layer is windowed
    assert (config.attn_logit_softcapping, config.final_logit_softcapping) == (50.0, 30.0)
    assert not config.qk_norm and config.local_rope is None and config.rope_theta == 10000.0
    assert config.tie_word_embeddings and config.gemma_layout
    assert config.attention_scale == 256**-0.5 and config.eos_token_ids == [1, 107]


def test_sliding_windows_of_mistral_and_llama():
    mistral = {**GEMMA3_1B, "architectures": ["MistralForCausalLM"], "sliding_window": 4096}
    assert ModelConfig.from_dict(mistral).layer_windows == (4096,) * 26
    # The whole context, not capped at the window: the window is computed exactly.
    assert ModelConfig.from_dict(mistral).max_model_len == 32768
    llama = {**mistral, "architectures": ["LlamaForCausalLM"]}
    assert ModelConfig.from_dict(llama).layer_windows == (0,) * 26


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({"hidden_activation": "gelu"}, "hidden_act 'gelu' is not supported"),
        ({"layer_types": ["sliding_attention"] * 3}, "names 3 layers, not 26"),
        ({"layer_types": ["chunked_attention"] * 26}, "chunked_attention"),
    ],
)
def test_gemma3_options_it_cannot_compute_are_refused(changes, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict({**GEMMA3_1B, **changes})


def test_unsupported_configs_are_rejected_clearly(tiny_llama_dir):
    raw = json.loads((tiny_llama_dir / "config.json").read_text())
    with pytest.raises(ValueError, match="supported: LlamaForCausalLM"):
        ModelConfig.from_dict({**raw, "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(ValueError, match="'dynamic' is not supported"):
        ModelConfig.from_dict({**raw, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}})
    with pytest.raises(ValueError, match="dtype 'float8' is not supported"):
        resolve_dtype("float8", ModelConfig.from_dict(raw))


def test_loader_names_missing_and_unexpected_tensors(tmp_path, tiny_llama_dir):
    for name in ("config.json", "tokenizer.json"):
        (tmp_path / name).write_bytes((tiny_llama_dir / name).read_bytes())
    weights = load_file(tiny_llama_dir / "model.safetensors")
    weights["model.layers.0.mlp.extra.weight"] = weights.pop(
        "model.layers.1.self_attn.k_proj.weight"
    )
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(ValueError) as error:
        load_model(tmp_path, torch.float32, torch.device("cpu"), TorchAttentionBackend())
    assert "model.layers.1.self_attn.qkv_proj.weight[k]" in str(error.value)
    assert "model.layers.0.mlp.extra.weight" in str(error.value)


def _multimodal_gemma3(text_dir: Path, out: Path, names: str) -> Path:
    """A Gemma3ForConditionalGeneration folder around the tiny Gemma 3's language model (a
    tiny vision tower beside it), its tensors under transformers 4's names ("v4":
    language_model.model.*, as Gemma 3 4B and up are published) or 5's (model.language_model.*).
    Its embedding is tied to the LM head, as those models' are."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    raw = json.loads((text_dir / "config.json").read_text())
    top = ("architectures", "torch_dtype", "bos_token_id", "eos_token_id", "pad_token_id")
    text_config = {k: v for k, v in raw.items() if k not in top}
    # Tied, and no final logit cap (transformers' multimodal class would not apply one): as
    # the published models.
    text_config.update(tie_word_embeddings=True, final_logit_softcapping=None)
    vocab = raw["vocab_size"]
    config = Gemma3Config(
        text_config=text_config,
        vision_config={
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "image_size": 28,
            "patch_size": 14,
        },
        mm_tokens_per_image=4,
        boi_token_index=vocab - 3,
        eoi_token_index=vocab - 2,
        image_token_index=vocab - 1,
        bos_token_id=raw["bos_token_id"],
        eos_token_id=raw["eos_token_id"],
        pad_token_id=raw["pad_token_id"],
    )
    torch.manual_seed(0)
    hf = Gemma3ForConditionalGeneration(config).eval()
    weights = load_file(text_dir / "model.safetensors")
    language_model = {
        k.removeprefix("model."): v for k, v in weights.items() if k != "lm_head.weight"
    }
    hf.model.language_model.load_state_dict(language_model, strict=True)
    hf.save_pretrained(out)  # transformers 4's names, as it saves them for the Hub
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (out / name).write_bytes((text_dir / name).read_bytes())
    if names == "v5":
        saved = load_file(out / "model.safetensors")
        renamed = {
            k.replace("language_model.model.", "model.language_model.", 1)
            .replace("vision_tower.", "model.vision_tower.", 1)
            .replace("multi_modal_projector.", "model.multi_modal_projector.", 1): v
            for k, v in saved.items()
        }
        save_file(renamed, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("names", ["v4", "v5"])
def test_a_multimodal_gemma3_folder_serves_its_language_model(tmp_path, tiny_gemma3_dir, names):
    # Gemma 3 4B, 12B and 27B ship as Gemma3ForConditionalGeneration: the engine serves
    # their text, with the same logits as transformers' whole model given text only.
    from transformers import Gemma3ForConditionalGeneration

    model_dir = _multimodal_gemma3(tiny_gemma3_dir, tmp_path / "mm", names)
    config = ModelConfig.from_pretrained(model_dir)
    assert config.architecture == "Gemma3ForConditionalGeneration"
    assert config.layer_windows == (24, 0) and config.gemma_layout
    assert config.tie_word_embeddings and config.eos_token_ids == [2]
    prompts = random_prompts([50, 3], seed=7)
    got = PagedRun(model_dir).step([(i, p, 0) for i, p in enumerate(prompts)])
    hf = Gemma3ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        for ours, prompt in zip(got, prompts, strict=True):
            ref = hf(input_ids=torch.tensor([prompt])).logits[0].float()
            torch.testing.assert_close(ours, ref, atol=FP32_ATOL, rtol=0)
        expected = [
            hf.generate(torch.tensor([p]), max_new_tokens=8, min_new_tokens=8, do_sample=False)[
                0, len(p) :
            ].tolist()
            for p in prompts
        ]
    # The whole engine, its chat template from the processor's chat_template.json.
    template = json.loads((model_dir / "tokenizer_config.json").read_text()).pop("chat_template")
    (model_dir / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    config_file = model_dir / "tokenizer_config.json"
    config_file.write_text(
        json.dumps(
            {k: v for k, v in json.loads(config_file.read_text()).items() if k != "chat_template"}
        )
    )
    with LLM(str(model_dir), dtype="float32", max_model_len=256) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=8)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
        chat = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=2))
        assert chat[0].prompt_token_ids[:2] == [1, 4]  # <s><|user|>: the template was found


def test_a_multimodal_gemma3_text_config_takes_gemma3_defaults():
    # Gemma 3 4B's config.json: its text_config names only what differs from the defaults.
    raw = {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "eos_token_id": [1, 106],
        "torch_dtype": "bfloat16",
        "text_config": {
            "hidden_size": 2560,
            "intermediate_size": 10240,
            "model_type": "gemma3_text",
            "num_hidden_layers": 34,
            "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
            "sliding_window": 1024,
        },
        "vision_config": {"model_type": "siglip_vision_model"},
    }
    config = ModelConfig.from_dict(raw)
    assert (config.vocab_size, config.num_attention_heads, config.num_key_value_heads) == (
        262_208,
        8,
        4,
    )
    assert config.head_dim == 256 and config.tie_word_embeddings
    assert config.torch_dtype == "bfloat16" and config.eos_token_ids == [1, 106]
    assert config.layer_windows == tuple(0 if (i + 1) % 6 == 0 else 1024 for i in range(34))
    assert config.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert config.local_rope == (10_000.0, None)
