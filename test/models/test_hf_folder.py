"""The embedded folders are complete HF folders that standard tools read with no marconi code."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from marconi.engine.chat import ChatTemplate, Message
from marconi.models.hf_folder import metadata, write_metadata
from marconi.models.tiny import TINY_MODELS, ensure_tiny
from marconi.models.tokenizer import ByteTokenizer, load_tokenizer

transformers = pytest.importorskip("transformers")

TEXTS = ["héllo wörld", "<|user|>\nhi\n", "\t\n \x00 ~ emoji 🦜", ""]


@pytest.mark.parametrize("name", ["tiny", "tiny-jamba"])
def test_auto_tokenizer_reads_the_folder_with_byte_ids_and_specials(name: str) -> None:
    folder = ensure_tiny(name)
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    cfg = json.loads((folder / "config.json").read_text())
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (256, 257, 258)
    assert len(tok) == cfg["vocab_size"] == 260
    for text in TEXTS:
        ids = tok(text, add_special_tokens=True)["input_ids"]
        assert ids == ByteTokenizer().encode(text) == load_tokenizer(folder).encode(text)
        assert tok.decode(ids) == text
    assert tok.decode([104, 105, 257], skip_special_tokens=True) == "hi"


@pytest.mark.parametrize("name", ["tiny", "tiny-jamba"])
def test_folder_chat_template_renders_what_the_engine_renders(name: str) -> None:
    folder = ensure_tiny(name)
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    conv = [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Red."},
        {"role": "user", "content": "Another?"},
    ]
    msgs = [Message(m["role"], m["content"]) for m in conv]
    for gen in (True, False):
        hf = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen)
        assert hf == ChatTemplate.for_model(folder).render(msgs, gen)
        assert hf == ChatTemplate().render(msgs, gen)  # the engine's built-in default


@pytest.mark.parametrize("name", sorted(TINY_MODELS))
def test_auto_config_parses_the_same_layer_layout_as_ours(name: str, tmp_path: Path) -> None:
    """Layout only, so the folder gets no weights (small's are ~600 MB: CI's disk is tight)."""
    from marconi.models.loader import read_config
    from marconi.models.registry import model_class

    folder = tmp_path / name
    folder.mkdir()
    write_metadata(folder, TINY_MODELS[name][0])
    hf = transformers.AutoConfig.from_pretrained(folder)
    cfg = read_config(folder)
    ours = [s.kind for s in model_class(cfg["architectures"][0]).parse_config(cfg).sublayers]
    kinds = {"linear_attention": "mamba", "full_attention": "attention", "mlp": "mlp"}
    if name == "tiny-jamba":
        theirs = [("mamba" if t == "linear_attention" else "attention") for t in hf.layer_types]
        assert theirs == [("attention" if k == "attention" else "mamba") for k in ours if k in
                          ("attention", "mamba1")]  # fmt: skip
    else:
        assert [kinds[t] for t in hf.layer_types] == [
            {"mamba2": "mamba", "attention": "attention", "mlp": "mlp"}[k] for k in ours
        ]
        assert (hf.n_groups, hf.conv_kernel, hf.chunk_size, hf.expand) == (
            cfg["mamba_n_groups"], cfg["mamba_d_conv"], cfg["mamba_chunk_size"], cfg["mamba_expand"]
        )  # fmt: skip
    gen = transformers.GenerationConfig.from_pretrained(folder)
    assert (gen.bos_token_id, gen.eos_token_id) == (256, 257)


def test_old_folders_gain_the_tokenizer_files_and_keep_their_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MARCONI_CACHE_DIR", str(tmp_path))
    folder = ensure_tiny("tiny")
    weights = (folder / "model.safetensors").read_bytes()
    old_cfg = json.loads((folder / "config.json").read_text())
    old_cfg.pop("hybrid_override_pattern")
    old_cfg["layers_block_type"] = ["linear_attention"]  # an older layout: rewritten
    (folder / "config.json").write_text(json.dumps(old_cfg))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (folder / name).unlink()
    assert ensure_tiny("tiny") == folder
    for name, content in metadata(TINY_MODELS["tiny"][0]).items():
        assert json.loads((folder / name).read_text()) == content
    assert (folder / "model.safetensors").read_bytes() == weights
    shutil.rmtree(folder)
