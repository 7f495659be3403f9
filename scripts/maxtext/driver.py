"""MaxText side of the reference runs: run by MaxText's own Python (the cached MaxText environment
that ``scripts/maxtext_reference.py`` makes), never by nnxtron's. MaxText is imported only here.

For one config (MaxText ``key=value`` overrides on MaxText's ``base.yml``) it

1. initialises the model with MaxText's own initialiser (``init_weights_seed``) and saves its
   parameters with MaxText's param-only checkpoint writer (``checkpointing.save_params_to_path``:
   an Orbax checkpoint whose tree is ``params/<collection>/<MaxText parameter path>`` — ``params``
   for the weights, another collection for other trained variables such as DeepSeek's router
   bias — the layout MaxText's ``load_params_from_path`` reads);
2. sets up training again with ``load_parameters_path=<that checkpoint>`` (MaxText's loader) and
   checks that the loaded parameters are the saved ones;
3. computes MaxText's logits on fixed tokens with those parameters;
4. runs MaxText's jitted ``train_step`` (``maxtext.trainers.pre_train.train``, compiled by
   ``train_utils.jit_train_and_eval_step`` as its trainer does) on the stored token batches, one
   step per batch, recording every scalar metric MaxText reports;
5. writes ``initial_params.npz`` / ``final_params.npz`` (every ``nnx.Param`` and other trained
   state of the model, keyed by its '/'-joined MaxText path), ``batches.npz``, ``logits.npz`` and
   ``metrics.json`` to ``--out``.

With ``--init-statistics`` it stops after 1. and writes only ``initial_statistics.json``: for
every tensor of MaxText's initial model its shape, mean, standard deviation, minimum and maximum
(float64), what tests/parity/test_init_parity.py compares — a few kB instead of the tensors.

Usage (see scripts/maxtext_reference.py): ``python driver.py --out DIR --base-yml BASE [--init-statistics] -- k=v ...``
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("DECOUPLE_GCLOUD", "TRUE")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402
from flax.core.spmd import logical_axis_rules  # noqa: E402
from flax.nnx import variablelib  # noqa: E402
from maxtext.common import checkpointing  # noqa: E402
from maxtext.trainers.pre_train import train  # noqa: E402
from maxtext.utils import sharding, train_utils  # noqa: E402

# keys every reference run adds for MaxText only (where it writes, no cluster set-up); all are
# ignored MaxText infrastructure keys to nnxtron
RUN_KEYS = (
    "run_name=reference",
    "enable_checkpointing=false",
    "skip_jax_distributed_system=true",
    "hardware=cpu",
)


def flat(tree: dict, prefix: str = "") -> dict[str, np.ndarray]:
    out = {}
    for key, value in tree.items():
        path = f"{prefix}/{key}" if prefix else str(key)
        if isinstance(value, dict):
            out.update(flat(value, path))
        else:
            out[path] = np.asarray(value)
    return out


def model_state(state) -> dict[str, np.ndarray]:
    """Every trained value of the model (parameters and non-parameter state such as router
    biases), without RNG state and intermediates, as a flat '/'-joined dict: ``nnx.Param``s by
    path, other state under its collection name (``MoEBiasVar/decoder/...``), the names
    ``nnxtron.convert.maxtext.read_maxtext_checkpoint`` gives."""
    out = {}
    for name, tree in checkpoint_collections(state).items():
        out.update(flat(tree, "" if name == "params" else name))
    return out


def checkpoint_collections(state) -> dict:
    """The model's weights by Flax collection, as MaxText's ``load_params_from_path`` reads them:
    ``params`` for ``nnx.Param``, the variable type's collection name for the others (e.g. the
    router bias of loss-free balancing)."""
    keep = nnx.Not(nnx.Any(nnx.RngState, nnx.Intermediate))
    collections: dict[str, dict] = {}
    for path, variable in nnx.to_flat_state(nnx.state(state.model, keep)):
        name = variablelib.variable_name_from_type(variable.type, allow_register=True)
        collections.setdefault(name, {})[tuple(path)] = variable.get_value()
    return {name: nnx.traversals.unflatten_mapping(tree) for name, tree in collections.items()}


def make_batches(steps: int, batch: int, length: int, vocab: int, seed: int) -> dict[str, np.ndarray]:
    """``steps`` batches of random tokens in MaxText's batch layout. Row 0 is one document;
    every other row packs two documents (lengths 5/8 and 3/8 of the row), so positions restart
    and segment ids change inside the row. Each document is a random token sequence with
    inputs = seq[:-1] and targets = seq[1:] (MaxText's shift within a document)."""
    rng = np.random.default_rng(seed)
    shape = (steps, batch, length)
    out = {k: np.zeros(shape, np.int32) for k in ("inputs", "targets", "inputs_position", "inputs_segmentation")}
    for s in range(steps):
        for b in range(batch):
            cuts = [0, length] if b == 0 else [0, length * 5 // 8, length]
            for seg, (lo, hi) in enumerate(zip(cuts[:-1], cuts[1:]), start=1):
                seq = rng.integers(0, vocab, size=hi - lo + 1, dtype=np.int32)
                out["inputs"][s, b, lo:hi] = seq[:-1]
                out["targets"][s, b, lo:hi] = seq[1:]
                out["inputs_position"][s, b, lo:hi] = np.arange(hi - lo)
                out["inputs_segmentation"][s, b, lo:hi] = seg
    out["targets_position"] = out["inputs_position"].copy()
    out["targets_segmentation"] = out["inputs_segmentation"].copy()
    return out


def statistics(params: dict[str, np.ndarray]) -> dict[str, dict]:
    """Per tensor: shape, mean, standard deviation, minimum and maximum (float64)."""
    out = {}
    for name, value in sorted(params.items()):
        x = np.asarray(value, np.float64)
        out[name] = {"shape": list(x.shape), "mean": x.mean(), "std": x.std(), "min": x.min(), "max": x.max()}
    return out


def setup(argv: list[str]):
    config, recorder = train.initialize(argv)
    (_, _, state_mesh_shardings, _, mesh, lr_schedule, _, _, _, _, state) = train_utils.setup_train_loop(config, recorder)
    return config, mesh, state, state_mesh_shardings, lr_schedule


def logits_of(state, mesh, config, tokens: dict[str, np.ndarray]) -> np.ndarray:
    graphdef, pure = nnx.split(state.model)

    @jax.jit
    def forward(pure, inputs, positions, segments):
        model = nnx.merge(graphdef, pure)
        return model(decoder_input_tokens=inputs, decoder_positions=positions, decoder_segment_ids=segments, enable_dropout=False)

    with jax.set_mesh(mesh), logical_axis_rules(config.logical_axis_rules):
        logits = forward(pure, tokens["inputs"], tokens["inputs_position"], tokens["inputs_segmentation"])
    return np.asarray(logits, np.float32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--base-yml", required=True)
    parser.add_argument("--data-seed", type=int, default=1234)
    parser.add_argument("--init-statistics", action="store_true", help="write initial_statistics.json only")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="maxtext_reference_"))
    common = ["driver", args.base_yml, f"base_output_directory={work / 'out'}", *RUN_KEYS, *args.overrides]

    # 1. MaxText's initial parameters, saved with MaxText's param-only checkpoint writer
    config, mesh, state, _, _ = setup([*common, "run_name=init"])
    initial = model_state(state)
    if args.init_statistics:
        stats = statistics({k: v for k, v in initial.items() if "rngs" not in k})
        (out / "initial_statistics.json").write_text(json.dumps(stats, indent=1) + "\n")
        shutil.rmtree(work, ignore_errors=True)
        return
    checkpoint = out / "initial_checkpoint"
    if checkpoint.exists():
        shutil.rmtree(checkpoint)
    checkpointing.save_params_to_path(str(checkpoint), checkpoint_collections(state))
    del state

    # 2. the run MaxText trains: its loader reads that checkpoint
    config, mesh, state, state_mesh_shardings, lr_schedule = setup([*common, f"load_parameters_path={checkpoint}"])
    loaded = model_state(state)
    assert loaded.keys() == initial.keys(), sorted(set(loaded) ^ set(initial))
    for key, value in initial.items():
        if "rngs" not in key:
            np.testing.assert_array_equal(loaded[key], value, err_msg=key)

    batches = make_batches(
        config.steps, config.global_batch_size_to_train_on, config.max_target_length, config.vocab_size, args.data_seed
    )
    logit_tokens = make_batches(
        1, config.global_batch_size_to_train_on, config.max_target_length, config.vocab_size, args.data_seed + 1
    )
    logit_tokens = {k: logit_tokens[k][0] for k in ("inputs", "inputs_position", "inputs_segmentation")}
    logits = logits_of(state, mesh, config, logit_tokens)

    # 4. MaxText's own jitted train_step, as train_loop compiles it
    jit_model, pure_state = nnx.split(state)
    params_shardings, state_mesh_shardings = sharding.maybe_update_params_sharding_with_opt(config, state_mesh_shardings)
    p_train_step, _ = train_utils.jit_train_and_eval_step(
        config, jit_model, mesh, pure_state, state_mesh_shardings, train.train_step, train.eval_step, None, params_shardings
    )
    data_sharding = sharding.get_input_data_sharding(config, mesh, rules=config.logical_axis_rules)
    metrics: list[dict[str, float]] = []
    with jax.set_mesh(mesh), logical_axis_rules(config.logical_axis_rules):
        for step in range(config.steps):
            batch = {k: jax.device_put(jnp.asarray(v[step]), data_sharding) for k, v in batches.items()}
            pure_state, step_metrics = p_train_step(pure_state, batch)
            scalars = {k: float(v) for k, v in jax.device_get(step_metrics["scalar"]).items()}
            scalars["learning/current_learning_rate"] = float(lr_schedule(step))
            metrics.append(scalars)
            print(f"step {step}: loss {scalars['learning/loss']:.6f}", flush=True)
    final_state = nnx.merge(jit_model, pure_state)
    final = model_state(final_state)

    np.savez(out / "initial_params.npz", **{k: v for k, v in initial.items() if "rngs" not in k})
    np.savez(out / "final_params.npz", **{k: v for k, v in final.items() if "rngs" not in k})
    np.savez_compressed(out / "batches.npz", **batches)
    np.savez_compressed(out / "logits.npz", logits=logits, **logit_tokens)
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
