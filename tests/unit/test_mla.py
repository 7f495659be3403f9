"""MLA vs a NumPy transcription of HF ``DeepseekV3Attention`` (HF weight layout, float64).

The module was also checked against transformers 5.24 ``DeepseekV3Attention`` with the same
weights (H 4, D 32, q_lora 24 or none, kv_lora 16, nope 16, rope 64, v 12; yarn factor 40,
original 4096, max 163840, mscale 1, mscale_all_dim 1 / 0 / 0.707; default rope; both pair
layouts; positions 101-386 and 150-16750): max |Δ| 1e-6 - 5e-6 on outputs of size ~8, an
order of magnitude below either float32 implementation's distance from a float64 run.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nnxtron.layers.mla import MLA
from nnxtron.parallel.mesh import make_mesh
from nnxtron.parallel.sharding import activate, state_shardings
from tests.conftest import tiny_config
from tests.unit.test_rope import yarn_inv_freq_reference

H, D = 4, 64  # llama2-tiny: base_num_query_heads, base_emb_dim
NOPE, ROPE, V, KV_LORA = 6, 8, 5, 8
YARN = dict(
    rope_type="yarn",
    rope_interleave=True,
    rope_max_timescale=1e4,
    rope_scaling_factor=40.0,
    rope_original_max_position_embeddings=4096,
    max_position_embeddings=163840,
    beta_fast=32.0,
    beta_slow=1.0,
    mscale=1.0,
    mscale_all_dim=1.0,
)


def mla_config(q_lora: int, **overrides):
    values = dict(
        attention_type="mla", q_lora_rank=q_lora, kv_lora_rank=KV_LORA, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=V
    )
    return tiny_config("llama2-tiny", **{**values, **YARN, **overrides})


def make(cfg, seed: int = 0) -> MLA:
    with nnx.use_eager_sharding(False):
        mla = MLA(cfg, nnx.Rngs(seed))
    rng = np.random.default_rng(seed + 1)
    for name in ("q_norm", "kv_norm"):  # non-trivial norm weights, so a skipped norm shows
        if hasattr(mla, name):
            scale = getattr(mla, name).scale
            scale[...] = jnp.asarray(1 + 0.5 * rng.normal(size=scale.shape), jnp.float32)
    return mla


def hf_weights(mla: MLA) -> dict[str, np.ndarray]:
    """The HF state dict of ``mla`` (the layout the model's key map must produce)."""
    k = {name: np.asarray(var[...], np.float64) for name, var in _params(mla).items()}
    w = {
        "kv_a_proj_with_mqa": k["wkv_a/kernel"].T,
        "kv_a_layernorm": k["kv_norm/scale"],
        "kv_b_proj": k["wkv_b/kernel"].reshape(KV_LORA, -1).T,
        "o_proj": k["out/kernel"].reshape(H * V, D).T,
    }
    if "wq/kernel" in k:
        w["q_proj"] = k["wq/kernel"].reshape(D, -1).T
    else:
        q_lora = k["wq_a/kernel"].shape[1]
        w.update(q_a_proj=k["wq_a/kernel"].T, q_a_layernorm=k["q_norm/scale"], q_b_proj=k["wq_b/kernel"].reshape(q_lora, -1).T)
    return w


def _params(mla: MLA) -> dict:
    return {"/".join(map(str, p)): v for p, v in nnx.to_flat_state(nnx.state(mla, nnx.Param))}


def rms_norm(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-6) * w


def reference(w: dict, x: np.ndarray, positions: np.ndarray, segments: np.ndarray, window: int = 0) -> np.ndarray:
    """HF DeepseekV3Attention (rope_interleave=True, yarn as YARN) in float64, packed-segment mask."""
    b, s, _ = x.shape
    if "q_proj" in w:
        q = x @ w["q_proj"].T
    else:
        q = rms_norm(x @ w["q_a_proj"].T, w["q_a_layernorm"]) @ w["q_b_proj"].T
    q = q.reshape(b, s, H, NOPE + ROPE)
    q_pass, q_rot = q[..., :NOPE], q[..., NOPE:]
    ckv = x @ w["kv_a_proj_with_mqa"].T
    c, k_rot = ckv[..., :KV_LORA], ckv[..., KV_LORA:]
    kv = (rms_norm(c, w["kv_a_layernorm"]) @ w["kv_b_proj"].T).reshape(b, s, H, NOPE + V)
    k_pass, v = kv[..., :NOPE], kv[..., NOPE:]
    inv = yarn_inv_freq_reference(ROPE, 1e4, 40.0, 4096, 32.0, 1.0)
    angles = positions[..., None] * inv  # cos/sin factor m(40, 1) / m(40, 1) = 1
    cos, sin = np.cos(angles)[:, :, None], np.sin(angles)[:, :, None]

    def rotate(t):  # apply_rotary_pos_emb_interleave: pairs (2i, 2i+1), output de-interleaved
        a, bb = t[..., 0::2], t[..., 1::2]
        return np.concatenate([a * cos - bb * sin, bb * cos + a * sin], axis=-1)

    q = np.concatenate([q_pass, rotate(q_rot)], axis=-1)
    k = np.concatenate([k_pass, np.broadcast_to(rotate(k_rot[:, :, None]), (b, s, H, ROPE))], axis=-1)
    scale = (NOPE + ROPE) ** -0.5 * (0.1 * math.log(40.0) + 1) ** 2
    scores = np.einsum("bshd,bthd->bhst", q, k) * scale
    qi, ki = np.arange(s)[:, None], np.arange(s)[None]
    visible = (ki <= qi) & ((qi - ki < window) if window else True)
    visible = visible[None] & (segments[:, :, None] == segments[:, None, :])
    scores = np.where(visible[:, None], scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    ctx = np.einsum("bhst,bthd->bshd", probs, v).reshape(b, s, H * V)
    return ctx @ w["o_proj"].T


def inputs(seed: int = 7):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(2, 10, D))
    # row 0: one document at positions > 100 (yarn frequencies matter); row 1: two packed documents
    positions = np.stack([np.arange(150, 160), np.r_[np.arange(300, 304), np.arange(6)]]).astype(np.int32)
    segments = np.stack([np.ones(10), np.r_[np.ones(4), np.full(6, 2)]]).astype(np.int32)
    return x, positions, segments


def run(mla: MLA, x, positions, segments) -> np.ndarray:
    return np.asarray(mla(jnp.asarray(x, jnp.float32), jnp.asarray(positions), jnp.asarray(segments)))


@pytest.mark.parametrize("q_lora", [12, 0])
@pytest.mark.parametrize("window", [0, 3])
def test_mla_matches_numpy_hf_reference(q_lora, window):
    mla = make(mla_config(q_lora, sliding_window_size=window))
    x, positions, segments = inputs()
    out = run(mla, x, positions, segments)
    expected = reference(hf_weights(mla), x, positions, segments, window)
    # float32 module vs float64 reference: measured max |diff| 4.9e-7 - 7.5e-7 on outputs up to 2.8
    np.testing.assert_allclose(out, expected, atol=5e-6, rtol=0)
    # the packed second document equals that document alone (and the mask is what makes it so)
    alone = run(mla, x[1:, 4:], positions[1:, 4:], np.ones((1, 6), np.int32))
    np.testing.assert_allclose(out[1:, 4:], alone, atol=2e-5)
    unpacked = run(mla, x[1:], positions[1:], np.ones((1, 10), np.int32))
    assert np.abs(unpacked[:, 4:] - alone).max() > 1e-2


def test_mla_param_names_and_shapes():
    with_lora = {k: v.shape for k, v in _params(make(mla_config(12))).items()}
    assert with_lora == {
        "wq_a/kernel": (D, 12),
        "q_norm/scale": (12,),
        "wq_b/kernel": (12, H, NOPE + ROPE),
        "wkv_a/kernel": (D, KV_LORA + ROPE),
        "kv_norm/scale": (KV_LORA,),
        "wkv_b/kernel": (KV_LORA, H, NOPE + V),
        "out/kernel": (H, V, D),
    }
    plain = set(_params(make(mla_config(0))))
    assert plain == {"wq/kernel", "wkv_a/kernel", "kv_norm/scale", "wkv_b/kernel", "out/kernel"}


def test_mla_softmax_multiplier_follows_mscale_all_dim():
    x, positions, segments = inputs()
    off = make(mla_config(12, mscale_all_dim=0.0))  # HF: no multiplier, cos/sin x m(40) instead
    on = make(mla_config(12))
    assert on.scale == pytest.approx((NOPE + ROPE) ** -0.5 * (0.1 * math.log(40) + 1) ** 2, rel=1e-12)
    assert off.scale == pytest.approx((NOPE + ROPE) ** -0.5, rel=1e-12)
    assert np.abs(run(on, x, positions, segments) - run(off, x, positions, segments)).max() > 1e-2


@pytest.mark.parametrize("q_lora", [12, 0])
def test_mla_gradients_reach_every_parameter(q_lora):
    mla = make(mla_config(q_lora))
    x, positions, segments = inputs()
    graphdef, params = nnx.split(mla, nnx.Param)
    cot = jnp.asarray(np.random.default_rng(0).normal(size=(2, 10, D)), jnp.float32)

    def loss(p):
        out = nnx.merge(graphdef, p)(jnp.asarray(x, jnp.float32), jnp.asarray(positions), jnp.asarray(segments))
        return jnp.sum(out * cot)

    grads = nnx.to_flat_state(jax.grad(loss)(params))
    assert len(grads) == (7 if q_lora else 5)
    for path, g in grads:
        assert float(jnp.linalg.norm(g[...])) > 1e-3, path


def test_mla_sharded_equals_unsharded():
    """fsdp 2 x context 2 x tensor 2 on 8 fake devices: same values as one device (ring attention;
    10 tokens do not split into the 2 x 2 halves of load balancing)."""
    cfg = mla_config(
        12, ici_fsdp_parallelism=2, ici_context_parallelism=2, ici_tensor_parallelism=2, context_parallel_load_balance=False
    )
    mla = make(cfg)
    x, positions, segments = (np.concatenate([a, a[::-1]]) for a in inputs())  # batch 4
    expected = run(mla, x, positions, segments)
    mesh, rules = make_mesh(cfg), cfg.logical_axis_rules
    graphdef, params = nnx.split(mla, nnx.Param)
    params = jax.device_put(params, state_shardings(params, mesh, rules))
    assert any(len(leaf.sharding.device_set) == 8 and not leaf.sharding.is_fully_replicated for leaf in jax.tree.leaves(params))

    @jax.jit
    def apply(p, x, positions, segments):
        with activate(mesh, rules):
            return nnx.merge(graphdef, p)(x, positions, segments)

    out = apply(params, jnp.asarray(x, jnp.float32), jnp.asarray(positions), jnp.asarray(segments))
    # measured: max |diff| 3.6e-7 (partial sums in a different order)
    np.testing.assert_allclose(np.asarray(out), expected, atol=5e-6, rtol=0)
