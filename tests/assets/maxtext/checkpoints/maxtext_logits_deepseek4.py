"""maxtext_logits.py plus one workaround: MaxText's from_pretrained leaves the non-Param model
state (DeepSeek-V4's tid2eid and router bias) as deleted arrays ("Array has been deleted"); each
is replaced by its stored value, read from the checkpoint's nnx_aux/model."""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from maxtext.configs import pyconfig
from maxtext.utils import model_creation_utils

config = pyconfig.initialize([sys.argv[0], *sys.argv[2:]])
model, _ = model_creation_utils.from_pretrained(config)
src = config.load_parameters_path
reader = ocp.PyTreeCheckpointer()
meta = reader.metadata(src).item_metadata.tree


def strip(t):
    if not isinstance(t, dict):
        return t
    kept = {k: strip(v) for k, v in t.items() if k != "rngs"}
    return {k: v for k, v in kept.items() if v is not None and v != {}} or None


if "nnx_aux" in meta:
    item = {"nnx_aux": {"model": strip(meta["nnx_aux"]["model"])}}
else:
    item = {"params": {"MoEBiasVar": meta["params"]["MoEBiasVar"]}}
args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), item)
aux = reader.restore(src, item=item, restore_args=args, partial_restore=True)
aux = aux["nnx_aux"]["model"] if "nnx_aux" in aux else aux["params"]["MoEBiasVar"]
stored = {tuple(str(getattr(k, "key", k)) for k in path): v for path, v in jax.tree_util.tree_flatten_with_path(aux)[0]}
state = nnx.state(model)
fixed = []


def fix(path, x):
    if isinstance(x, jax.Array) and x.is_deleted():
        key = tuple(str(getattr(k, "key", k)) for k in path)
        key = key[:-1] if key[-1] in ("value", ".value") else key
        cands = [v for k, v in stored.items() if k == key or k[: len(key)] == key]
        assert len(cands) == 1, (key, [k for k in stored][:5])
        value = np.asarray(cands[0])
        assert value.shape == x.shape, (key, value.shape, x.shape)
        fixed.append((jax.tree_util.keystr(path), float(np.abs(value).max())))
        return jnp.asarray(value, x.dtype)
    return x


state = jax.tree_util.tree_map_with_path(fix, state)
nnx.update(model, state)
print("replaced deleted:", fixed)
tokens = (jnp.arange(2 * 8, dtype=jnp.int32) * 7 + 3).reshape(2, 8) % config.vocab_size
positions = jnp.broadcast_to(jnp.arange(8, dtype=jnp.int32), (2, 8))
segments = jnp.ones((2, 8), jnp.int32)
forward = nnx.jit(lambda m, t, p, s: m(t, p, decoder_segment_ids=s, enable_dropout=False))
logits = forward(model, tokens, positions, segments)
np.save(sys.argv[1], np.asarray(jax.device_get(logits), np.float32))
print("saved", sys.argv[1], logits.shape, float(jnp.abs(logits).max()))
