"""The floor of batch-1 decoding on an accelerator: a bare, hand-written decode loop of docs/tpu.md's
552M Llama-style model (8 layers, emb 2048, 32 query / 8 key-value heads of 64, MLP 8192, vocab
32000, bfloat16 weights, RMS norms, greedy argmax, no RoPE or sampling), 256 tokens after a
512-token cache, in one ``jax.lax.fori_loop``, against the weights' HBM bound.

Two ways of writing each token's keys and values into the ``[B, heads, slots, head_dim]`` cache:
``dynamic_update_slice`` at the position, and the scatter ``TokenCache._scatter_rows`` does
(``.at[rows, :, slots].set(mode="drop")``, with its positions array and the mask read from it).
The gap between the two is what ``TokenCache._update_one`` (the in-place write of batch-1
decoding) is for; the gap between this floor and ``nnxtron bench --decode``'s ``generate`` is
what the rest of nnxtron's step (RoPE, masks, sampling, stop tokens, the finiteness check) costs.

    python benchmarks/tpu_decode_floor.py [--out FILE.json]   # on the accelerator; ~1 min
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from jax import lax

LAYERS, EMB, HEADS, KV_HEADS, HEAD_DIM, MLP, VOCAB = 8, 2048, 32, 8, 64, 8192, 32000
PROMPT, NEW = 512, 256
SLOTS = PROMPT + NEW
HBM_BYTES_PER_S = 819e9  # TPU v5e
WRITES = ("dynamic_update_slice", "scatter")


def weights(seed: int = 0) -> tuple[list[dict[str, jax.Array]], jax.Array]:
    keys = iter(jax.random.split(jax.random.PRNGKey(seed), 6 * LAYERS + 1))

    def draw(*shape: int) -> jax.Array:
        return (jax.random.normal(next(keys), shape, jnp.float32) * 0.02).astype(jnp.bfloat16)

    layers = [
        dict(wq=draw(EMB, HEADS * HEAD_DIM), wk=draw(EMB, KV_HEADS * HEAD_DIM), wv=draw(EMB, KV_HEADS * HEAD_DIM),
             wo=draw(HEADS * HEAD_DIM, EMB), wg=draw(EMB, 2 * MLP), wd=draw(MLP, EMB))
        for _ in range(LAYERS)
    ]  # fmt: skip
    return layers, draw(VOCAB, EMB)


def rms(x: jax.Array) -> jax.Array:
    return x * lax.rsqrt(jnp.mean(jnp.square(x.astype(jnp.float32)), -1, keepdims=True) + 1e-5).astype(x.dtype)


def empty_cache(write: str) -> list[dict[str, jax.Array]]:
    cache = {
        "k": jnp.zeros((1, KV_HEADS, SLOTS, HEAD_DIM), jnp.bfloat16),
        "v": jnp.zeros((1, KV_HEADS, SLOTS, HEAD_DIM), jnp.bfloat16),
    }
    if write == "scatter":
        cache["positions"] = jnp.full((1, SLOTS), -1, jnp.int32)
    return [dict(cache) for _ in range(LAYERS)]


def attend(q: jax.Array, k: jax.Array, v: jax.Array, cache: dict, pos: jax.Array, write: str) -> jax.Array:
    """One token's attention over the cache after writing its key and value (the cache is updated in place)."""
    if write == "dynamic_update_slice":
        cache["k"] = lax.dynamic_update_slice(cache["k"], k[:, :, None], (0, 0, pos, 0))
        cache["v"] = lax.dynamic_update_slice(cache["v"], v[:, :, None], (0, 0, pos, 0))
        visible = (jnp.arange(SLOTS) <= pos)[None, None, None]
    else:
        rows, slots = jnp.zeros((1, 1), jnp.int32), jnp.full((1, 1), pos, jnp.int32)
        cache["k"] = cache["k"].at[rows, :, slots].set(k[:, None], mode="drop")
        cache["v"] = cache["v"].at[rows, :, slots].set(v[:, None], mode="drop")
        cache["positions"] = cache["positions"].at[rows, slots].set(jnp.full((1, 1), pos), mode="drop")
        held = cache["positions"]
        visible = ((held >= 0) & (held <= pos))[:, None, None]
    scores = jnp.einsum("bhgd,bhsd->bhgs", q, cache["k"], preferred_element_type=jnp.float32) * HEAD_DIM**-0.5
    probs = jax.nn.softmax(jnp.where(visible, scores, -1e30), axis=-1).astype(jnp.bfloat16)
    return jnp.einsum("bhgs,bhsd->bhgd", probs, cache["v"], preferred_element_type=jnp.float32).astype(jnp.bfloat16)


def decode_loop(write: str):
    def token(carry, layers, table):
        x, caches, pos = carry
        caches = [dict(c) for c in caches]
        for p, cache in zip(layers, caches):
            h = rms(x)
            q = (h @ p["wq"]).reshape(1, KV_HEADS, HEADS // KV_HEADS, HEAD_DIM)
            k, v = (h @ p["wk"]).reshape(1, KV_HEADS, HEAD_DIM), (h @ p["wv"]).reshape(1, KV_HEADS, HEAD_DIM)
            x = x + attend(q, k, v, cache, pos, write).reshape(1, HEADS * HEAD_DIM) @ p["wo"]
            gate, up = jnp.split(rms(x) @ p["wg"], 2, axis=-1)
            x = x + (jax.nn.silu(gate) * up) @ p["wd"]
        logits = jnp.einsum("bd,vd->bv", x, table, preferred_element_type=jnp.float32)
        return table[jnp.argmax(logits, -1)], caches, pos + 1

    @jax.jit
    def run(layers, table, caches, x):
        return lax.fori_loop(0, NEW, lambda _, carry: token(carry, layers, table), (x, caches, jnp.int32(PROMPT)))

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    layers, table = weights()
    weight_bytes = sum(w.nbytes for p in layers for w in p.values()) + table.nbytes
    bound_ms = weight_bytes / HBM_BYTES_PER_S * 1e3
    loops = {write: decode_loop(write) for write in WRITES}
    for write, loop in loops.items():  # compile and warm up
        jax.block_until_ready(loop(layers, table, empty_cache(write), table[:1]))
    times: dict[str, list[float]] = {write: [] for write in WRITES}
    for _ in range(args.repeats):  # interleaved
        for write, loop in loops.items():
            cache = empty_cache(write)
            start = time.perf_counter()
            jax.block_until_ready(loop(layers, table, cache, table[:1]))
            times[write].append((time.perf_counter() - start) / NEW * 1e3)
    result = {
        "device": jax.devices()[0].device_kind, "jax": jax.__version__, "weight_bytes": weight_bytes,
        "hbm_bound_ms_per_token": bound_ms, "ms_per_token": times,
        "fraction_of_hbm_bound": {write: bound_ms / min(t) for write, t in times.items()},
    }  # fmt: skip
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
