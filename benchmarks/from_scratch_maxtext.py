"""MaxText side of ``benchmarks/from_scratch.py``: run by MaxText's own Python (the cached environment
of ``scripts/maxtext_reference.py``), never by nnxtron's. MaxText is imported only here.

It initialises the model with MaxText's own initialiser (``init_weights_seed``), compiles MaxText's
jitted ``train_step`` as its trainer does (``train_utils.jit_train_and_eval_step``, the set-up of
``scripts/maxtext/driver.py``), runs one step per stored batch of ``--batches`` (an ``.npz`` in
MaxText's batch layout, leading axis = step) and writes every step's loss and wall time to ``--out``.

    python from_scratch_maxtext.py --batches B.npz --out M.json --base-yml BASE -- k=v ...
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("DECOUPLE_GCLOUD", "TRUE")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "maxtext"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from driver import RUN_KEYS, setup  # noqa: E402  (scripts/maxtext/driver.py: MaxText's set-up)
from flax import nnx  # noqa: E402
from flax.core.spmd import logical_axis_rules  # noqa: E402
from maxtext.trainers.pre_train import train  # noqa: E402
from maxtext.utils import sharding, train_utils  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--base-yml", required=True)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="from_scratch_maxtext_"))
    start = time.perf_counter()
    argv = ["from_scratch", args.base_yml, f"base_output_directory={work / 'out'}", *RUN_KEYS, *args.overrides]
    config, mesh, state, state_mesh_shardings, lr_schedule = setup([*argv, "run_name=from_scratch"])
    with np.load(args.batches) as data:
        batches = dict(data)
    steps = len(batches["inputs"])
    if steps != config.steps:
        raise SystemExit(f"{steps} batches for steps={config.steps}")
    jit_model, pure_state = nnx.split(state)
    params_shardings, state_mesh_shardings = sharding.maybe_update_params_sharding_with_opt(config, state_mesh_shardings)
    p_train_step, _ = train_utils.jit_train_and_eval_step(
        config, jit_model, mesh, pure_state, state_mesh_shardings, train.train_step, train.eval_step, None, params_shardings
    )
    data_sharding = sharding.get_input_data_sharding(config, mesh, rules=config.logical_axis_rules)
    losses, seconds, rates = [], [], []
    setup_seconds = time.perf_counter() - start
    with jax.set_mesh(mesh), logical_axis_rules(config.logical_axis_rules):
        for step in range(steps):
            t0 = time.perf_counter()
            batch = {k: jax.device_put(jnp.asarray(v[step]), data_sharding) for k, v in batches.items()}
            pure_state, step_metrics = p_train_step(pure_state, batch)
            scalars = jax.device_get(step_metrics["scalar"])
            losses.append(float(scalars["learning/loss"]))
            seconds.append(time.perf_counter() - t0)
            rates.append(float(lr_schedule(step)))
    args.out.write_text(
        json.dumps({"loss": losses, "step_seconds": seconds, "learning_rate": rates, "setup_seconds": setup_seconds}) + "\n"
    )


if __name__ == "__main__":
    sys.exit(main())
