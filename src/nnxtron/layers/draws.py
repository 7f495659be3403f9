"""The random draws of a fresh model's parameters, each one small jitted program.

Every seeded initial value is drawn in float32 by a function here (callers cast to their weight
dtype). Each is ``jax.jit``-ed with its shape and scale static, so:

- inside the jitted init (``train/state.py``) it is inlined: the program, and its values, are
  what they were without the wrapper;
- run op by op (``train/state.py``'s init of a small model on a CPU, ``models.build.build_model``)
  each distinct draw is compiled once per process, and gives the same bits as the whole jitted
  init (the draw's ops are compiled together either way; checked for every family in
  tests/unit/test_draws.py). Op by op without the wrapper the last bit differed (the
  initialiser's scale multiplied in a program of its own).

Why not just one jitted init: its compile grows faster than its number of draws (XLA:CPU, 50
truncated normals 2.9 s, 100 7.4 s, 200 19.2 s), and a fresh deepseek4-test took 7.5 s to
initialise as one program against 2.0 s drawn op by op (gemma3-tiny 3.5 -> 0.7 s).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


@functools.partial(jax.jit, static_argnames=("shape", "stddev"))
def truncated_normal(key: jax.Array, shape: tuple[int, ...], stddev: float) -> jax.Array:
    """``jax.nn.initializers.truncated_normal(stddev)``: a normal truncated to [-2, 2], times ``stddev``."""
    return jax.nn.initializers.truncated_normal(stddev)(key, shape, jnp.float32)


@functools.partial(jax.jit, static_argnames=("shape", "stddev"))
def normal(key: jax.Array, shape: tuple[int, ...], stddev: float) -> jax.Array:
    """``jax.nn.initializers.normal(stddev)``."""
    return jax.nn.initializers.normal(stddev)(key, shape, jnp.float32)


@functools.partial(jax.jit, static_argnames=("shape", "low", "high", "log"))
def uniform(key: jax.Array, shape: tuple[int, ...], low: float, high: float, log: bool = False) -> jax.Array:
    """Uniform in ``[low, high)``; ``log``: its natural logarithm, in the same program (Qwen3-Next's ``A_log``)."""
    values = jax.random.uniform(key, shape, jnp.float32, low, high)
    return jnp.log(values) if log else values


@functools.partial(jax.jit, static_argnames=("vocab", "experts", "k"))
def random_hash_table(key: jax.Array, vocab: int, experts: int, k: int) -> jax.Array:
    """``k`` distinct random experts per token id ``[vocab, k]`` int32 (a fresh DeepSeek-V4 hash-routed layer's table)."""
    return jnp.argsort(jax.random.uniform(key, (vocab, experts)), axis=-1)[:, :k].astype(jnp.int32)
