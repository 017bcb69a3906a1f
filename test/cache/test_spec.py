"""One layer spec: for every embedded model and every preset, the bytes the runtime allocates
(``HybridMemory``, the layers' own state shapes), the layer specs and the cost model agree, in
every served dtype; and, where SGLang is installed, so do SGLang's own pools."""

from __future__ import annotations

import json

import pytest
import torch
from marconi.cache.cost import PRESET_DIR, cost_model_from_hf_config, list_presets
from marconi.cache.spec import CacheDtypes, MambaSpec, ModelCacheSpec, cache_spec_from_hf
from marconi.models.memory import HybridMemory
from marconi.models.registry import MODEL_REGISTRY
from marconi.models.tiny import TINY_MODELS

DTYPES = [CacheDtypes("float32"), CacheDtypes("bfloat16"), CacheDtypes("float16", "float16")]


def _check(hf: dict, dtypes: CacheDtypes, runtime: bool) -> tuple[int, int]:
    """Assert spec bytes == cost-model bytes (== runtime bytes if ``runtime``); returns them."""
    spec = cache_spec_from_hf(hf)
    cost = cost_model_from_hf_config(hf, dtype=dtypes.kv, ssm_state_dtype=dtypes.ssm)
    kv, state = spec.kv_bytes_per_token(dtypes), spec.state_bytes(dtypes)
    assert (cost.kv_bytes_per_token, cost.state_bytes, cost.spec) == (kv, state, spec)
    assert cost.conv_state_bytes + cost.ssm_state_bytes == state
    if runtime:
        config = MODEL_REGISTRY[hf["architectures"][0]].parse_config(hf)
        assert config.cache_spec == spec
        mem = HybridMemory(config, 1, 1, dtypes)
        assert (mem.kv_bytes_per_slot, mem.state_bytes_per_slot) == (kv, state)
        assert (mem.k.dtype, mem.ssm.dtype) == (
            getattr(torch, dtypes.kv),
            getattr(torch, dtypes.ssm),
        )
    return kv, state


@pytest.mark.parametrize("dtypes", DTYPES, ids=lambda d: f"{d.kv}-{d.ssm}")
@pytest.mark.parametrize("name", sorted(TINY_MODELS))
def test_embedded_model_bytes_agree_everywhere(name: str, dtypes: CacheDtypes) -> None:
    _check(TINY_MODELS[name][0], dtypes, runtime=True)


def test_tiny_numbers_from_the_issue() -> None:
    """The cost model used to say 1,024 B / 2,457,600 B for tiny (bf16, d_conv columns) where
    the fp32 runtime allocates 2,048 B / 2,506,752 B; now all count the served layout."""
    fp32 = _check(TINY_MODELS["tiny"][0], CacheDtypes("float32"), runtime=True)
    # 2 attention layers x K,V x 2 heads x 64; 12 Mamba-2 layers x (3 x 1024 conv + 12x64x64)
    assert fp32 == (2 * 2 * 2 * 64 * 4, 12 * (3 * (768 + 2 * 2 * 64) * 4 + 12 * 64 * 64 * 4))
    assert fp32 == (2048, 2_506_752)


@pytest.mark.parametrize("name", list_presets())
def test_preset_bytes_agree_with_specs_and_runtime(name: str) -> None:
    hf = json.loads((PRESET_DIR / f"{name}.json").read_text())
    runtime = hf["architectures"][0] in MODEL_REGISTRY
    parsed = cost_model_from_hf_config(hf)  # the preset's own dtypes
    dtypes = CacheDtypes(parsed.dtype, parsed.ssm_state_dtype)
    assert _check(hf, dtypes, runtime) == (parsed.kv_bytes_per_token, parsed.state_bytes)


@pytest.mark.parametrize("name", ["tiny", "tiny-jamba"])
def test_the_models_own_layers_have_the_spec_shapes(name: str) -> None:
    """The mixers built from the same parse read and write exactly the memory's slot shapes."""
    hf = TINY_MODELS[name][0]
    cls = MODEL_REGISTRY[hf["architectures"][0]]
    model = cls(cls.parse_config(hf))
    mem = model.allocate_memory(1, 1)
    mixers = [layer.mixer for layer in model.layers if hasattr(layer.mixer, "ssm_state_shape")]
    assert len(mixers) == mem.conv.shape[0] == len(model.config.cache_spec.mamba)
    for mixer in mixers:
        assert mixer.conv_state_shape == tuple(mem.conv.shape[2:])
        assert mixer.ssm_state_shape == tuple(mem.ssm.shape[2:])
    attn = [layer.mixer for layer in model.layers if layer.kind == "attention"]
    assert len(attn) == mem.k.shape[0]
    assert model.cache_dtypes() == CacheDtypes("float32", "float32")


def test_conv_columns_default_to_d_conv_minus_one() -> None:
    m = MambaSpec(conv_dim=10, d_conv=4, state_shape=(2, 3))
    assert m.conv_shape() == (3, 10) and m.conv_shape(4) == (4, 10)
    assert m.bytes_per_slot("bfloat16") == 3 * 10 * 2 + 6 * 2
    assert m.bytes_per_slot("bfloat16", 4, "float32") == 4 * 10 * 2 + 6 * 4


def test_mixed_layer_shapes_are_refused_by_the_runtime_layout() -> None:
    spec = ModelCacheSpec((), (MambaSpec(8, 4, (2,)), MambaSpec(8, 3, (2,))))
    with pytest.raises(ValueError, match="share one slot shape"):
        spec.uniform()
