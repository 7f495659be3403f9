"""From scratch: loss after N steps of a tied and an untied output head, nnxtron against MaxText 0.2.5.

    python benchmarks/from_scratch.py                 # 300 steps a run, 5 runs x 2 seeds (about 5 min on 2 busy CPU cores)
    python benchmarks/from_scratch.py --steps 100 --seeds 0   # shorter

Both systems train the same small Llama-2-style model (the keys of ``MODEL``, read on top of
MaxText 0.2.5's own ``base.yml`` by both: the same optimizer, schedule, clipping and weight decay)
from their **own initialisation** (nnxtron's recipes of docs/init.md; MaxText's
``init_weights_seed``), on the **same token batches**: this script draws them once and both
systems train on them, one batch per step. The data are uniform random tokens in ``[0, vocab)``
(a fresh batch each step, one document per row), so nothing but the unigram distribution can be
learned and the best reachable loss is ln V: the benchmark measures how far above ln V each head
starts and how much of that excess N steps remove. (``dataset_type=synthetic`` is not the same data
on the two sides: MaxText's repeats one fixed batch every step, nnxtron's draws a fresh batch of
tokens in ``[3, vocab)``; hence the shared batches.)

Runs, interleaved (untied: nnxtron, MaxText; tied: MaxText, nnxtron default, nnxtron MaxText's), the
five of them once per ``init_weights_seed`` of ``--seeds`` (default 0 and 1: the two systems draw
different initial weights from the same seed, so the spread over seeds is the noise to compare with):

- ``untied``: ``logits_via_embedding=false`` on both.
- ``tied``: ``logits_via_embedding=true``. MaxText: its base.yml's ``normalize_embedding_logits=true``
  (std-1 table, logits / sqrt(D)). nnxtron twice: ``normalize_embedding_logits=false`` (nnxtron's
  default for non-Gemma families: table ``N(0, 1/sqrt(D))``, logits ``x @ E^T``) and ``true``
  (MaxText's recipe).

MaxText runs in a fresh process of its cached environment (``scripts/maxtext_reference.py``'s
``ensure_env``) through ``benchmarks/from_scratch_maxtext.py`` (MaxText's own set-up and jitted
``train_step``); nnxtron runs in this process with the Trainer's functions (``make_mesh``,
``make_optimizer``, ``setup``, ``init_state``, ``make_train_step``), one CPU device each.
Output: ``benchmarks/results/from_scratch-<backend>.md`` and ``.json``. Not run in CI.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT / "scripts"))  # maxtext_reference: the MaxText environment
sys.path.insert(0, str(ROOT / "benchmarks"))  # suite: the machine description

import maxtext_reference  # noqa: E402
from suite import machine  # noqa: E402

MODEL = (
    "decoder_block=llama2", "base_emb_dim=256", "base_num_query_heads=4", "base_num_kv_heads=4", "head_dim=64",
    "base_mlp_dim=512", "base_num_decoder_layers=2", "vocab_size=1024", "max_target_length=128",
    "per_device_batch_size=4", "dtype=float32", "weight_dtype=float32", "learning_rate=1e-3",
    "warmup_steps_fraction=0.1", "lr_schedule_type=cosine", "learning_rate_final_fraction=0.1",
    "dataset_type=synthetic",
)  # fmt: skip
UNTIED = ("logits_via_embedding=false",)
TIED = ("logits_via_embedding=true",)
# (name, system, extra keys), in the order they run
RUNS = (
    ("untied", "nnxtron", UNTIED),
    ("untied", "maxtext", UNTIED),
    ("tied", "maxtext", TIED),
    ("tied, normalize_embedding_logits=false (nnxtron default)", "nnxtron", (*TIED, "normalize_embedding_logits=false")),
    ("tied, normalize_embedding_logits=true (MaxText's)", "nnxtron", (*TIED, "normalize_embedding_logits=true")),
)
MAXTEXT_OF = {"untied": "untied", "tied": "tied"}  # each nnxtron run's MaxText counterpart, by head


def make_batches(steps: int, batch: int, length: int, vocab: int, seed: int) -> dict[str, np.ndarray]:
    """``steps`` batches of uniform random tokens in MaxText's layout (one document per row)."""
    rng = np.random.default_rng(seed)
    seq = rng.integers(0, vocab, size=(steps, batch, length + 1), dtype=np.int32)
    positions = np.broadcast_to(np.arange(length, dtype=np.int32), (steps, batch, length)).copy()
    ones = np.ones((steps, batch, length), np.int32)
    return {"inputs": seq[..., :-1].copy(), "targets": seq[..., 1:].copy(), "inputs_position": positions,
            "targets_position": positions.copy(), "inputs_segmentation": ones, "targets_segmentation": ones.copy()}  # fmt: skip


def run_nnxtron(keys: list[str], batches: dict[str, np.ndarray]) -> dict[str, Any]:
    """nnxtron from its own initialisation, one train step per batch, one device."""
    import jax

    from nnxtron.config import derive
    from nnxtron.config.loader import load_config
    from nnxtron.parallel.mesh import make_mesh
    from nnxtron.train.optimizer import make_optimizer
    from nnxtron.train.state import init_state, setup
    from nnxtron.train.step import batch_sharding, device_batch, make_train_step

    start = time.perf_counter()
    cfg = load_config(maxtext_reference.BASE_YML, keys)
    mesh = make_mesh(cfg, devices=jax.devices()[:1])
    tx, schedule = make_optimizer(cfg, derive(cfg, 1))
    model_setup = setup(cfg, mesh, tx)
    state = init_state(cfg, model_setup, tx)
    step = make_train_step(cfg, model_setup, tx, schedule)
    shardings = batch_sharding(cfg, model_setup)
    setup_seconds = time.perf_counter() - start
    losses, seconds, rates = [], [], []
    for i in range(cfg.steps):
        t0 = time.perf_counter()
        state, metrics = step(state, device_batch(maxtext_reference.nnxtron_batch(batches, i), shardings))
        metrics = jax.device_get(metrics)
        losses.append(float(metrics["loss"]))
        rates.append(float(metrics["learning_rate"]))
        seconds.append(time.perf_counter() - t0)
    return {"loss": losses, "step_seconds": seconds, "learning_rate": rates, "setup_seconds": setup_seconds}


def run_maxtext(interpreter: Path, base_yml: Path, keys: list[str], batches_file: Path, work: Path) -> dict[str, Any]:
    """MaxText in a fresh process of its environment (``from_scratch_maxtext.py``)."""
    out = work / f"maxtext_{time.time_ns()}.json"
    cmd = [str(interpreter), str(ROOT / "benchmarks" / "from_scratch_maxtext.py"), "--batches", str(batches_file),
           "--out", str(out), "--base-yml", str(base_yml), "--", *keys]  # fmt: skip
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "DECOUPLE_GCLOUD": "TRUE", "XDG_CACHE_HOME": str(work),
           "MPLCONFIGDIR": str(work)}  # fmt: skip
    env.pop("PYTHONPATH", None)  # MaxText's interpreter must not see nnxtron's PYTHONPATH
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=work, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"MaxText failed (exit {done.returncode}):\n{(done.stdout + done.stderr)[-3000:]}")
    return json.loads(out.read_text())


def summarize(run: dict[str, Any], ln_v: float) -> dict[str, Any]:
    loss = run["loss"]
    tail = loss[-20:]
    return {"first": loss[0], "first_minus_ln_v": loss[0] - ln_v, "last": loss[-1], "last_minus_ln_v": loss[-1] - ln_v,
            "mean_last_20": statistics.fmean(tail), "mean_last_20_minus_ln_v": statistics.fmean(tail) - ln_v,
            "median_step_seconds": statistics.median(run["step_seconds"][1:] or run["step_seconds"])}  # fmt: skip


def render(about: dict[str, Any], runs: list[dict[str, Any]]) -> str:
    m, ln_v, steps = about["machine"], about["ln_v"], about["steps"]
    mt = {(r["head"], r["seed"]): r for r in runs if r["system"] == "maxtext" and "summary" in r}
    lines = [
        f"# From scratch: tied vs untied head, nnxtron vs MaxText ({about['date']})",
        "",
        f"Machine: {m['cpu']}, {m['usable_cpus']} CPUs (shared, busy: load average {about['load_before'][0]:.1f} -> "
        f"{about['load_after'][0]:.1f}); nnxtron with jax {m['jax']} (Python {m['python']}), MaxText "
        f"{about['maxtext']['maxtext']} with jax {about['maxtext']['jax']} (Python {about['maxtext']['python']}). "
        f"One CPU device each. {steps} steps a run; wall time of the whole benchmark {about['wall_seconds'] / 60:.1f} min.",
        "",
        f"Keys (both systems, on MaxText 0.2.5's base.yml): `{' '.join(about['keys'])} steps={steps}`, plus the run's "
        "head keys below. Everything else is base.yml's: AdamW (b1 0.9, b2 0.95, eps 1e-8, weight decay 0.1), "
        "gradient clipping 1.0, cosine schedule to 0.1 x the peak after a 10 % linear warm-up, remat full, scanned layers.",
        "",
        f"Data: the same {steps} batches on both sides, {about['batch']} rows x {about['seq']} tokens, uniform random "
        f"tokens in [0, {about['vocab']}) (NumPy seed {about['data_seed']}, a fresh batch each step, one document a "
        f"row). Only ln V = {ln_v:.4f} is reachable. `step 1`: the loss of the first step (the initial model's); "
        "`last`: step N's; `last 20`: the mean of the last 20 steps (less noisy); `- ln V`: the excess over ln V; "
        "ratios and differences are nnxtron's against MaxText's run with the same head.",
        "",
        "| run | system | seed | step 1 | step 1 - ln V | last | last - ln V | last 20 | last 20 - ln V | last / MaxText | "
        "last - MaxText | last 20 - MaxText | s/step |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        if "summary" not in r:
            lines.append(f"| {r['name']} | {r['system']} | {r['seed']} | failed: {r['error'].strip().splitlines()[-1][:200]} |")
            continue
        s = r["summary"]
        ref = mt.get((r["head"], r["seed"])) if r["system"] == "nnxtron" else None
        vs = (f"{s['last'] / ref['summary']['last']:.4f} | {s['last'] - ref['summary']['last']:+.4f} | "
              f"{s['mean_last_20'] - ref['summary']['mean_last_20']:+.4f}") if ref else "- | - | -"  # fmt: skip
        lines.append(
            f"| {r['name']} | {r['system']} | {r['seed']} | {s['first']:.4f} | {s['first_minus_ln_v']:+.4f} | {s['last']:.4f} | "
            f"{s['last_minus_ln_v']:+.4f} | {s['mean_last_20']:.4f} | {s['mean_last_20_minus_ln_v']:+.4f} | {vs} | "
            f"{s['median_step_seconds']:.3f} |"
        )
    seeds = sorted({r["seed"] for r in runs})
    if len(seeds) > 1:
        lines += ["", f"Mean over seeds {', '.join(map(str, seeds))} (runs that finished):", "",
                  "| run | system | step 1 - ln V | last 20 - ln V (each seed) | last 20 - ln V (mean) | last 20 - MaxText (mean) |",
                  "|---|---|---|---|---|---|"]  # fmt: skip
        means: dict[tuple[str, str], float] = {}
        for name, system, _ in RUNS:
            done = [r for r in runs if r["name"] == name and r["system"] == system and "summary" in r]
            if done:
                means[(name, system)] = statistics.fmean(r["summary"]["mean_last_20_minus_ln_v"] for r in done)
        for name, system, _ in RUNS:
            done = [r for r in runs if r["name"] == name and r["system"] == system and "summary" in r]
            if not done:
                continue
            first = statistics.fmean(r["summary"]["first_minus_ln_v"] for r in done)
            each = " / ".join(f"{r['summary']['mean_last_20_minus_ln_v']:+.4f}" for r in done)
            ref = means.get((name.split(",")[0], "maxtext")) if system == "nnxtron" else None
            vs = f"{means[(name, system)] - ref:+.4f}" if ref is not None else "-"
            lines.append(f"| {name} | {system} | {first:+.4f} | {each} | {means[(name, system)]:+.4f} | {vs} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300, help="train steps a run")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="init_weights_seed of each round")
    parser.add_argument("--data-seed", type=int, default=1234)
    parser.add_argument("--date", default=datetime.date.today().isoformat(), help="the date the results are headed with")
    parser.add_argument("--python", default="python3.12", help="a Python >= 3.12 to make the MaxText environment with")
    parser.add_argument("--env", type=Path, default=maxtext_reference.DEFAULT_ENV, help="the MaxText environment")
    parser.add_argument("--skip-maxtext", action="store_true", help="nnxtron's runs only")
    parser.add_argument("--out", type=Path, default=None, help="the Markdown file (default benchmarks/results/...)")
    args = parser.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    start = time.perf_counter()
    keys = [*MODEL, f"steps={args.steps}"]
    values = dict(k.split("=", 1) for k in MODEL)
    vocab, seq, batch = int(values["vocab_size"]), int(values["max_target_length"]), int(values["per_device_batch_size"])
    batches = make_batches(args.steps, batch, seq, vocab, args.data_seed)
    about: dict[str, Any] = {
        "date": args.date,
        "machine": machine(),
        "keys": list(MODEL),
        "steps": args.steps,
        "seeds": args.seeds,
        "vocab": vocab,
        "seq": seq,
        "batch": batch,
        "data_seed": args.data_seed,
        "ln_v": math.log(vocab),
        "load_before": os.getloadavg(),
        "maxtext": {"maxtext": "not run", "jax": "-", "python": "-"},
    }
    interpreter = maxtext_base = None
    if not args.skip_maxtext:
        interpreter = maxtext_reference.ensure_env(args.env, args.python)
        maxtext_base = next((args.env / "lib").glob("python3*/site-packages/maxtext/configs/base.yml"))
        about["maxtext"] = maxtext_reference.versions(interpreter)
    out = args.out or RESULTS / f"from_scratch-{about['machine']['backend']}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="from_scratch_") as work:
        batches_file = Path(work) / "batches.npz"
        np.savez(batches_file, **batches)
        for seed, (name, system, extra) in ((seed, run) for seed in args.seeds for run in RUNS):
            if system == "maxtext" and args.skip_maxtext:
                continue
            run_keys = [*keys, f"init_weights_seed={seed}", *extra]
            head = name.split(",")[0]
            t0 = time.perf_counter()
            try:
                if system == "nnxtron":
                    result = run_nnxtron(run_keys, batches)
                else:
                    result = run_maxtext(interpreter, maxtext_base, run_keys, batches_file, Path(work))
                result["summary"] = summarize(result, about["ln_v"])
            except (RuntimeError, ValueError, KeyError) as error:  # recorded, the other runs go on
                result = {"error": str(error)}
            run = {"name": name, "head": head, "system": system, "seed": seed, "keys": run_keys,
                   "wall_seconds": time.perf_counter() - t0, **result}  # fmt: skip
            runs.append(run)
            done = f"loss {run['loss'][0]:.4f} -> {run['loss'][-1]:.4f}" if "loss" in run else "FAILED"
            print(f"{name} / {system} / seed {seed}: {done} ({run['wall_seconds']:.0f} s)", file=sys.stderr, flush=True)
            about["load_after"] = os.getloadavg()
            about["wall_seconds"] = time.perf_counter() - start
            out.write_text(render(about, runs))  # after each run: a stopped benchmark keeps what it measured
            out.with_suffix(".json").write_text(json.dumps({"about": about, "runs": runs}, indent=1, default=str) + "\n")
    print(out.read_text(), end="")
    return {"about": about, "runs": runs}


if __name__ == "__main__":
    main()
