"""Host overhead of nnxtron's train step against a minimal plain-JAX train step.

Both sides compute the identical function: a Llama forward (embedding, RMSNorm, RoPE
rotate-half, GQA causal attention with a segment mask, SwiGLU, final norm, untied head),
token-mean cross-entropy with a loss mask, global-norm clipping and AdamW with the same
schedule and weight-decay mask, from the same parameter values on the same batch. The
plain side is written here from scratch over a dict of arrays under one ``jax.jit``.

The script first checks that both give the same loss and, after a few steps, the same
parameters; then it times both with interleaved repeats (median) on one device.

    python benchmarks/host_overhead.py [--emb 64 --layers 2 --batch 2 --seq 32 ...]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from nnxtron.config import Config, derive, load_config
from nnxtron.data.pipeline import SyntheticBatches
from nnxtron.parallel.mesh import make_mesh
from nnxtron.params import flatten
from nnxtron.train.optimizer import learning_rate_schedule, make_optimizer
from nnxtron.train.state import init_state, setup
from nnxtron.train.step import batch_sharding, device_batch, make_train_step

Params = dict[str, Any]
LAYER_NAMES = {  # plain name -> nnxtron path inside a layer
    "attn_norm": "pre_attention_norm/scale", "wq": "attention/query/kernel", "wk": "attention/key/kernel",
    "wv": "attention/value/kernel", "wo": "attention/out/kernel", "mlp_norm": "post_attention_norm/scale",
    "w_gate": "mlp/wi_0/kernel", "w_up": "mlp/wi_1/kernel", "w_down": "mlp/wo/kernel",
}  # fmt: skip
REMAT = {"full": jax.checkpoint_policies.nothing_saveable, "minimal": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}
MODEL_KEYS = (
    "base_emb_dim base_num_query_heads base_num_kv_heads head_dim base_mlp_dim base_num_decoder_layers vocab_size "
    "max_target_length dtype scan_layers remat_policy"
).split()
DEFAULT_OUT = Path(__file__).parent / "results" / "host_overhead-cpu.json"


# --- the plain-JAX model, loss and optimizer ------------------------------------------


def rms_norm(x: jax.Array, scale: jax.Array, eps: float, dtype: Any) -> jax.Array:
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return scale.astype(dtype) * normed.astype(dtype)


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotate-half RoPE of x [B, S, N, hd]; float32 frequencies, cos/sin cast to x.dtype."""
    hd = x.shape[-1]
    inv = 1.0 / np.power(np.float32(theta), np.arange(0, hd, 2).astype(np.float32) / np.float32(hd))
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv, jnp.float32)
    cos, sin = (f(angles).astype(x.dtype)[:, :, None, :] for f in (jnp.cos, jnp.sin))
    first, second = x[..., : hd // 2], x[..., hd // 2 :]
    return jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)


def attention(x: jax.Array, p: Params, positions: jax.Array, segment_ids: jax.Array, cfg: Config) -> jax.Array:
    dtype = jnp.dtype(cfg.dtype)
    batch, seq, _ = x.shape
    kv, hd = cfg.base_num_kv_heads, cfg.resolved_head_dim
    q = rope(jnp.einsum("bsd,dnh->bsnh", x, p["wq"].astype(dtype)), positions, cfg.rope_max_timescale)
    k = rope(jnp.einsum("bsd,dnh->bsnh", x, p["wk"].astype(dtype)), positions, cfg.rope_max_timescale)
    v = jnp.einsum("bsd,dnh->bsnh", x, p["wv"].astype(dtype))
    q = q.reshape(batch, seq, kv, cfg.base_num_query_heads // kv, hd)
    scores = jnp.einsum("bskgd,btkd->bkgst", q, k) * jnp.asarray(hd**-0.5, dtype)
    idx = jnp.arange(seq)
    visible = idx[None, :] <= idx[:, None]
    if cfg.sliding_window_size > 0:
        visible &= idx[:, None] - idx[None, :] < cfg.sliding_window_size
    mask = visible[None] & (segment_ids[:, :, None] == segment_ids[:, None, :])
    scores = jnp.where(mask[:, None, None], scores.astype(jnp.float32), jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(dtype)
    out = jnp.einsum("bkgst,btkd->bskgd", probs, v).reshape(batch, seq, -1, hd)
    return jnp.einsum("bsnh,nhd->bsd", out, p["wo"].astype(dtype))


def block(x: jax.Array, p: Params, positions: jax.Array, segment_ids: jax.Array, cfg: Config) -> jax.Array:
    eps, dtype = cfg.normalization_layer_epsilon, jnp.dtype(cfg.dtype)
    h = x + attention(rms_norm(x, p["attn_norm"], eps, dtype), p, positions, segment_ids, cfg)
    y = rms_norm(h, p["mlp_norm"], eps, dtype)
    gate = jax.nn.silu(y @ p["w_gate"].astype(dtype)) * (y @ p["w_up"].astype(dtype))
    return h + gate @ p["w_down"].astype(dtype)


def forward(params: Params, batch: dict[str, jax.Array], cfg: Config) -> jax.Array:
    """Float32 logits [B, S, V]. Layers: a stacked dict (scanned) or a list of dicts."""
    dtype = jnp.dtype(cfg.dtype)
    x = jnp.take(params["embed"], batch["inputs"], axis=0).astype(dtype)
    pos, seg = batch["positions"], batch["segment_ids"]
    layer = lambda x, p: block(x, p, pos, seg, cfg)  # noqa: E731
    if cfg.remat_policy != "none":
        layer = jax.checkpoint(layer, policy=REMAT[cfg.remat_policy], prevent_cse=not cfg.scan_layers)  # as nnxtron
    if cfg.scan_layers:
        x, _ = jax.lax.scan(lambda c, p: (layer(c, p), None), x, params["layers"])
    else:
        for p in params["layers"]:
            x = layer(x, p)
    x = rms_norm(x, params["final_norm"], cfg.normalization_layer_epsilon, dtype)
    return (x @ params["head"].astype(dtype)).astype(jnp.float32)


def loss_fn(params: Params, batch: dict[str, jax.Array], cfg: Config) -> tuple[jax.Array, jax.Array]:
    """Token-mean cross-entropy over loss_mask, and the number of counted tokens."""
    logits = forward(params, batch, cfg)
    per_token = jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, batch["targets"][..., None], -1)[..., 0]
    weights = batch["loss_mask"].astype(jnp.float32)
    count = jnp.sum(weights)
    return jnp.sum(per_token * weights) / jnp.maximum(count, 1.0), count


def plain_optimizer(cfg: Config, schedule: optax.Schedule) -> optax.GradientTransformation:
    """nnxtron's settings: clip by global norm, AdamW; no decay on norm scales (vectors)."""

    def mask(params: Params) -> Params:
        return jax.tree_util.tree_map_with_path(lambda path, _: not str(path[-1].key).endswith("norm"), params)

    parts = [optax.clip_by_global_norm(cfg.gradient_clipping_threshold)] if cfg.gradient_clipping_threshold > 0 else []
    parts.append(optax.adamw(schedule, cfg.adam_b1, cfg.adam_b2, cfg.adam_eps, weight_decay=cfg.adam_weight_decay, mask=mask))
    return optax.chain(*parts)


def make_plain_step(cfg: Config, tx: optax.GradientTransformation, schedule: optax.Schedule) -> Callable:
    """``step(params, opt_state, step, batch) -> (params, opt_state, step, metrics)``, all donated."""

    def step(params, opt_state, count, batch):
        (loss, tokens), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch, cfg)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        # the same non-finite guard as nnxtron's step (policy stop: report, do not mask the update):
        # loss and gradients, and the updated parameters and optimizer state
        squares = jnp.stack([jnp.sum(jnp.square(g.astype(jnp.float32))) for g in jax.tree.leaves(grads)])
        gradients_finite = jnp.isfinite(loss) & jnp.all(jnp.isfinite(squares))
        state_finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves((params, opt_state))
                                          if jnp.issubdtype(x.dtype, jnp.inexact)]))  # fmt: skip
        finite = gradients_finite & state_finite
        metrics = {"loss": loss, "tokens": tokens, "grad_norm": jnp.sqrt(jnp.sum(squares)),
                   "learning_rate": jnp.asarray(schedule(count), jnp.float32),
                   "non_finite_leaf": jnp.where(gradients_finite, -1, jnp.argmax(~jnp.isfinite(squares))).astype(jnp.int32),
                   "non_finite_state": (gradients_finite & ~state_finite).astype(jnp.float32),
                   "skipped": (~finite).astype(jnp.float32)}  # fmt: skip
        return params, opt_state, count + 1, metrics

    return jax.jit(step, donate_argnums=(0, 1, 2))


# --- nnxtron side, conversion and the shared batch ---------------------------------------


def bench_config(args: argparse.Namespace) -> Config:
    overrides = [
        f"base_emb_dim={args.emb}", f"base_num_query_heads={args.heads}", f"base_num_kv_heads={args.kv_heads}",
        f"head_dim={args.emb // args.heads}", f"base_mlp_dim={args.mlp}", f"base_num_decoder_layers={args.layers}",
        f"vocab_size={args.vocab}", f"per_device_batch_size={args.batch}", f"max_target_length={args.seq}",
        f"dtype={args.dtype}", f"weight_dtype={args.dtype}", f"scan_layers={args.scan_layers}",
        f"remat_policy={args.remat}", "dataset_type=synthetic", "eval_interval=-1", "enable_checkpointing=false",
        *args.set,
    ]  # fmt: skip
    return load_config(None, overrides)


def to_plain(params: nnx.State, cfg: Config) -> Params:
    """nnxtron parameters -> the plain dict (fresh copies: nnxtron's state is donated)."""
    flat = {k: jnp.array(np.asarray(v)) for k, v in flatten(params).items()}
    layer = lambda prefix: {name: flat[f"{prefix}{path}"] for name, path in LAYER_NAMES.items()}  # noqa: E731
    if cfg.scan_layers:
        layers: Any = layer("layers/layers/")
    else:
        layers = [layer(f"layers/layers/{i}/") for i in range(cfg.base_num_decoder_layers)]
    top = {"embed": "embed/embedding", "final_norm": "final_norm/scale", "head": "logits/kernel"}
    return {"layers": layers, **{name: flat[path] for name, path in top.items()}}


def packed_batch(cfg: Config, batch_size: int) -> dict[str, np.ndarray]:
    """A synthetic batch shaped like packed text: two documents and a padded tail per row."""
    out = SyntheticBatches(cfg.vocab_size, cfg.max_target_length, batch_size, seed=cfg.data_shuffle_seed).batch(0)
    seq = cfg.max_target_length
    cut, pad = seq // 3, seq - seq // 4
    t = np.arange(seq)
    seg = np.where(t < cut, 1, np.where(t < pad, 2, 0)).astype(np.int32)
    out["segment_ids"] = np.broadcast_to(seg, (batch_size, seq)).copy()
    out["positions"] = np.broadcast_to(np.where(t < cut, t, t - cut).astype(np.int32), (batch_size, seq)).copy()
    out["loss_mask"] = np.broadcast_to(((t != cut - 1) & (seg > 0)).astype(np.float32), (batch_size, seq)).copy()
    return out


class Pair:
    """Both train steps, their states and the shared batch, on one device."""

    def __init__(self, cfg: Config):
        if cfg.rope_type != "default" or cfg.rope_interleave or cfg.logits_via_embedding or cfg.final_logits_soft_cap:
            raise ValueError("the plain implementation covers rope_type=default, rotate-half, untied head, no soft cap")
        device = jax.devices()[0]
        derived = derive(cfg, 1)
        mesh = make_mesh(cfg, [device])
        tx, schedule = make_optimizer(cfg, derived)
        model_setup = setup(cfg, mesh, tx)
        self.nnx_step = make_train_step(cfg, model_setup, tx, schedule)
        self.nnx_state = init_state(cfg, model_setup, tx)
        host = packed_batch(cfg, derived.global_batch_size)
        self.nnx_batch = device_batch(host, batch_sharding(cfg, model_setup))
        self.batch = {k: jax.device_put(v, device) for k, v in host.items()}
        plain_schedule = learning_rate_schedule(cfg, derived)
        self.plain_tx = plain_optimizer(cfg, plain_schedule)
        self.plain_step = make_plain_step(cfg, self.plain_tx, plain_schedule)
        params = to_plain(self.nnx_state["params"], cfg)  # committed to the device like the step's outputs (no recompile)
        self.plain_state = jax.device_put((params, self.plain_tx.init(params), jnp.zeros((), jnp.int32)), device)
        self.cfg = cfg

    def run_nnx(self, n: int) -> dict[str, jax.Array]:
        for _ in range(n):
            self.nnx_state, metrics = self.nnx_step(self.nnx_state, self.nnx_batch)
        return metrics

    def run_plain(self, n: int) -> dict[str, jax.Array]:
        for _ in range(n):
            *state, metrics = self.plain_step(*self.plain_state, self.batch)
            self.plain_state = tuple(state)
        return metrics

    def sync(self) -> None:
        jax.block_until_ready((self.nnx_state, self.plain_state))


def rel_diff(a: Params, b: Params) -> float:
    """Largest per-leaf relative L2 difference ||a - b|| / ||b||."""
    leaves = zip(map(np.asarray, jax.tree.leaves(a)), map(np.asarray, jax.tree.leaves(b)), strict=True)
    return max(float(np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-30)) for x, y in leaves)


def check_parity(pair: Pair, steps: int = 3, rtol: float = 1e-5) -> dict[str, float]:
    """Assert equal losses at every step and equal parameters after ``steps`` steps."""
    start = jax.tree.map(np.asarray, pair.plain_state[0])  # a copy: the state is donated
    losses = []
    for _ in range(steps):
        a, b = pair.run_nnx(1), pair.run_plain(1)
        losses.append((float(a["loss"]), float(b["loss"])))
        for key in a:
            assert np.isclose(float(a[key]), float(b[key]), rtol=rtol, atol=0), f"{key}: nnxtron {a[key]} != plain {b[key]}"
    nnx_params = jax.tree.map(np.asarray, to_plain(pair.nnx_state["params"], pair.cfg))
    plain_params = jax.tree.map(np.asarray, pair.plain_state[0])
    params_rel = rel_diff(nnx_params, plain_params)
    delta = lambda p: jax.tree.map(lambda x, s: x - s, p, start)  # noqa: E731
    update_rel = rel_diff(delta(nnx_params), delta(plain_params))
    moments_rel = max(  # Adam moments see the clipped gradients (Adam's update alone is scale-free)
        rel_diff(to_plain(optax.tree_utils.tree_get(pair.nnx_state["opt_state"], name), pair.cfg),
                 optax.tree_utils.tree_get(pair.plain_state[1], name))
        for name in ("mu", "nu")
    )  # fmt: skip
    assert params_rel <= rtol, f"parameters differ after {steps} steps: rel {params_rel:.2e} > {rtol}"
    assert update_rel <= 1e3 * rtol, f"parameter updates differ after {steps} steps: rel {update_rel:.2e}"
    assert moments_rel <= 1e3 * rtol, f"Adam moments differ after {steps} steps: rel {moments_rel:.2e}"
    return {"steps": steps, "loss_first": losses[0][0], "loss_first_plain": losses[0][1],
            "max_param_rel_diff": params_rel, "max_update_rel_diff": update_rel, "max_moment_rel_diff": moments_rel}  # fmt: skip


def time_pair(pair: Pair, repeats: int, steps: int) -> dict[str, list[float]]:
    """Seconds per step of each side, ``repeats`` interleaved runs of ``steps`` steps.

    ``sync``: every step waits for its result (latency); ``async``: one wait after the
    run, so dispatch of step i+1 overlaps step i (throughput, as in the Trainer).
    """
    out: dict[str, list[float]] = {f"{side}_{mode}": [] for side in ("nnxtron", "plain") for mode in ("sync", "async")}
    runs = {"nnxtron": pair.run_nnx, "plain": pair.run_plain}
    for r in range(repeats):
        order = ("nnxtron", "plain") if r % 2 == 0 else ("plain", "nnxtron")
        for side in order:
            pair.sync()
            t0 = time.perf_counter()
            for _ in range(steps):
                jax.block_until_ready(runs[side](1))
            out[f"{side}_sync"].append((time.perf_counter() - t0) / steps)
            t0 = time.perf_counter()
            runs[side](steps)
            pair.sync()
            out[f"{side}_async"].append((time.perf_counter() - t0) / steps)
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, default in (("emb", 64), ("layers", 2), ("heads", 4), ("kv-heads", 2), ("mlp", 176), ("vocab", 256),
                          ("batch", 2), ("seq", 32), ("repeats", 30), ("steps", 50)):  # fmt: skip
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--scan-layers", default="true", choices=["true", "false"])
    parser.add_argument("--remat", default="full", choices=["none", "full", "minimal"])
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="any other nnxtron config override")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where to write the JSON result ('-' = don't)")
    return parser


def xla_cost(pair: Pair) -> dict[str, dict[str, float]]:
    """XLA's cost analysis of both compiled steps: equal flops = the same computation."""
    compiled = {"nnxtron": pair.nnx_step.lower(pair.nnx_state, pair.nnx_batch).compile(),
                "plain": pair.plain_step.lower(*pair.plain_state, pair.batch).compile()}  # fmt: skip
    out = {}
    for side, c in compiled.items():
        cost = c.cost_analysis()
        cost = (cost[0] if isinstance(cost, (list, tuple)) else cost) or {}
        out[side] = {k: float(cost.get(k, float("nan"))) for k in ("flops", "transcendentals", "bytes accessed")}
    return out


def pytree_us(tree: Any, number: int = 2000) -> float:
    """Microseconds to flatten and unflatten ``tree`` (host work of every jit call)."""
    treedef = jax.tree.structure(tree)
    t0 = time.perf_counter()
    for _ in range(number):
        jax.tree.unflatten(treedef, jax.tree.flatten(tree)[0])
    return 1e6 * (time.perf_counter() - t0) / number


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Check parity, time both steps, print and write the JSON result."""
    args = build_parser().parse_args(argv)
    cfg = bench_config(args)
    pair = Pair(cfg)
    t0 = time.perf_counter()
    parity = check_parity(pair)  # also compiles both steps
    first_seconds = time.perf_counter() - t0
    times = time_pair(pair, args.repeats, args.steps)
    medians = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "benchmark": "host_overhead",
        "model": {k: getattr(cfg, k) for k in MODEL_KEYS},
        "batch": args.batch,
        "repeats": args.repeats,
        "steps_per_repeat": args.steps,
        "parity": parity,
        "compile_and_parity_seconds": first_seconds,
        **{f"{k}_step_ms": 1e3 * v for k, v in medians.items()},
        "quartiles_ms": {k: [1e3 * q for q in statistics.quantiles(v, n=4)[::2]] for k, v in times.items() if len(v) > 1},
        "ratio_sync": medians["nnxtron_sync"] / medians["plain_sync"],
        "ratio_async": medians["nnxtron_async"] / medians["plain_async"],
        "xla_cost": xla_cost(pair),
        "state_leaves": len(jax.tree.leaves(pair.nnx_state)),
        "nnxtron_state_flatten_unflatten_us": pytree_us(pair.nnx_state),
        "plain_state_flatten_unflatten_us": pytree_us(pair.plain_state),
        "machine": {"backend": jax.default_backend(), "devices": jax.device_count(), "cpus": os.cpu_count()},
        "platform": platform.platform(),
        "versions": {"jax": jax.__version__, "flax": flax.__version__, "optax": optax.__version__},
    }
    print(json.dumps(result, indent=1))
    if str(args.out) != "-":
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
