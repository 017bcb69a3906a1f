"""Chat templates: messages -> prompt text.

A model folder's ``tokenizer_config.json`` ``chat_template`` (Jinja, as transformers renders it)
is used when present; otherwise a plain default for the embedded models. Both are prefix-stable:
turn ``k + 1``'s prompt starts with turn ``k``'s prompt followed by the assistant's reply, which
is what makes multi-turn conversations hit the prefix cache.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Message:
    role: str
    content: str


class ChatTemplate:
    """Renders a conversation; ``add_generation_prompt`` opens the assistant's turn."""

    def __init__(self, source: str | None = None, bos: str = "", eos: str = "") -> None:
        self.source = source
        self._template = None
        self.bos, self.eos = bos, eos
        if source is not None:
            import jinja2.sandbox

            env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            self._template = env.from_string(source)

    @classmethod
    def for_model(cls, folder: str | Path) -> ChatTemplate:
        """The folder's template if ``tokenizer_config.json`` has one, else the default."""
        cfg_file = Path(folder) / "tokenizer_config.json"
        if cfg_file.is_file():
            cfg = json.loads(cfg_file.read_text())
            tpl = cfg.get("chat_template")
            if isinstance(tpl, list):  # named templates: take "default"
                tpl = next((t["template"] for t in tpl if t.get("name") == "default"), None)
            if isinstance(tpl, str):

                def tok(v: object) -> str:
                    return v.get("content", "") if isinstance(v, dict) else str(v or "")

                return cls(tpl, tok(cfg.get("bos_token")), tok(cfg.get("eos_token")))
        return cls()

    def render(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> str:
        if self._template is None:
            text = "".join(f"<|{m.role}|>\n{m.content}\n" for m in messages)
            return text + ("<|assistant|>\n" if add_generation_prompt else "")
        return self._template.render(
            messages=[{"role": m.role, "content": m.content} for m in messages],
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos,
            eos_token=self.eos,
        )
