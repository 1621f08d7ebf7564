"""A Hugging Face tokenizer folder (tokenizer.json + tokenizer_config.json), without transformers."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2.sandbox
from tokenizers import Tokenizer as HFTokenizer


def _special_token_text(value: Any) -> str | None:
    """tokenizer_config.json writes special tokens as strings or as {"content": ...} dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    """Encodes, decodes and applies the chat template of a local model folder."""

    def __init__(self, folder: str | Path) -> None:
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"{folder} has no tokenizer.json (a fast tokenizer is required)")
        self.hf = HFTokenizer.from_file(str(path))
        config_path = folder / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        self.bos_token = _special_token_text(config.get("bos_token"))
        self.eos_token = _special_token_text(config.get("eos_token"))
        self.chat_template: str | None = config.get("chat_template")
        template_file = folder / "chat_template.jinja"
        if self.chat_template is None and template_file.is_file():
            self.chat_template = template_file.read_text()
        # A multimodal model's processor keeps it in chat_template.json (Gemma 3 4B and up).
        template_json = folder / "chat_template.json"
        if self.chat_template is None and template_json.is_file():
            self.chat_template = json.loads(template_json.read_text()).get("chat_template")
        self.eos_token_id = self.hf.token_to_id(self.eos_token) if self.eos_token else None
        self.bos_token_id = self.hf.token_to_id(self.bos_token) if self.bos_token else None
        self.vocab_size = self.hf.get_vocab_size(with_added_tokens=True)
        self._template: jinja2.Template | None = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of text; special tokens per the tokenizer's post-processor."""
        return self.hf.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_pair(self, first: str, second: str) -> list[int]:
        """Token ids of two texts read as one prompt, as the tokenizer's post-processor joins
        a pair (what a cross-encoder was trained on)."""
        return self.hf.encode(first, second, add_special_tokens=True).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of token ids."""
        return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        """Render a conversation with the model's chat template."""
        if self.chat_template is None:
            raise ValueError("this model has no chat template; use completions instead of chat")
        if self._template is None:
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
            )
            env.globals["raise_exception"] = _raise_template_error
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            env.filters["tojson"] = lambda value, indent=None: json.dumps(
                value, indent=indent, ensure_ascii=False
            )
            self._template = env.from_string(self.chat_template)
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **kwargs,
        )


def _raise_template_error(message: str) -> None:
    raise ValueError(f"chat template rejected the conversation: {message}")
