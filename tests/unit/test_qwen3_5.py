"""Qwen3.5's text decoder (decoder_block=qwen3_5): what the HF goldens cannot show. Its Gated DeltaNet's split input
projections (HF Qwen3.5's) compute Qwen3-Next's function; its HF config maps; the combinations nnxtron does not run
are refused by name, as for Qwen3-Next (whose packing and decoding tests cover the shared layers: after the
projections the code is one). HF parity: tests/parity/test_hf_golden.py (qwen3_5), tests/unit/test_hf_roundtrip.py,
tests/parity/test_kv_cache.py::test_greedy_generation_equals_hf_generate[qwen3_5]."""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nnxtron.errors import ConfigError
from nnxtron.infer.cache import attach_caches
from nnxtron.infer.decode import unrolled
from nnxtron.infer.paging import Paging
from nnxtron.layers.gated_deltanet import GatedDeltaNet
from nnxtron.models import qwen3_5_hf
from nnxtron.models.build import build_model
from tests.helpers import tiny_config

MODEL = "qwen3.5-tiny"
GOLDEN = Path(__file__).resolve().parents[1] / "assets" / "golden" / "qwen3_5"


def test_split_projections_compute_the_fused_function():
    """Qwen3-Next's fused per-key-head in_proj_qkvz / in_proj_ba, cut into Qwen3.5's in_proj_qkv (all q, all k, all v),
    in_proj_z, in_proj_b and in_proj_a, give the same outputs (2 key heads of 4 value heads: the grouping matters)."""
    cfg = tiny_config(MODEL)
    with nnx.use_eager_sharding(False):  # unsharded, as models/build.build_model
        fused, split = GatedDeltaNet(cfg, nnx.Rngs(0), True), GatedDeltaNet(cfg, nnx.Rngs(1), False)
    hk, hv, dk, dv = cfg.gdn_num_key_heads, cfg.gdn_num_value_heads, cfg.gdn_key_head_dim, cfg.gdn_value_head_dim
    group, width = hv // hk, cfg.base_emb_dim
    qkvz, ba = fused.in_proj_qkvz.kernel[...], fused.in_proj_ba.kernel[...]  # [D, Hk, 2 dk + 2 g dv], [D, Hk, 2 g]
    q, k = qkvz[..., :dk].reshape(width, -1), qkvz[..., dk : 2 * dk].reshape(width, -1)
    v = qkvz[..., 2 * dk : 2 * dk + group * dv].reshape(width, -1)
    split.in_proj_qkv.kernel[...] = jnp.concatenate([q, k, v], axis=-1)
    split.in_proj_z.kernel[...] = qkvz[..., 2 * dk + group * dv :].reshape(width, hv, dv)
    split.in_proj_b.kernel[...] = ba[..., :group].reshape(width, hv)
    split.in_proj_a.kernel[...] = ba[..., group:].reshape(width, hv)
    for name in ("conv", "dt_bias", "A_log"):
        getattr(split, name)[...] = getattr(fused, name)[...]
    split.norm.norm.scale[...] = fused.norm.norm.scale[...] + 0.1  # not 1: the norm's weight is read too
    fused.norm.norm.scale[...] = split.norm.norm.scale[...]
    split.out.kernel[...] = fused.out.kernel[...]
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 11, width)), jnp.float32)
    positions, segments = jnp.broadcast_to(jnp.arange(11), (2, 11)), jnp.ones((2, 11), jnp.int32)
    run = nnx.jit(lambda mixer: mixer(x, positions, segments))
    want = run(fused)
    np.testing.assert_allclose(run(split), want, atol=1e-6, rtol=0)  # measured 0.0
    split.in_proj_b.kernel[...] = ba[..., group:].reshape(width, hv)  # b and a swapped: a different function
    assert float(jnp.abs(run(split) - want).max()) > 1e-3


def test_hf_config_maps():
    """HF Qwen3_5MoeTextConfig has no intermediate_size / norm_topk_prob / mlp_only_layers (every layer MoE, top-k
    renormalised): present anyway they are not read, as HF does not; the export writes none of them and refuses a
    config whose top-k weights are not renormalised."""
    hf = json.loads((GOLDEN / "config.json").read_text())
    values = qwen3_5_hf.config_from_hf({**hf, "intermediate_size": 999, "norm_topk_prob": False, "mlp_only_layers": [1]})
    assert values == qwen3_5_hf.config_from_hf(hf)
    assert values["decoder_block"] == "qwen3_5" and values["norm_topk_prob"] and values["base_mlp_dim"] == 16
    exported = qwen3_5_hf.config_to_hf(tiny_config(MODEL))
    assert exported["model_type"] == "qwen3_5_moe_text" and exported["architectures"] == ["Qwen3_5MoeForCausalLM"]
    assert not set(qwen3_5_hf.ABSENT) & set(exported)
    with pytest.raises(ConfigError, match="export needs norm_topk_prob=true"):
        qwen3_5_hf.config_to_hf(tiny_config(MODEL, norm_topk_prob=False))


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(ici_context_parallelism=2), "ici_context_parallelism=1"),
        (dict(mtp_num_layers=1), "decoder_block qwen3_5: mtp_num_layers"),
        (dict(shared_experts=0), "shared_experts >= 1"),
        (dict(first_num_dense_layers=1), "decoder_block qwen3_5 has a routed MoE on every layer"),
        (dict(use_qk_norm=False), "use_qk_norm=true"),
    ],
)
def test_unsupported_combinations_are_refused_by_name(overrides, match):
    with pytest.raises(ConfigError, match=match):
        tiny_config(MODEL, **overrides)


def test_paged_decoding_caches_are_refused():
    model = unrolled(build_model(tiny_config(MODEL, base_num_decoder_layers=1), seed=0))  # one DeltaNet layer
    with pytest.raises(ConfigError, match="decoder_block=qwen3_5: its recurrent decoding state cannot live in paged"):
        attach_caches(model, 2, 32, Paging())


def test_the_flop_count_counts_the_split_projections():
    """config/flops.py's matmul weights per layer are the model's with Qwen3.5's split DeltaNet projections too."""
    from nnxtron.config import flops
    from nnxtron.config.layout import LayerKind
    from nnxtron.models.build import abstract_model
    from nnxtron.params import flatten

    cfg = tiny_config(MODEL, scan_layers=False)
    params = flatten(nnx.state(abstract_model(cfg), nnx.Param))

    def kernels(layer: str) -> int:
        return sum(v.size for k, v in params.items() if k.startswith(f"{layer}/attention/") and k.endswith("/kernel"))

    assert kernels("layers/layers/0/cycle/1") == flops._attention_params(cfg, LayerKind(moe=True))[0]  # full (gated) attention
    assert kernels("layers/layers/0/cycle/0") == flops._linear_attention(cfg)[0]  # Gated DeltaNet, split projections
    assert any(k.endswith("attention/in_proj_z/kernel") for k in params)
