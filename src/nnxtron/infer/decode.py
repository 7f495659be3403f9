"""KV-cached decoding: jitted prefill and decode steps over split state, the host loop.

``with_caches`` attaches caches to a copy of the model (``infer.cache.attach_caches``) and
splits it once into parameters, other state and caches (``CachedModel``); one jitted step
runs a chunk of tokens — the whole (bucketed) prompt for prefill, one token per row for
decode — and returns its logits and the new caches (donated). ``decode`` is the loop on
the host with any chooser (one call per token); ``infer.generate`` runs it on the device
with the config's sampler, several tokens per call. Rows may have prompts of different
lengths: prompts are right-padded, padding carries segment id 0 (never cached, never
attended to) and each row decodes from its own position.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nnxtron.config.schema import Config
from nnxtron.config.stacks import layer_counts, layer_stacks
from nnxtron.errors import UserError
from nnxtron.infer.cache import attach_caches
from nnxtron.infer.sample import sampling as config_sampling
from nnxtron.layers.kv_cache import CacheEntry
from nnxtron.models.build import abstract_model
from nnxtron.params import flatten, flatten_with_treedef, restack, unstack_layers

MIN_BUCKET = 16


def bucket(length: int) -> int:
    """Prompt lengths are padded to a power of two (>= 16): at most log2(max) prefill compiles."""
    return max(MIN_BUCKET, 1 << (length - 1).bit_length())


@dataclass
class CachedModel:
    """A model split for decoding: static graph, parameters, other state and caches (pure dicts)."""

    graphdef: nnx.GraphDef
    params: dict
    state: dict  # non-parameter model state (router biases, hash tables): read, never changed
    caches: dict
    max_length: int
    _step: Callable

    def step(self, caches: dict, tokens, positions, segment_ids) -> tuple[jax.Array, dict]:
        """Run ``tokens [B, S]`` at ``positions`` (``segment_ids`` 0 = padding) through the
        model: float32 logits ``[B, S, V]`` and the new caches (``caches`` is donated)."""
        return self._step(self.params, self.state, caches, tokens, positions, segment_ids)


def with_caches(model: nnx.Module, batch: int, max_length: int, paging=None) -> CachedModel:
    """``model`` with empty caches for ``batch`` rows of up to ``max_length`` tokens (the
    model itself is not changed); with ``paging`` (``infer.paging.Paging``) block pools
    shared by all sequences, whose tables ``infer.paging.PagedLayout`` fills per step."""
    cfg = model.config
    if max_length > cfg.max_position_embeddings:
        raise UserError(
            f"prompt + max_new_tokens = {max_length} tokens exceed max_position_embeddings={cfg.max_position_embeddings}; "
            "shorten the prompt or lower max_new_tokens"
        )
    model = unrolled(model)
    attach_caches(model, batch, max_length, paging)
    graphdef, params, caches, state = nnx.split(model, nnx.Param, CacheEntry, ...)
    pure = nnx.to_pure_dict
    return CachedModel(graphdef, pure(params), pure(state), pure(caches), max_length, _jitted_step(graphdef))


def unrolled(model: nnx.Module) -> nnx.Module:
    """A copy of ``model`` with its layers as separate modules (``scan_layers=false``, no
    pipeline): the same parameters and state, read from the stacked ones.

    Decoding runs this copy. Through a layer scan each step copies every layer's cache out of
    the stacked array and back (the scan's slices of its inputs and outputs, several times
    the cache per step); with a cache per layer the jitted, donated step writes the new
    token's keys in place and reads the cache once."""
    cfg = model.config
    if not cfg.stacked_layers:
        return nnx.clone(model)
    flat_cfg = cfg.model_copy(update={"scan_layers": False, "ici_pipeline_parallelism": 1, "dcn_pipeline_parallelism": 1})
    graphdef, abstract = nnx.split(abstract_model(flat_cfg))
    # layer-list paths of the unpipelined stacks (a partial pipeline's unpipelined_layers rejoin the main stack;
    # a pipeline's one-layer blocks whose kind is data go back into their cycles)
    source = restack(unstack_layers(flatten(nnx.state(model)), layer_counts(cfg)), layer_stacks(cfg), layer_stacks(flat_cfg))
    target, treedef = flatten_with_treedef(nnx.to_pure_dict(abstract))
    if source.keys() != target.keys():
        missing, extra = sorted(target.keys() - source.keys()), sorted(source.keys() - target.keys())
        raise ValueError(f"unrolled decoding model: missing {missing[:3]}, unexpected {extra[:3]}")
    values = jax.tree_util.tree_unflatten(treedef, [source[key] for key in target])
    nnx.replace_by_pure_dict(abstract, values)
    return nnx.merge(graphdef, abstract)


@functools.lru_cache(maxsize=16)
def _jitted_step(graphdef: nnx.GraphDef) -> Callable:
    """One jitted step per model structure (cache shapes included): repeated generation with
    the same shapes compiles once."""

    def step(params, state, caches, tokens, positions, segment_ids):
        model = nnx.merge(graphdef, params, caches, state)
        logits = model(tokens, positions, segment_ids).logits
        return logits, nnx.to_pure_dict(nnx.state(model, CacheEntry))

    return jax.jit(step, donate_argnums=(2,))


def prompt_batch(prompts: Sequence[Sequence[int]], length: int) -> dict[str, np.ndarray]:
    """Right-padded tokens, positions and segment ids (0 = padding) for ``prompts``."""
    tokens = np.zeros((len(prompts), length), np.int32)
    segments = np.zeros_like(tokens)
    for row, prompt in enumerate(prompts):
        tokens[row, : len(prompt)] = prompt
        segments[row, : len(prompt)] = 1
    positions = np.broadcast_to(np.arange(length, dtype=np.int32), tokens.shape).copy()
    return {"tokens": tokens, "positions": positions, "segment_ids": segments}


Chooser = Callable[[np.ndarray], np.ndarray]  # float32 logits [B, V] of each row's last token -> token ids [B]


def prefill(
    model: nnx.Module, prompts: Sequence[Sequence[int]], max_new_tokens: int
) -> tuple[CachedModel, dict, jax.Array, np.ndarray]:
    """Caches for ``prompts`` + ``max_new_tokens`` filled with the prompts (one bucketed,
    right-padded call): ``(cached model, caches, each row's last logits [B, V] on the device,
    prompt lengths)``."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise UserError("every prompt must contain at least one token")
    longest = max(len(p) for p in prompts)
    cached = with_caches(model, len(prompts), longest + max_new_tokens)
    batch = prompt_batch(prompts, min(bucket(longest), cached.max_length))
    logits, caches = cached.step(cached.caches, *(jnp.asarray(batch[k]) for k in ("tokens", "positions", "segment_ids")))
    lengths = np.array([len(p) for p in prompts], np.int32)
    return cached, caches, logits[np.arange(len(prompts)), lengths - 1], lengths


def decode(
    model: nnx.Module, prompts: Sequence[Sequence[int]], max_new_tokens: int, choose: Chooser, stop_ids: Sequence[int] = ()
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The decoding loop on the host, one call per token: prefill the prompts, then per
    step ``choose`` each row's next token from its last logits and feed it back at the
    row's own position. Yields ``(tokens [B], done [B])`` per step (``done``: the row had
    already stopped before this token; a row stops after a token in ``stop_ids``).
    ``infer.generate`` runs the same loop on the device, several tokens per call."""
    cached, caches, last, lengths = prefill(model, prompts, max_new_tokens)
    last = np.asarray(last)
    done = np.zeros(len(prompts), bool)
    for i in range(max_new_tokens):
        check_logits(last, ~done, i, model.config.dtype)
        tokens = np.asarray(choose(last)).astype(np.int32)
        yield tokens, done.copy()
        done |= np.isin(tokens, list(stop_ids))
        if done.all() or i == max_new_tokens - 1:
            return
        positions = (lengths + i)[:, None]
        segments = (~done).astype(np.int32)[:, None]
        logits, caches = cached.step(caches, jnp.asarray(tokens[:, None]), jnp.asarray(positions), jnp.asarray(segments))
        last = np.asarray(logits)[:, 0]


class DegenerateLogits(UserError):
    """The model's next-token logits cannot be sampled: not finite, or all equal."""


def logit_faults(logits: jax.Array, live: jax.Array, xp=jnp) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Of the ``live`` rows of ``logits [B, V]``: (some value is NaN or Inf, some row holds
    one value for every token, that value in the first such row). ``xp``: ``jnp`` inside the
    device loop, ``np`` for logits already on the host (no round trip to the device)."""
    nonfinite = xp.any(~xp.isfinite(logits) & live[:, None])
    flat = (logits.max(axis=-1) == logits.min(axis=-1)) & live
    return nonfinite, flat.any(), logits[xp.argmax(flat), 0]


def raise_degenerate(nonfinite: bool, flat: bool, value: float, vocab: int, index: int, dtype: str) -> None:
    """One line when ``logit_faults`` found a fault before new token ``index`` (0-based):
    sampling such a row would return token 0 (argmax of NaN, or of a tie) over and over, as
    from weights so large that the activations overflow (the norms then scale them to 0 or NaN)."""
    what = f"the model's logits for new token {index + 1}"
    fix = f"its weights or activations overflow {dtype} (a diverged or damaged checkpoint?); a sample would be meaningless"
    if nonfinite:
        raise DegenerateLogits(f"{what} are not finite (NaN or Inf): {fix}")
    if flat:
        raise DegenerateLogits(f"{what} are all equal ({value:g} for each of the {vocab} tokens): {fix}")


def check_logits(logits: np.ndarray, live: np.ndarray, index: int, dtype: str) -> None:
    """``raise_degenerate`` for the ``live`` rows of ``logits [B, V]`` on the host."""
    nonfinite, flat, value = logit_faults(logits, live, np)
    raise_degenerate(bool(nonfinite), bool(flat), float(value), logits.shape[-1], index, dtype)


def sampler(cfg: Config) -> Chooser:
    """``cfg.decode_sampling_*`` (``infer.sample.sampling``) as a host chooser: a fresh key
    per step, the sequence ``infer.generate`` draws on the device."""
    sampling = config_sampling(cfg)
    key = sampling.first_key()

    def choose(logits: np.ndarray) -> np.ndarray:
        nonlocal key
        key, tokens = sampling.draw(key, jnp.asarray(logits))
        return np.asarray(tokens)

    return choose
