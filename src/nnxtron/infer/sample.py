"""Sampling (greedy, temperature, top-k, nucleus) and the uncached reference generator.

``sample_logits`` is the sampler of every decoding path. ``generate_tokens`` reruns the
full forward pass over a fixed-length buffer for each new token (one compile per
prompt-length bucket): exact but O(n^2), kept as the reference that KV-cached decoding
(``infer.decode``) is tested against.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nnxtron.config.schema import Config


def sample_logits(logits: jax.Array, key: jax.Array, strategy: str, temperature: float, top_k: int, top_p: float) -> jax.Array:
    """One token id per row of ``logits`` [B, V]."""
    if strategy == "greedy":
        return jnp.argmax(logits, axis=-1)
    logits = logits.astype(jnp.float32) / temperature
    if strategy == "topk":
        kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    elif strategy == "nucleus":
        sorted_logits = jnp.sort(logits, axis=-1)[..., ::-1]
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        cumulative = jnp.cumsum(probs, axis=-1)
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        cutoff_index = jnp.sum(cumulative - probs < top_p, axis=-1, keepdims=True) - 1
        cutoff = jnp.take_along_axis(sorted_logits, cutoff_index, axis=-1)
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    elif strategy != "weighted":
        raise ValueError(f"unknown sampling strategy '{strategy}'")
    return jax.random.categorical(key, logits, axis=-1)


@dataclass(frozen=True)
class Sampling:
    """A config's ``decode_sampling_*``: each new token is drawn with a fresh key split from
    ``seed``'s, the same sequence on the host (``infer.decode.sampler``) and on the device
    (``infer.generate``). Hashable: a jitted decoding loop is compiled per sampling."""

    strategy: str
    temperature: float
    top_k: int
    top_p: float
    seed: int

    def first_key(self) -> jax.Array:
        return jax.random.key(self.seed)

    def draw(self, key: jax.Array, logits: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(the next key, one token id per row of ``logits [B, V]``)."""
        key, sub = jax.random.split(key)
        return key, sample_logits(logits, sub, self.strategy, self.temperature, self.top_k, self.top_p)


def sampling(cfg: Config) -> Sampling:
    """``cfg.decode_sampling_*``: the one place decoding reads them."""
    return Sampling(
        cfg.decode_sampling_strategy,
        cfg.decode_sampling_temperature,
        cfg.decode_sampling_top_k,
        cfg.decode_sampling_nucleus_p,
        cfg.decode_sampling_seed,
    )


def generate_tokens(
    model: nnx.Module, prompt_ids: list[int], cfg: Config, max_new_tokens: int, stop_ids: tuple[int, ...] = ()
) -> Iterator[int]:
    """Yield sampled token ids one by one (seeded by decode_sampling_seed)."""
    if not prompt_ids:
        raise ValueError("the prompt must contain at least one token")
    total = len(prompt_ids) + max_new_tokens
    length = 1 << (total - 1).bit_length()  # bucket: a power of two >= total
    graphdef, state = nnx.split(model)
    config_sampling = sampling(cfg)
    draw = config_sampling.draw

    @jax.jit
    def next_token(state, tokens, position, key):
        logits = nnx.merge(graphdef, state)(tokens).logits  # causal: padding after `position` is ignored
        return draw(key, logits[:, position])

    tokens = np.zeros((1, length), np.int32)
    tokens[0, : len(prompt_ids)] = prompt_ids
    key = config_sampling.first_key()
    for position in range(len(prompt_ids) - 1, total - 1):
        key, chosen = next_token(state, jnp.asarray(tokens), position, key)
        token = int(chosen[0])
        tokens[0, position + 1] = token
        yield token
        if token in stop_ids:
            return


def sample_row(
    logits: np.ndarray, rng: np.random.Generator, temperature: float, top_k: int, top_p: float, logprobs: int | None = None
) -> tuple[int, float | None, list[tuple[int, float]] | None]:
    """One token from one row's float32 ``logits [V]`` with per-request settings, on the
    host (the server's rows each have their own; ``sample_logits`` is the jitted sampler of
    one config): temperature 0 is greedy (argmax, as ``sample_logits``); otherwise the
    logits over ``temperature``, then the ``top_k`` best (0 = all), then the smallest
    prefix of mass ``top_p`` (OpenAI's order), drawn with ``rng``. With ``logprobs``: the
    token's log-probability under the model (before temperature and filters) and the
    ``logprobs`` most likely tokens with theirs."""
    logits = np.asarray(logits, np.float64)
    if temperature == 0:
        token = int(np.argmax(logits))
    else:
        scaled = logits / temperature
        if 0 < top_k < scaled.size:
            kth = np.partition(scaled, -top_k)[-top_k]
            scaled = np.where(scaled < kth, -np.inf, scaled)
        probs = np.exp(scaled - scaled.max())
        probs /= probs.sum()
        if top_p < 1.0:
            order = np.argsort(-probs, kind="stable")
            before = np.cumsum(probs[order]) - probs[order]  # mass of the better tokens
            dropped = order[before >= top_p]
            probs[dropped] = 0.0
            probs /= probs.sum()
        token = int(min(np.searchsorted(np.cumsum(probs), rng.random() * probs.sum(), side="right"), probs.size - 1))
    if logprobs is None:
        return token, None, None
    log_probs = logits - (logits.max() + np.log(np.exp(logits - logits.max()).sum()))
    best = np.argsort(-log_probs, kind="stable")[:logprobs]
    return token, float(log_probs[token]), [(int(t), float(log_probs[t])) for t in best]
