"""The token ids of a request's prompt, as the engine will see them.

``/v1/completions``: ``prompt`` as token ids is taken as given; text goes through the
model's tokenizer (``add_special_tokens``, default true, as vLLM does).
``/v1/chat/completions``: the messages through the tokenizer's chat template
(``add_generation_prompt``, default true), then encoded without special tokens, as
vLLM does.  A batch (a list of prompts) is routed by its first prompt.

The tokenizer is loaded from a model or tokenizer directory: with ``transformers``
when it is installed (chat templates need it), else with ``tokenizers`` from
``tokenizer.json`` (completions only).  A prompt the router cannot tokenize is
``None``: the request is routed by load.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

log = logging.getLogger("pegaflow.router")


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
"""files of which a tokenizer directory holds at least one"""


def _not_a_tokenizer_dir(path: str) -> str:
    """Why ``path`` is no tokenizer directory ('' when it may be one; a name that is no
    path, such as a Hugging Face repo id, is left to transformers' local cache)."""
    p = Path(path).expanduser()
    if not p.exists():
        if p.is_absolute() or path.startswith((".", "~")):
            return "no such directory (give the model's or its tokenizer's directory)"
        return ""
    if not p.is_dir():
        return "not a directory (give the directory that holds tokenizer.json)"
    if not any((p / f).is_file() for f in TOKENIZER_FILES):
        return f"holds no tokenizer: none of {', '.join(TOKENIZER_FILES)}"
    return ""


class PromptTokenizer:
    """Token ids of request bodies; ``None`` where they cannot be known."""

    def __init__(self, path: str = "") -> None:
        """Load the tokenizer of ``path`` (empty: none, token-id prompts only).  Raises
        ``ValueError`` when ``path`` holds no tokenizer that can be loaded."""
        self.path = path
        self._hf: Any = None
        self._fast: Any = None
        if not path:
            return
        problem = _not_a_tokenizer_dir(path)
        if problem:
            raise ValueError(f"--router-tokenizer {path}: {problem}")
        try:
            from transformers import AutoTokenizer
        except ImportError:
            AutoTokenizer = None
        if AutoTokenizer is not None:
            try:
                self._hf = AutoTokenizer.from_pretrained(path, local_files_only=True)
                return
            except Exception as e:
                raise ValueError(f"cannot load a tokenizer from {path}: {e}") from None
        file = Path(path) / "tokenizer.json"
        try:
            from tokenizers import Tokenizer

            self._fast = Tokenizer.from_file(str(file))
        except Exception as e:
            raise ValueError(f"cannot load {file} (and transformers is missing): {e}") from None

    @property
    def loaded(self) -> bool:
        """Whether text prompts can be tokenized."""
        return self._hf is not None or self._fast is not None

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """``text`` as token ids (``ValueError`` without a tokenizer)."""
        if self._hf is not None:
            return list(self._hf.encode(text, add_special_tokens=add_special_tokens))
        if self._fast is not None:
            return list(self._fast.encode(text, add_special_tokens=add_special_tokens).ids)
        raise ValueError("no tokenizer configured (--router-tokenizer)")

    def tokens(self, path: str, body: dict[str, Any]) -> list[int] | None:
        """The prompt's token ids of a request to ``path`` (``/v1/completions`` or
        ``/v1/chat/completions``), or ``None`` when the router cannot tell them."""
        try:
            if path.endswith("/chat/completions"):
                return self._chat(body)
            return self._completion(body)
        except Exception as e:  # a template error, a malformed body: route by load
            log.debug("cannot tokenize a %s prompt: %s", path, e)
            return None

    def _completion(self, body: dict[str, Any]) -> list[int] | None:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], list | str):
            prompt = prompt[0]
        if isinstance(prompt, list) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            return prompt
        if isinstance(prompt, str) and self.loaded:
            return self.encode(prompt, bool(body.get("add_special_tokens", True)))
        return None

    def _chat(self, body: dict[str, Any]) -> list[int] | None:
        messages = body.get("messages")
        if self._hf is None or not isinstance(messages, list):
            return None
        kwargs = dict(body.get("chat_template_kwargs") or {})
        text = self._hf.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=bool(body.get("add_generation_prompt", True)),
            continue_final_message=bool(body.get("continue_final_message", False)),
            **({"chat_template": body["chat_template"]} if body.get("chat_template") else {}),
            **kwargs,
        )
        if not isinstance(text, str):
            return None
        return self.encode(text, bool(body.get("add_special_tokens", False)))
