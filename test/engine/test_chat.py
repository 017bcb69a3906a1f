"""Chat templates: the folder's ``tokenizer_config.json`` template, else the embedded default."""

from __future__ import annotations

import json
from pathlib import Path

from marconi.engine.chat import ChatTemplate, Message

CHATML = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHAT = [Message("system", "Be terse."), Message("user", "Hi")]


def _folder(tmp_path: Path, **cfg: object) -> Path:
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return tmp_path


def test_folder_template_is_rendered_with_its_bos_token(tmp_path: Path) -> None:
    bos = {"content": "<s>", "lstrip": False}  # tokenizer_config.json may hold AddedToken dicts
    tpl = ChatTemplate.for_model(_folder(tmp_path, chat_template=CHATML, bos_token=bos))
    assert tpl.render(CHAT) == (
        "<s><|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_named_templates_take_the_default_one(tmp_path: Path) -> None:
    named = [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": CHATML}]
    tpl = ChatTemplate.for_model(_folder(tmp_path, chat_template=named))
    assert tpl.render(CHAT[1:], add_generation_prompt=False) == "<|im_start|>user\nHi<|im_end|>\n"


def test_without_a_template_the_default_is_used(tmp_path: Path) -> None:
    for folder in (tmp_path / "empty", _folder(tmp_path, bos_token="<s>")):
        folder.mkdir(exist_ok=True)
        tpl = ChatTemplate.for_model(folder)
        assert tpl.source is None
        assert tpl.render(CHAT) == "<|system|>\nBe terse.\n<|user|>\nHi\n<|assistant|>\n"


def test_templates_are_prefix_stable_across_turns(tmp_path: Path) -> None:
    """Turn k+1's prompt extends turn k's prompt + reply: what lets a conversation hit the cache."""
    for tpl in (ChatTemplate(), ChatTemplate.for_model(_folder(tmp_path, chat_template=CHATML))):
        turn1 = tpl.render(CHAT)
        reply = Message("assistant", "Hello.")
        turn2 = tpl.render([*CHAT, reply, Message("user", "More")])
        assert turn2.startswith(turn1 + reply.content)


def test_template_runs_sandboxed(tmp_path: Path) -> None:
    evil = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    tpl = ChatTemplate.for_model(_folder(tmp_path, chat_template=evil))
    try:
        out = tpl.render(CHAT)
    except Exception as e:  # jinja2's SecurityError
        assert type(e).__name__ == "SecurityError"
    else:
        assert "subclasses" not in out and "<class" not in out
