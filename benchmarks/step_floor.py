"""A lower bound on a train step's time from two parts every implementation must run: the
optimizer update over all parameters and the output head(s) with the loss.

For ``deepseek3-tiny`` + MTP (issue 25's config: 61 layers of emb 64, vocab 129,280, batch
1 x 128) these two parts alone take most of MaxText's step, which bounds the speed-up any
implementation of the same model can reach on this machine whatever its 61 layers cost:
``maximum ratio = MaxText step / (update + heads)``. Both parts are timed here as nnxtron runs
them (its optimizer from the config; the head as ``layers/matmul.contract_last`` + the loss), in
their own jitted functions, best of ``--repeats``.

Run: ``.venv/bin/python benchmarks/step_floor.py [--maxtext-step SECONDS] [FILE.yml] [k=v ...]``
(defaults: the deepseek3-tiny + MTP keys of ``benchmarks/vs_maxtext.py``; give MaxText's
``base.yml`` first to use its defaults, as that benchmark does; MaxText's step from
``benchmarks/results/vs_maxtext-cpu.json`` when present). Not in CI.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

from nnxtron.config.derived import derive  # noqa: E402
from nnxtron.config.loader import load_config  # noqa: E402
from nnxtron.layers.matmul import contract_last  # noqa: E402
from nnxtron.models.loss import cross_entropy_sum  # noqa: E402
from nnxtron.parallel.mesh import make_mesh  # noqa: E402
from nnxtron.train.optimizer import make_optimizer  # noqa: E402
from nnxtron.train.state import setup  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "vs_maxtext-cpu.json"
DEEPSEEK = ["model_name=deepseek3-tiny", "mtp_num_layers=1", "per_device_batch_size=1", "max_target_length=128"]
CASE = "deepseek3-tiny-mtp"


def best_seconds(fn, args, repeats: int) -> float:
    """Best wall time of ``fn(*args)`` after one warm-up call (its result waited for)."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return min(times)


def update_seconds(cfg, repeats: int) -> tuple[float, int]:
    """The optimizer update and its application over the model's parameters (float32 state)."""
    tx, _ = make_optimizer(cfg, derive(cfg, 1))
    abstract = setup(cfg, make_mesh(cfg), tx).abstract_state["params"]
    params = jax.tree.map(lambda a: jnp.full(a.shape, 0.01, a.dtype), abstract)
    grads = jax.tree.map(lambda p: jnp.full(p.shape, 1e-3, p.dtype), params)

    @jax.jit
    def update(params, opt_state, grads):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    count = sum(leaf.size for leaf in jax.tree.leaves(params))
    return best_seconds(update, (params, tx.init(params), grads), repeats), count


def head_seconds(cfg, repeats: int) -> float:
    """One output head and its loss, forward and backward (gradients of input and kernel)."""
    tokens, dim, vocab = int(cfg.per_device_batch_size * cfg.max_target_length), cfg.base_emb_dim, cfg.vocab_size
    x = jax.random.normal(jax.random.key(0), (1, tokens, dim), jnp.float32)
    kernel = jax.random.normal(jax.random.key(1), (dim, vocab), jnp.float32) * 0.02
    targets = jax.random.randint(jax.random.key(2), (1, tokens), 0, vocab)
    dtype = jnp.dtype(cfg.dtype)

    def loss(x, kernel):
        logits = contract_last(x.astype(dtype), kernel.astype(dtype), 1).astype(jnp.float32)
        return cross_entropy_sum(logits, targets)[0]

    return best_seconds(jax.jit(jax.grad(loss, argnums=(0, 1))), (x, kernel), repeats)


def maxtext_step() -> float | None:
    """MaxText's median step of the deepseek3-tiny case in the last ``vs_maxtext`` results."""
    if not RESULTS.exists():
        return None
    case = json.loads(RESULTS.read_text())["results"].get(CASE, {})
    runs = [r for r in case.get("runs", []) if r.get("system") == "maxtext"]
    by_variant: dict[str, list[float]] = {}
    for run in runs:
        if "step_seconds" in run:
            by_variant.setdefault(run.get("variant", ""), []).append(run["step_seconds"])
    return min((statistics.median(v) for v in by_variant.values()), default=None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--maxtext-step", type=float, default=None, help="MaxText's step seconds (default: the results file)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "args", nargs="*", help="[FILE.yml] [key=value ...] as nnxtron bench takes them (default: deepseek3-tiny + MTP)"
    )
    args = parser.parse_args()
    file = args.args[0] if args.args and args.args[0].endswith((".yml", ".yaml")) else None
    overrides = args.args[1:] if file else args.args
    cfg = load_config(file, overrides or DEEPSEEK)
    update, count = update_seconds(cfg, args.repeats)
    head = head_seconds(cfg, args.repeats)
    heads = 1 + cfg.mtp_num_layers
    floor = update + heads * head
    print(f"{cfg.model_name}: {count:,} parameters; optimizer update {update:.3f} s, head + loss {head:.3f} s x {heads}")
    print(f"floor (update + heads): {floor:.3f} s/step")
    reference = args.maxtext_step if args.maxtext_step is not None else maxtext_step()
    if reference:
        print(f"MaxText step {reference:.3f} s: at most {reference / floor:.2f}x MaxText even if every layer took no time")


if __name__ == "__main__":
    main()
