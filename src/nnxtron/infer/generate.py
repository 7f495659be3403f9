"""Generation with the config's sampler, several tokens per call of the device.

``infer.decode.decode`` returns to the host after every token: the host reads the logits,
samples, and dispatches the next step. On an accelerator that round trip costs as much as
the step itself (a 552M model at batch 1 on a TPU v5e: 2.5 ms a token against 1.6 ms for
the same step looped on the chip). Here one jitted call runs up to ``tokens_per_call``
steps in a ``jax.lax.while_loop`` — sample (``infer.sample.Sampling``, the key sequence of
the host sampler), stop tokens, the degenerate-logits check, the cached forward of the new
tokens — and returns the tokens to stream. The loop ends early once every row has stopped
or some row's logits cannot be sampled (``infer.decode.logit_faults``).
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nnxtron.config.schema import Config
from nnxtron.infer.decode import CachedModel, logit_faults, prefill, raise_degenerate
from nnxtron.infer.sample import Sampling, sampling
from nnxtron.layers.kv_cache import CacheEntry

TOKENS_PER_CALL = 32  # at most this many tokens per dispatch: they stream in bursts of this size


def generate(
    model: nnx.Module,
    prompts: Sequence[Sequence[int]],
    cfg: Config,
    max_new_tokens: int,
    stop_ids: Sequence[int] = (),
    tokens_per_call: int = TOKENS_PER_CALL,
) -> Iterator[list[int | None]]:
    """Yield one list per decoding step: each row's new token, or None once the row has
    stopped (a stop token, or ``max_new_tokens``). Sampling follows ``cfg.decode_sampling_*``;
    the tokens are those ``infer.decode.decode`` draws with ``infer.decode.sampler(cfg)``,
    computed ``tokens_per_call`` at a time."""
    cached, caches, last, lengths = prefill(model, prompts, max_new_tokens)
    produced = 0
    calls = device_calls(cached, caches, last, jnp.asarray(lengths), sampling(cfg), stop_ids, max_new_tokens, tokens_per_call)
    for tokens, was_done, ran, fault, wanted in calls:
        for i in range(ran):
            yield [None if d else int(t) for t, d in zip(tokens[i], was_done[i])]
        produced += ran
        if ran < wanted:  # every row stopped, or a fault
            raise_degenerate(*map(bool, fault[:2]), float(fault[2]), last.shape[-1], produced, cfg.dtype)
            return


def device_calls(
    cached: CachedModel,
    caches: dict,
    last: jax.Array,
    positions: jax.Array,
    draw: Sampling,
    stop_ids: Sequence[int],
    max_new_tokens: int,
    tokens_per_call: int,
) -> Iterator[tuple[np.ndarray, np.ndarray, int, tuple, int]]:
    """The calls of the device loop after a prefill (``caches``, each row's ``last`` logits
    and next ``positions``): per call ``(tokens [tokens_per_call, B], done before each token,
    tokens run, fault, tokens wanted)``. Each call is dispatched before the previous one's
    tokens are fetched, so the device never waits for the host."""
    batch = last.shape[0]
    chunk = jitted_chunk(cached.graphdef, draw, tuple(sorted(set(stop_ids))), batch, tokens_per_call)
    carry = (caches, last, draw.first_key(), positions, jnp.zeros(batch, bool))
    dispatched: deque = deque()
    for first in range(0, max_new_tokens, tokens_per_call):
        wanted = min(tokens_per_call, max_new_tokens - first)
        *carry, out = chunk(cached.params, cached.state, *carry, jnp.int32(wanted))  # not waited for
        dispatched.append((out, wanted))
        while len(dispatched) == 2 or (dispatched and first + wanted == max_new_tokens):
            out, wanted_then = dispatched.popleft()
            tokens, was_done, ran, fault = jax.device_get(out)
            yield tokens, was_done, int(ran), fault, wanted_then
            if ran < wanted_then:  # every row stopped, or a fault: the call dispatched after it is dropped
                return


@functools.lru_cache(maxsize=16)
def jitted_chunk(graphdef: nnx.GraphDef, draw: Sampling, stop_ids: tuple[int, ...], batch: int, steps: int) -> Callable:
    """The jitted loop of up to ``steps`` tokens for one model structure, sampling, stop
    tokens and batch (the caches are donated): ``(params, state, caches, last logits [B, V],
    key, positions [B], done [B], wanted)`` → the new caches, last logits, key, positions,
    done and ``(tokens [steps, B], done before each token, tokens run, fault)``."""
    stops = jnp.asarray(stop_ids or (-1,), jnp.int32)

    def chunk(params, state, caches, last, key, positions, done, wanted):
        tokens = jnp.zeros((steps, batch), jnp.int32)
        was_done = jnp.zeros((steps, batch), bool)
        no_fault = (jnp.bool_(False), jnp.bool_(False), jnp.float32(0))

        def running(carry):
            i, _, _, _, _, done, _, _, fault = carry
            return (i < wanted) & ~done.all() & ~(fault[0] | fault[1])

        def body(carry):
            i, caches, last, key, positions, done, tokens, was_done, _ = carry
            fault = logit_faults(last, ~done)
            key, chosen = draw.draw(key, last)
            chosen = chosen.astype(jnp.int32)
            tokens, was_done = tokens.at[i].set(chosen), was_done.at[i].set(done)
            done = done | jnp.isin(chosen, stops)
            model = nnx.merge(graphdef, params, caches, state)
            logits = model(chosen[:, None], positions[:, None], (~done).astype(jnp.int32)[:, None]).logits
            caches = nnx.to_pure_dict(nnx.state(model, CacheEntry))
            i = jnp.where(fault[0] | fault[1], i, i + 1)  # a faulty token is not counted
            return i, caches, logits[:, 0], key, positions + 1, done, tokens, was_done, fault

        init = (jnp.int32(0), caches, last, key, positions, done, tokens, was_done, no_fault)
        i, caches, last, key, positions, done, tokens, was_done, fault = jax.lax.while_loop(running, body, init)
        return caches, last, key, positions, done, (tokens, was_done, i, fault)

    return jax.jit(chunk, donate_argnums=(2,))
