"""Tokenizers of the engine: a Hugging Face ``tokenizer.json`` (the ``tokenizers`` library) from the
model directory, or the byte-level tokenizer of the synthetic tasks (``agent.engine.tasks``).

``HFTokenizer`` reads the special tokens the way transformers does: EOS from ``generation_config.json``
(one id or a list: every one of them stops generation), else ``config.json``, else
``tokenizer_config.json``'s ``eos_token``; PAD from ``pad_token`` (else EOS: pads are masked out). The
chat template is optional: ``chat_template=True`` renders the directory's template (jinja2, sandboxed,
as transformers renders it) around each prompt with the generation prompt added; a prompt given as
chat messages needs it.

Run: ``python -m agent.engine.tokenizer DIR "some text"`` prints the ids and the decoded text.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from functools import cached_property
from pathlib import Path
from typing import Any, Protocol

from planner.errors import SpecError

Prompt = str | tuple[dict[str, str], ...]  # text, or chat messages ({"role": ..., "content": ...})


class Tokenizer(Protocol):
    """What the step loop needs of a tokenizer (``ByteTokenizer`` and ``HFTokenizer`` both are)."""

    @property
    def pad_id(self) -> int: ...

    @property
    def stop_ids(self) -> tuple[int, ...]: ...

    def decode(self, ids: list[int]) -> str: ...

    def terminated(self, ids: list[int]) -> bool: ...


def encode_prompt(tok: Any, prompt: Prompt) -> list[int]:
    """Prompt ids through ``tok``: ``HFTokenizer.encode_prompt`` or the byte tokenizer (text only)."""
    if hasattr(tok, "encode_prompt"):
        return tok.encode_prompt(prompt)  # type: ignore[no-any-return]
    if not isinstance(prompt, str):
        raise SpecError("tokenizer", "chat-message prompts need a Hugging Face tokenizer with a chat template")
    return tok.encode(prompt)  # type: ignore[no-any-return]


def _json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        out = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SpecError(str(path), f"is not valid JSON: {e}") from None
    return out if isinstance(out, dict) else {}


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json spells it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class HFTokenizer:
    def __init__(self, path: str | Path, *, chat_template: bool = False) -> None:
        from tokenizers import Tokenizer as _Tokenizer

        p = Path(path)
        self.dir = p if p.is_dir() else p.parent
        file = p / "tokenizer.json" if p.is_dir() else p
        if not file.is_file():
            raise SpecError("tokenizer.path", f"{file} does not exist (a tokenizer.json is needed; "
                            "slow sentencepiece-only tokenizers must be converted)")
        try:
            self.tok = _Tokenizer.from_file(str(file))
        except Exception as e:
            raise SpecError(str(file), f"is not a tokenizers file: {e}") from None
        self.config = _json(self.dir / "tokenizer_config.json")
        gen, model = _json(self.dir / "generation_config.json"), _json(self.dir / "config.json")
        eos = gen.get("eos_token_id", model.get("eos_token_id"))
        if eos is None and _token_text(self.config.get("eos_token")):
            eos = self._id_of("eos_token")
        if eos is None:
            raise SpecError(str(self.dir), "names no EOS token (generation_config.json, config.json or "
                            "tokenizer_config.json)")
        self._stop_ids = tuple(int(i) for i in (eos if isinstance(eos, list) else [eos]))
        self._pad_id = self._id_of("pad_token") if _token_text(self.config.get("pad_token")) else self._stop_ids[0]
        self.use_chat_template = chat_template
        if chat_template and self.template is None:
            raise SpecError("tokenizer.chat_template", f"{self.dir} has no chat template")

    def _id_of(self, key: str) -> int:
        text = _token_text(self.config.get(key))
        i = self.tok.token_to_id(text) if text is not None else None
        if i is None:
            raise SpecError(f"{self.dir / 'tokenizer_config.json'}.{key}", f"{text!r} is not in the vocabulary")
        return int(i)

    @property
    def pad_id(self) -> int:
        return self._pad_id

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return self._stop_ids

    @property
    def vocab_size(self) -> int:
        return int(self.tok.get_vocab_size(with_added_tokens=True))

    @cached_property
    def template(self) -> Any:
        """The directory's chat template, compiled (None if it has none)."""
        source = self.config.get("chat_template")
        if isinstance(source, list):  # named templates: the default one
            source = next((t.get("template") for t in source if t.get("name") == "default"), None)
        if source is None and (self.dir / "chat_template.jinja").is_file():
            source = (self.dir / "chat_template.jinja").read_text()
        if source is None:
            return None
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise SpecError("tokenizer.chat_template", message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        return env.from_string(source)

    def render_chat(self, messages: Sequence[dict[str, str]]) -> str:
        specials = {k: _token_text(self.config.get(k)) or "" for k in ("bos_token", "eos_token", "pad_token")}
        return str(self.template.render(messages=list(messages), add_generation_prompt=True, **specials))

    def encode(self, text: str, bos: bool = True) -> list[int]:
        """Ids of ``text``; ``bos``: with the special tokens the tokenizer's post-processor adds."""
        return list(self.tok.encode(text, add_special_tokens=bos).ids)

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str) and not self.use_chat_template:
            return self.encode(prompt)
        if self.template is None:
            raise SpecError("tokenizer.chat_template", "chat-message prompts need a chat template")
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        return self.encode(self.render_chat(messages), bos=False)  # the template writes its own BOS

    def decode(self, ids: list[int]) -> str:
        """Text up to the first stop token, special tokens dropped."""
        stops = set(self._stop_ids)
        cut = next((k for k, i in enumerate(ids) if i in stops), len(ids))
        return str(self.tok.decode(list(ids[:cut]), skip_special_tokens=True))

    def terminated(self, ids: list[int]) -> bool:
        return any(i in self._stop_ids for i in ids)


if __name__ == "__main__":
    t = HFTokenizer(sys.argv[1])
    ids = t.encode(sys.argv[2])
    print(ids, repr(t.decode(ids)))
