"""Complete HF model folders for the embedded models: what every engine and client reads.

A folder holds ``config.json`` (names that transformers, SGLang 0.5.23 and vLLM all parse),
``model.safetensors``, ``generation_config.json``, and a byte-level tokenizer
(``tokenizer.json`` + ``tokenizer_config.json`` with bos/eos/pad and a chat template), so that
``AutoTokenizer.from_pretrained(folder)``, ``sglang.launch_server --model-path folder`` and
``sglang.bench_serving --tokenizer folder`` work without any of our code.

The tokenizer is the identity on UTF-8 bytes (id ``b`` is byte ``b``; no merges), the same ids as
``marconi.models.tokenizer.ByteTokenizer``; ids 256.. are the special tokens. The chat template
renders exactly what ``marconi.engine.chat.ChatTemplate``'s built-in default renders.

Weights are written once (a temp folder renamed into place); the small metadata files are
rewritten in place (atomically, per file) whenever they differ from what this module produces,
so folders made by older versions gain the tokenizer and the new config names.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

#: Jinja twin of ChatTemplate's default (``<|role|>\ncontent\n`` per message).
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
WEIGHTS = "model.safetensors"


@cache
def _byte_to_unicode() -> tuple[str, ...]:
    """GPT-2's printable stand-in for each byte (what the ByteLevel pre-tokenizer emits)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    keep += range(ord("®"), ord("ÿ") + 1)
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return tuple(out[b] for b in range(256))


def specials(config: Mapping[str, Any]) -> dict[str, int]:
    """Special-token text -> id for an embedded config (bos, eos, pad, then unused ids)."""
    named = {"<s>": config["bos_token_id"], "</s>": config["eos_token_id"]}
    named["<pad>"] = config["pad_token_id"]
    taken = set(named.values())
    spare = (i for i in range(256, config["vocab_size"]) if i not in taken)
    named.update({f"<|unused{j}|>": i for j, i in enumerate(spare)})
    return dict(sorted(named.items(), key=lambda kv: kv[1]))


def tokenizer_json(config: Mapping[str, Any]) -> dict[str, Any]:
    """A ``tokenizers`` BPE with no merges over the 256 bytes, plus the special tokens."""
    added = [
        {"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True}
        for t, i in specials(config).items()
    ]  # fmt: skip
    byte_level = {"add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", **byte_level},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", **byte_level},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {c: b for b, c in enumerate(_byte_to_unicode())},
            "merges": [],
        },
    }


def tokenizer_config(config: Mapping[str, Any]) -> dict[str, Any]:
    names = {i: t for t, i in specials(config).items()}
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": names[config["bos_token_id"]],
        "eos_token": names[config["eos_token_id"]],
        "pad_token": names[config["pad_token_id"]],
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": config.get("max_position_embeddings", 65536),
        "chat_template": CHAT_TEMPLATE,
    }


def generation_config(config: Mapping[str, Any]) -> dict[str, Any]:
    keys = ("bos_token_id", "eos_token_id", "pad_token_id")
    return {**{k: config[k] for k in keys}, "do_sample": False}


def metadata(config: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """File name -> JSON content of every non-weight file of the folder."""
    return {
        "config.json": dict(config),
        "generation_config.json": generation_config(config),
        "tokenizer.json": tokenizer_json(config),
        "tokenizer_config.json": tokenizer_config(config),
    }


def _write_json(path: Path, content: Mapping[str, Any]) -> None:
    text = json.dumps(content, indent=2, ensure_ascii=False)
    if path.is_file() and path.read_text(encoding="utf-8") == text:
        return
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}-")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)  # atomic: a concurrent reader sees the old file or the new one


def write_metadata(path: Path, config: Mapping[str, Any]) -> None:
    """(Re)write the folder's config, generation config and tokenizer files where they differ."""
    for name, content in metadata(config).items():
        _write_json(path / name, content)


def write_hf_folder(
    path: Path, config: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]
) -> Path:
    """Write a whole folder atomically (a temp folder renamed into place)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}-"))
    try:
        write_metadata(tmp, config)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / WEIGHTS),
                  metadata={"format": "pt"})  # fmt: skip
        if path.exists():
            shutil.rmtree(tmp)  # another process won the race
        else:
            tmp.rename(path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path
