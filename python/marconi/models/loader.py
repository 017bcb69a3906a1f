"""Load a model from a local HF folder (config.json + *.safetensors, sharded or not)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from marconi.models.hybrid import HybridForCausalLM
from marconi.models.registry import model_class

#: Tensors that may be absent from a checkpoint; they keep their constructor defaults.
OPTIONAL_SUFFIXES = ("router_bias",)


class ModelLoadError(RuntimeError):
    """A folder that cannot be served: bad config, unknown architecture, missing tensors."""


def read_config(path: Path) -> dict:
    cfg = path / "config.json"
    if not cfg.is_file():
        raise ModelLoadError(f"{path}: no config.json")
    return json.loads(cfg.read_text())


def _shards(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors files")
    return files


def iter_tensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every (name, tensor) of the checkpoint, shard by shard."""
    for shard in _shards(path):
        with safe_open(str(shard), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, f.get_tensor(name)


def resolve_model_path(name_or_path: str | Path) -> Path:
    """`tiny` / `tiny-jamba` -> the embedded model's folder (created on first use); else a path."""
    from marconi.models.tiny import TINY_MODELS, ensure_tiny

    if str(name_or_path) in TINY_MODELS:
        return ensure_tiny(str(name_or_path))
    path = Path(name_or_path).expanduser()
    if not path.is_dir():
        raise ModelLoadError(
            f"{name_or_path}: not a directory and not one of {sorted(TINY_MODELS)}"
        )
    return path


def load_model(
    name_or_path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> HybridForCausalLM:
    """Build the model a folder describes and load its weights by parameter name.

    Raises ModelLoadError for a missing config/weights, an unknown architecture or any missing
    tensor (all missing names listed). Unused checkpoint tensors (e.g. MTP heads) are ignored.
    """
    path = resolve_model_path(name_or_path)
    hf = read_config(path)
    archs = hf.get("architectures") or []
    if not archs:
        raise ModelLoadError(f"{path}: config.json has no 'architectures'")
    try:
        cls = model_class(archs[0])
        config = cls.parse_config(hf)
    except ValueError as e:
        raise ModelLoadError(f"{path}: {e}") from e
    with torch.device("meta"):
        model = cls(config)
    state, _unused = cls.convert_weights(iter_tensors(path), config)
    if config.tie_word_embeddings and "lm_head.weight" not in state and "embed.weight" in state:
        state["lm_head.weight"] = state["embed.weight"]
    expected = model.state_dict()
    missing = [k for k in expected if k not in state and not k.endswith(OPTIONAL_SUFFIXES)]
    if missing:
        shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
        raise ModelLoadError(f"{path}: {len(missing)} tensors missing for {archs[0]}: {shown}")
    bad = [
        f"{k}: {tuple(state[k].shape)} vs {tuple(v.shape)}"
        for k, v in expected.items()
        if k in state and state[k].shape != v.shape
    ]
    if bad:
        raise ModelLoadError(f"{path}: shape mismatch: {'; '.join(bad[:4])}")
    model = model.to_empty(device=device)
    for k, v in expected.items():
        if k not in state:  # optional tensors: defaults
            state[k] = torch.zeros(v.shape)
    model.load_state_dict({k: state[k].to(dtype) for k in expected}, strict=True)
    return model.to(dtype).eval()
