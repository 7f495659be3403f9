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
# Tokens per iteration of the device loop where the caller names none, per backend: on a TPU the
# next token's first weights stream in while the previous token finishes (docs/tpu.md: a 552M
# model at batch 1, 256 tokens, 1.786 -> 1.740 ms a token); a CPU gains nothing from it.
TOKENS_PER_ITERATION = {"tpu": 2}


def default_tokens_per_iteration(backend: str) -> int:
    """The device loop's tokens per iteration on ``backend`` (``jax.default_backend()``)."""
    return TOKENS_PER_ITERATION.get(backend, 1)


def generate(
    model: nnx.Module,
    prompts: Sequence[Sequence[int]],
    cfg: Config,
    max_new_tokens: int,
    stop_ids: Sequence[int] = (),
    tokens_per_call: int = TOKENS_PER_CALL,
    tokens_per_iteration: int | None = None,
) -> Iterator[list[int | None]]:
    """Yield one list per decoding step: each row's new token, or None once the row has
    stopped (a stop token, or ``max_new_tokens``). Sampling follows ``cfg.decode_sampling_*``;
    the tokens are those ``infer.decode.decode`` draws with ``infer.decode.sampler(cfg)``,
    computed ``tokens_per_call`` at a time (``tokens_per_iteration``: see ``device_calls``;
    None: the backend's, :func:`default_tokens_per_iteration`)."""
    if tokens_per_iteration is None:
        tokens_per_iteration = default_tokens_per_iteration(jax.default_backend())
    cached, caches, last, lengths = prefill(model, prompts, max_new_tokens)
    produced = 0
    calls = device_calls(
        cached, caches, last, jnp.asarray(lengths), sampling(cfg), stop_ids, max_new_tokens, tokens_per_call, tokens_per_iteration
    )
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
    tokens_per_iteration: int = 1,
) -> Iterator[tuple[np.ndarray, np.ndarray, int, tuple, int]]:
    """The calls of the device loop after a prefill (``caches``, each row's ``last`` logits
    and next ``positions``): per call ``(tokens [tokens_per_call, B], done before each token,
    tokens run, fault, tokens wanted)``. Each call is dispatched before the previous one's
    tokens are fetched, so the device never waits for the host.

    ``tokens_per_iteration`` > 1 unrolls the loop (the default on a TPU): the next step's first
    weights then stream in while the previous step finishes. It computes the same function;
    in bfloat16 on a TPU its greedy tokens can leave the non-unrolled loop's where the top two
    logits lie within one bfloat16 step of each other, as the uncached forward's can (docs/tpu.md)."""
    batch = last.shape[0]
    stops = tuple(sorted(set(stop_ids)))
    chunk = jitted_chunk(cached.graphdef, draw, stops, batch, tokens_per_call, tokens_per_iteration)
    carry = (caches, last, draw.first_key(), positions, np.zeros(batch, bool))
    dispatched: deque = deque()
    for first in range(0, max_new_tokens, tokens_per_call):
        wanted = min(tokens_per_call, max_new_tokens - first)
        *carry, out = chunk(cached.params, cached.state, *carry, np.int32(wanted))  # not waited for
        dispatched.append((out, wanted))
        while len(dispatched) == 2 or (dispatched and first + wanted == max_new_tokens):
            out, wanted_then = dispatched.popleft()
            tokens, was_done, ran, fault = unpack_outputs(np.asarray(out), tokens_per_call, batch)
            yield tokens, was_done, ran, fault, wanted_then
            if ran < wanted_then:  # every row stopped, or a fault: the call dispatched after it is dropped
                return


def pack_outputs(tokens: jax.Array, was_done: jax.Array, ran: jax.Array, fault: tuple) -> jax.Array:
    """A call's outputs as one int32 vector, fetched in one transfer (each array fetched on its
    own costs a round trip: 1.2 ms for the six on a TPU): tokens, done flags, tokens run, the
    two fault flags and the fault value's float32 bits."""
    flags = jnp.stack([ran, fault[0].astype(jnp.int32), fault[1].astype(jnp.int32)])
    value = jax.lax.bitcast_convert_type(fault[2].astype(jnp.float32), jnp.int32)[None]
    return jnp.concatenate([tokens.reshape(-1), was_done.astype(jnp.int32).reshape(-1), flags, value])


def unpack_outputs(packed: np.ndarray, steps: int, batch: int) -> tuple[np.ndarray, np.ndarray, int, tuple]:
    """``pack_outputs`` undone on the host: ``(tokens [steps, B], done [steps, B], tokens run,
    (non-finite, flat, value))``."""
    n = steps * batch
    ran, nonfinite, flat = (int(v) for v in packed[2 * n : 2 * n + 3])
    value = float(packed[2 * n + 3 :].view(np.float32)[0])
    return packed[:n].reshape(steps, batch), packed[n : 2 * n].reshape(steps, batch).astype(bool), ran, (nonfinite, flat, value)


@functools.lru_cache(maxsize=16)
def jitted_chunk(
    graphdef: nnx.GraphDef, draw: Sampling, stop_ids: tuple[int, ...], batch: int, steps: int, unroll: int = 1
) -> Callable:
    """The jitted loop of up to ``steps`` tokens for one model structure, sampling, stop
    tokens and batch (the caches are donated), ``unroll`` tokens per iteration: ``(params,
    state, caches, last logits [B, V], key, positions [B], done [B], wanted)`` → the new
    caches, last logits, key, positions, done and ``pack_outputs(tokens [steps, B], done
    before each token, tokens run, fault)``.

    An unrolled iteration's later steps run only while the loop would still run (``active``):
    otherwise they change nothing — the model still runs, but as padding (segment 0: nothing
    cached) and every other value keeps its old one."""
    stops = jnp.asarray(stop_ids or (-1,), jnp.int32)

    def chunk(params, state, caches, last, key, positions, done, wanted):
        tokens = jnp.zeros((steps, batch), jnp.int32)
        was_done = jnp.zeros((steps, batch), bool)
        no_fault = (jnp.bool_(False), jnp.bool_(False), jnp.float32(0))

        def running(carry):
            i, _, _, _, _, done, _, _, fault = carry
            return (i < wanted) & ~done.all() & ~(fault[0] | fault[1])

        def token(carry, active):
            i, caches, last, key, positions, done, tokens, was_done, old_fault = carry
            fault = logit_faults(last, ~done)
            new_key, chosen = draw.draw(key, last)
            chosen = chosen.astype(jnp.int32)
            stopped = done | jnp.isin(chosen, stops)
            model = nnx.merge(graphdef, params, caches, state)
            live = (active & ~stopped).astype(jnp.int32)[:, None]
            logits = model(chosen[:, None], positions[:, None], live).logits
            caches = nnx.to_pure_dict(nnx.state(model, CacheEntry))
            counted = jnp.where(fault[0] | fault[1], i, i + 1)  # a faulty token is not counted
            fault = (fault[0], fault[1], fault[2].astype(jnp.float32))
            new = (
                counted,
                logits[:, 0],
                new_key,
                positions + 1,
                stopped,
                tokens.at[i].set(chosen),
                was_done.at[i].set(done),
                fault,
            )
            old = (i, last, key, positions, done, tokens, was_done, old_fault)
            i, last, key, positions, done, tokens, was_done, fault = jax.tree.map(lambda n, o: jnp.where(active, n, o), new, old)
            return i, caches, last, key, positions, done, tokens, was_done, fault

        def body(carry):
            carry = token(carry, jnp.bool_(True))  # the loop's condition held
            for _ in range(unroll - 1):
                carry = token(carry, running(carry))
            return carry

        init = (jnp.int32(0), caches, last, key, positions, done, tokens, was_done, no_fault)
        i, caches, last, key, positions, done, tokens, was_done, fault = jax.lax.while_loop(running, body, init)
        return caches, last, key, positions, done, pack_outputs(tokens, was_done, i, fault)

    return jax.jit(chunk, donate_argnums=(2,))
