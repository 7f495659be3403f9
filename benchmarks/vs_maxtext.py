"""nnxtron against MaxText 0.2.5, side by side: tokens/s of the same configs, interleaved runs.

    python benchmarks/vs_maxtext.py                        # every config, 2 rounds
    python benchmarks/vs_maxtext.py --only dense-minimal moe --rounds 3 --steps 10
    python benchmarks/vs_maxtext.py --quick --rounds 1     # tiny sizes: checks the machinery

MaxText lives in the cached environment of ``scripts/maxtext_reference.py`` (its ``ensure_env``
makes it on first use; ``--python`` is the Python >= 3.12 it is made with). Each run is a fresh
process, on the CPU backend (``JAX_PLATFORMS=cpu``; fake devices through
``--xla_force_host_platform_device_count`` for the multi-device configs), synthetic data:

- MaxText: ``python -m maxtext.trainers.pre_train.train <its base.yml> key=value ...`` with
  ``DECOUPLE_GCLOUD=TRUE`` and ``enable_checkpointing=false``, for ``2 + steps`` steps. Its log's
  ``completed step: k, seconds: s`` lines are the per-step times (wall time between step
  dispatches); the first 2 steps (compile, pipeline fill) are skipped.
- nnxtron: ``nnxtron bench <MaxText's base.yml> key=value ... --steps steps`` with this script's
  interpreter and environment (so ``PYTHONPATH`` picks the nnxtron that runs); its JSON line's
  ``step_seconds`` (median) and ``step_seconds_min`` (2 warm-up steps skipped).

Both get the same model, batch and data keys. Rounds interleave the systems (nnxtron, MaxText,
nnxtron, MaxText, ...), so load drift on a shared machine hits both. Per config: each system's
median step time (the median over rounds of each run's median) and best step (the fastest step
of any run), tokens/s from them, and the ratio nnxtron / MaxText of tokens/s. Where a system has
variants (MaxText's ``sparse_matmul=true`` and ``false``) its best variant counts. The Markdown
table goes to stdout and ``benchmarks/results/vs_maxtext-<backend>[-quick].md``, the raw runs
to the ``.json`` beside it. Not run in CI; no threshold is enforced.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT / "scripts"))  # maxtext_reference: the MaxText environment
sys.path.insert(0, str(ROOT / "benchmarks"))  # suite: the machine description

import maxtext_reference  # noqa: E402
from suite import machine  # noqa: E402

from nnxtron.config.loader import load_config  # noqa: E402
from nnxtron.tools.step_profile import PROFILE_STEPS, read_profile, summarize  # noqa: E402

WARMUP_STEPS = 2  # skipped in both systems (nnxtron bench's own warm-up count)
STEP_LINE = re.compile(r"completed step: (\d+), seconds: ([0-9.]+), TFLOP/s/device: [0-9.]+, Tokens/s/device: ([0-9.]+)")
SYSTEMS = ("nnxtron", "maxtext")


@dataclass(frozen=True)
class Case:
    """One config of the comparison: keys both systems get, and each system's variants."""

    about: str
    shared: tuple[str, ...]
    variants: dict[str, dict[str, tuple[str, ...]]] = field(default_factory=dict)  # system -> label -> extra keys
    devices: int = 1

    def runs(self, system: str) -> dict[str, tuple[str, ...]]:
        """The variants of ``system`` (label -> extra keys); one unnamed run when none is listed."""
        return self.variants.get(system) or {"": ()}


# The dense model of the issue: llama2-style, emb 256, 4 heads of 64, MLP 1024, 4 layers, vocab
# 32,000, seq 256, bf16 activations, f32 weights (batch set per case).
DENSE = (
    "decoder_block=llama2", "base_emb_dim=256", "base_num_query_heads=4", "base_num_kv_heads=4", "head_dim=64",
    "base_mlp_dim=1024", "base_num_decoder_layers=4", "vocab_size=32000", "max_target_length=256",
    "dtype=bfloat16", "weight_dtype=float32", "dataset_type=synthetic",
)  # fmt: skip


# Mixtral-style MoE of the same size: 8 experts of MLP 512, top 2, so the active MLP FLOPs are the
# dense model's (2 x 512 = 1024; MaxText wants base_mlp_dim = base_moe_mlp_dim). megablox=false: MaxText's Pallas kernel does not run on CPU.
def mixtral_of(dense: tuple[str, ...], experts: int, mlp_dim: int) -> tuple[str, ...]:
    """``dense`` as a Mixtral-style MoE: ``experts`` experts of MLP ``mlp_dim``, top 2, megablox off."""
    kept = (k for k in dense if not k.startswith(("decoder_block=", "base_mlp_dim=")))
    return (*kept, "decoder_block=mixtral", f"num_experts={experts}", "num_experts_per_tok=2",
            f"base_mlp_dim={mlp_dim}", f"base_moe_mlp_dim={mlp_dim}", "megablox=false")  # fmt: skip


MOE = mixtral_of(DENSE, experts=8, mlp_dim=512)
# The DeepSeek-V3 pull request's reference command: deepseek3-tiny (61 layers, vocab 129,280) + MTP.
DEEPSEEK = ("model_name=deepseek3-tiny", "mtp_num_layers=1", "per_device_batch_size=1", "max_target_length=128",
            "dataset_type=synthetic", "megablox=false")  # fmt: skip
SPARSE_BOTH = {"true": ("sparse_matmul=true",), "false": ("sparse_matmul=false",)}
# MaxText has no remat_policy=none (its "none" gives jax.checkpoint no policy: full remat). Its
# cheapest policy is minimal_with_context: every named matmul output (q/k/v/out projections,
# MLP in/out) and the attention context are saved, only elementwise work is recomputed.
MAXTEXT_LEAST_REMAT = "minimal_with_context"

TINY = (
    "decoder_block=llama2", "base_emb_dim=32", "base_num_query_heads=4", "base_num_kv_heads=4", "head_dim=8",
    "base_mlp_dim=64", "base_num_decoder_layers=2", "vocab_size=256", "max_target_length=32",
    "dtype=bfloat16", "weight_dtype=float32", "dataset_type=synthetic",
)  # fmt: skip
TINY_MOE = mixtral_of(TINY, experts=4, mlp_dim=32)
TINY_DEEPSEEK = (
    "model_name=deepseek3-tiny", "override_model_config=true", "base_emb_dim=32", "base_num_query_heads=2",
    "base_num_kv_heads=2", "base_num_decoder_layers=2", "first_num_dense_layers=1", "num_experts=4",
    "num_experts_per_tok=2", "vocab_size=256", "qk_nope_head_dim=16", "qk_rope_head_dim=8", "v_head_dim=16",
    "q_lora_rank=16", "kv_lora_rank=16", "base_mlp_dim=32", "base_moe_mlp_dim=32", "mtp_num_layers=1",
    "per_device_batch_size=1", "max_target_length=32", "dataset_type=synthetic", "megablox=false",
)  # fmt: skip


def cases(quick: bool) -> dict[str, Case]:
    """The configs of the issue (``quick``: the same shapes of config on tiny models)."""
    dense, moe, deepseek = (TINY, TINY_MOE, TINY_DEEPSEEK) if quick else (DENSE, MOE, DEEPSEEK)
    batch4 = "per_device_batch_size=4"
    return {
        "dense-full": Case("dense, remat full, batch 4", (*dense, batch4, "remat_policy=full")),
        "dense-minimal": Case("dense, remat minimal, batch 4", (*dense, batch4, "remat_policy=minimal")),
        "dense-none": Case(
            f"dense, remat none (MaxText: {MAXTEXT_LEAST_REMAT}, its cheapest), batch 4",
            (*dense, batch4),
            {
                "nnxtron": {"none": ("remat_policy=none",)},
                "maxtext": {MAXTEXT_LEAST_REMAT: (f"remat_policy={MAXTEXT_LEAST_REMAT}",)},
            },
        ),
        "moe": Case(
            "Mixtral-style MoE: 8 experts of MLP 512, top 2, otherwise the dense model, batch 4",
            (*moe, batch4),
            {"maxtext": SPARSE_BOTH},
        ),
        "deepseek3-tiny-mtp": Case(
            "deepseek3-tiny, mtp_num_layers=1, batch 1 x 128, sparse_matmul=false (every expert on every token)",
            (*deepseek, "sparse_matmul=false"),
        ),
        "deepseek3-tiny-mtp-sparse": Case(
            "the same, sparse_matmul=true (MaxText: ragged_dot; nnxtron: grouped matmul of the routed rows)",
            (*deepseek, "sparse_matmul=true"),
        ),
        "dense-fsdp4": Case(
            "dense, remat full, 4 fake devices, ici_fsdp_parallelism=4, global batch 4",
            (*dense, "per_device_batch_size=1", "ici_fsdp_parallelism=4"),
            devices=4,
        ),
        "dense-pipeline": Case(
            "dense, remat full, 4 fake devices, ici_pipeline_parallelism=2 ici_fsdp_parallelism=2, global batch 16",
            (*dense, "per_device_batch_size=4", "ici_pipeline_parallelism=2", "ici_fsdp_parallelism=2"),
            devices=4,
        ),
    }


def child_env(devices: int) -> dict[str, str]:
    """This process's environment on the CPU backend with ``devices`` fake devices."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    if devices > 1:
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}".strip()
    return env


def run_nnxtron(base_yml: Path, keys: list[str], steps: int, devices: int, profile: Path | None = None) -> dict[str, Any]:
    """``nnxtron bench`` in a fresh process: its JSON line (``profile``: with ``--profile``, its breakdown)."""
    cmd = [sys.executable, "-m", "nnxtron", "bench", str(base_yml), *keys, "--steps", str(steps)]
    cmd += ["--profile", str(profile)] if profile else []
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=child_env(devices))
    if done.returncode != 0:
        raise RuntimeError(f"nnxtron bench failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return {"step_seconds": result["step_seconds"], "step_seconds_min": result["step_seconds_min"],
            "tokens_per_step": result["tokens_per_step"], "loss": result["loss"], "params": result["params"],
            "mesh_shape": result["mesh_shape"], "bench": result, "breakdown": result.get("profile_breakdown")}  # fmt: skip


def parse_maxtext_log(log: str, devices: int) -> dict[str, Any]:
    """MaxText's per-step seconds after the warm-up steps, and the tokens per step it reports."""
    steps = [(int(m[1]), float(m[2]), float(m[3])) for m in STEP_LINE.finditer(log)]
    timed = [(seconds, tokens) for step, seconds, tokens in steps if step >= WARMUP_STEPS]
    if not timed:
        raise RuntimeError(f"no timed 'completed step' line in MaxText's log:\n{log[-3000:]}")
    seconds = [s for s, _ in timed]
    return {
        "step_seconds": statistics.median(seconds),
        "step_seconds_min": min(seconds),
        "step_seconds_all": seconds,
        # Tokens/s/device x seconds x devices (seconds are printed to 1 ms: an estimate, a check only)
        "tokens_per_step_estimate": statistics.median(s * t * devices for s, t in timed),
    }


def run_maxtext(
    interpreter: Path, base_yml: Path, keys: list[str], steps: int, devices: int, cache: str, vocab: int | None = None
) -> dict[str, Any]:
    """MaxText's train command in a fresh process: its per-step times. ``vocab`` (the model's):
    also trace ``PROFILE_STEPS`` steps after the warm-up with MaxText's own profiler
    (``profiler=xplane``), dump the compiled step's HLO (``--xla_dump_to``) and add their
    ``step_profile`` breakdown."""
    run_keys = [f"run_name=vs_maxtext_{os.getpid()}_{time.time_ns()}", f"base_output_directory={cache}/out",
                "enable_checkpointing=false", f"steps={WARMUP_STEPS + max(steps, PROFILE_STEPS if vocab else 1)}"]  # fmt: skip
    env = {**child_env(devices), "DECOUPLE_GCLOUD": "TRUE", "XDG_CACHE_HOME": cache, "MPLCONFIGDIR": cache}
    if vocab:
        run_keys += ["profiler=xplane", f"skip_first_n_steps_for_profiler={WARMUP_STEPS}", f"profiler_steps={PROFILE_STEPS}"]
        dump = f"--xla_dump_to={cache}/hlo --xla_dump_hlo_module_re=jit_train_step"
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {dump}".strip()
    cmd = [str(interpreter), "-m", "maxtext.trainers.pre_train.train", str(base_yml), *run_keys, *keys]
    env.pop("PYTHONPATH", None)  # MaxText's interpreter must not see nnxtron's PYTHONPATH
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=cache, env=env)
    log = done.stdout + done.stderr
    if done.returncode != 0:
        raise RuntimeError(f"MaxText failed (exit {done.returncode}):\n{log[-3000:]}")
    result = parse_maxtext_log(log, devices)
    if vocab:
        hlo = max(Path(cache, "hlo").glob("*jit_train_step*after_optimizations.txt"), key=lambda f: f.stat().st_size)
        result["breakdown"] = read_profile(Path(cache, "out"), vocab, hlo, steps=PROFILE_STEPS)
    return result


def one_run(
    system: str, case: Case, label: str, extra: tuple[str, ...], ctx: dict[str, Any], steps: int, vocab: int | None = None
) -> dict[str, Any]:
    """One timed run (never raises: a failure is recorded with its message). ``vocab`` (the model's
    vocabulary size, which MaxText's breakdown needs): profiled too."""
    keys = [*case.shared, *extra]
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="vs_maxtext_") as cache:
        try:
            if system == "nnxtron":
                trace = Path(cache, "profile") if vocab else None
                result = run_nnxtron(ctx["nnxtron_base_yml"], keys, steps, case.devices, trace)
            else:
                result = run_maxtext(ctx["interpreter"], ctx["maxtext_base_yml"], keys, steps, case.devices, cache, vocab)
        except (RuntimeError, ValueError, KeyError) as error:
            result = {"error": str(error)}
    return {"system": system, "variant": label, "keys": keys, "wall_seconds": time.perf_counter() - start, **result}


def summarize_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per system: the best variant's median and best step times, tokens/s; the ratios nnxtron / MaxText.

    Tokens per step are nnxtron's exact count (both systems run the same batch); MaxText's own
    estimate is kept beside it, and a mismatch over 2% is reported."""
    ok = [run for run in runs if "error" not in run]
    exact = [run["tokens_per_step"] for run in ok if "tokens_per_step" in run]
    estimates = [run["tokens_per_step_estimate"] for run in ok if "tokens_per_step_estimate" in run]
    tokens = exact[0] if exact else round(statistics.median(estimates)) if estimates else None
    out: dict[str, Any] = {"tokens_per_step": tokens}
    if exact and estimates and abs(statistics.median(estimates) / tokens - 1) > 0.02:
        out["warning"] = f"MaxText's tokens per step ({statistics.median(estimates):.0f}) differ from nnxtron's ({tokens})"
        print(f"warning: {out['warning']}", file=sys.stderr)
    for system in SYSTEMS:
        by_variant: dict[str, list[dict[str, Any]]] = {}
        for run in ok:
            if run["system"] == system:
                by_variant.setdefault(run["variant"], []).append(run)
        if not by_variant:
            out[system] = None
            continue
        variants = {
            label: {
                "median_s": statistics.median(r["step_seconds"] for r in rs),
                "best_s": min(r["step_seconds_min"] for r in rs),
                "runs": len(rs),
            }
            for label, rs in by_variant.items()
        }
        median_label = min(variants, key=lambda v: variants[v]["median_s"])
        best_label = min(variants, key=lambda v: variants[v]["best_s"])
        out[system] = {
            "variants": variants,
            "median_variant": median_label,
            "best_variant": best_label,
            "median_s": variants[median_label]["median_s"],
            "best_s": variants[best_label]["best_s"],
            "median_tokens_per_s": tokens / variants[median_label]["median_s"],
            "best_tokens_per_s": tokens / variants[best_label]["best_s"],
        }
    nnx, mt = out["nnxtron"], out["maxtext"]
    if nnx and mt:
        out["ratio_median"] = mt["median_s"] / nnx["median_s"]
        out["ratio_best"] = mt["best_s"] / nnx["best_s"]
    return out


def _system_cell(s: dict[str, Any] | None, key: str) -> str:
    if s is None:
        return "failed"
    label = s["median_variant" if key == "median" else "best_variant"]
    return f"{s[f'{key}_tokens_per_s']:,.0f} ({s[f'{key}_s']:.3f} s{f', {label}' if label else ''})"


def render(results: dict[str, Any], about: dict[str, Any]) -> str:
    """The Markdown table, with the machine and load above it."""
    m = about["machine"]
    load = " -> ".join(" ".join(f"{x:.2f}" for x in v) for v in (about["load_before"], about["load_after"]))
    lines = [
        f"Machine: {m['cpu']}, {m['usable_cpus']} CPUs, {m['memory_gib']} GiB; load average (1/5/15 min) {load}. "
        f"nnxtron {about['nnxtron_commit']} (jax {m['jax']}, Python {m['python']}); MaxText {about['maxtext']['maxtext']} "
        f"(jax {about['maxtext']['jax']}, Python {about['maxtext']['python']}). {about['rounds']} round(s) x {about['steps']} "
        "timed steps per run; tokens/s (step seconds), median and best step.",
        "",
        "| config | tokens/step | nnxtron median | MaxText median | ratio (median) | nnxtron best | MaxText best | ratio (best) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        s = r["summary"]
        nnx, mt = s["nnxtron"], s["maxtext"]
        tokens = s["tokens_per_step"] or "-"
        ratio_m = f"{s['ratio_median']:.2f}x" if "ratio_median" in s else "-"
        ratio_b = f"{s['ratio_best']:.2f}x" if "ratio_best" in s else "-"
        lines.append(
            f"| {name}: {r['about']} | {tokens} | {_system_cell(nnx, 'median')} | {_system_cell(mt, 'median')} | {ratio_m} "
            f"| {_system_cell(nnx, 'best')} | {_system_cell(mt, 'best')} | {ratio_b} |"
        )
    failures = [(name, run) for name, r in results.items() for run in r["runs"] if "error" in run]
    for name, run in failures:
        first = run["error"].strip().splitlines()[-1] if run["error"].strip() else "?"
        lines.append(f"\nFailed: {name} {run['system']} {run['variant']}: {first}")
    lines += [f"\nWarning: {name}: {r['summary']['warning']}" for name, r in results.items() if "warning" in r["summary"]]
    return "\n".join(lines) + "\n"


def profile_both(name: str, case: Case, ctx: dict[str, Any], steps: int) -> dict[str, Any]:
    """One profiled run of each system's first variant (``step_profile``'s breakdown per step)."""
    found: dict[str, Any] = {}
    vocab = load_config(ctx["nnxtron_base_yml"], list(case.shared)).vocab_size
    for system in SYSTEMS:
        label, extra = next(iter(case.runs(system).items()))
        run = one_run(system, case, label, extra, ctx, steps, vocab=vocab)
        found[system] = {"variant": label, **({"error": run["error"]} if "error" in run else {"breakdown": run["breakdown"]})}
        print(f"{name} profiled {system} {label}: {'FAILED' if 'error' in run else 'done'}", file=sys.stderr)
    return found


GROUPINGS = (("where / pass", (0, 1)), ("kind of op", (2,)))


def render_breakdown(name: str, found: dict[str, Any]) -> str:
    """Two tables: op milliseconds and executed ops per step by place and pass, then by kind."""
    if any("error" in found[s] for s in SYSTEMS):
        return f"\nBreakdown of {name}: a profiled run failed ({', '.join(s for s in SYSTEMS if 'error' in found[s])}).\n"
    lines = [f"\n### Where the step goes: {name}\n",
             "Op time per step (ms, summed over the ops the XLA:CPU runtime executed, whichever thread ran them) and "
             "executed ops per step, from one profiled run of each system (`nnxtron bench --profile`; MaxText's "
             "`profiler=xplane` with its step's HLO dump), grouped by `nnxtron.tools.step_profile`.\n"]  # fmt: skip
    for title, levels in GROUPINGS:
        rows = {s: summarize(found[s]["breakdown"]["groups"], levels) for s in SYSTEMS}
        keys = sorted(set(rows["nnxtron"]) | set(rows["maxtext"]), key=lambda k: -rows["maxtext"].get(k, {"ms": 0})["ms"])
        lines += [f"| {title} | nnxtron ms | MaxText ms | nnxtron ops | MaxText ops |", "|---|---|---|---|---|"]
        for key in keys:
            a, b = (rows[s].get(key, {"ms": 0.0, "ops": 0.0}) for s in SYSTEMS)
            lines.append(f"| {key} | {a['ms']:.1f} | {b['ms']:.1f} | {a['ops']:,.0f} | {b['ops']:,.0f} |")
        total = [found[s]["breakdown"] for s in SYSTEMS]
        lines += [
            f"| total | {total[0]['ms']:.1f} | {total[1]['ms']:.1f} | {total[0]['ops']:,.0f} | {total[1]['ops']:,.0f} |",
            "",
        ]
    return "\n".join(lines)


def nnxtron_identity() -> dict[str, str]:
    """Where the nnxtron that the runs use comes from (as this interpreter and environment import it)."""
    code = "import nnxtron, flax, jax; print(nnxtron.__file__, jax.__version__, flax.__version__)"
    path, jax_version, flax_version = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, cwd=ROOT
    ).stdout.split()
    src = Path(path).resolve().parents[1]
    git = subprocess.run(["git", "-C", str(src), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(src), "status", "--porcelain", "--", "."], capture_output=True, text=True)
    commit = (git.stdout.strip() or "unknown") + ("+uncommitted" if dirty.stdout.strip() else "")
    return {"nnxtron_file": path, "nnxtron_commit": commit, "jax": jax_version, "flax": flax_version}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    all_cases = cases(quick=False)
    parser.add_argument("--only", nargs="+", choices=list(all_cases), help="run these configs only (default: all)")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds (nnxtron, MaxText) per config")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per run (after 2 warm-up steps)")
    parser.add_argument("--quick", action="store_true", help="tiny models: checks the machinery, not the speed")
    parser.add_argument("--python", default="python3.12", help="a Python >= 3.12 to make the MaxText environment with")
    parser.add_argument("--env", type=Path, default=maxtext_reference.DEFAULT_ENV, help="the MaxText environment")
    parser.add_argument("--out", type=Path, default=None, help="the Markdown file (default benchmarks/results/...)")
    parser.add_argument(
        "--breakdown", nargs="+", choices=list(all_cases), metavar="CONFIG",
        help="after timing these configs, profile one run of each system and add where its step's time goes",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.steps < 1:
        parser.error("--rounds and --steps must be at least 1")

    interpreter = maxtext_reference.ensure_env(args.env, args.python)
    maxtext_base = next((args.env / "lib").glob("python3*/site-packages/maxtext/configs/base.yml"))
    ctx = {"interpreter": interpreter, "maxtext_base_yml": maxtext_base, "nnxtron_base_yml": maxtext_reference.BASE_YML}
    identity = nnxtron_identity()
    print(f"nnxtron from {identity['nnxtron_file']} ({identity['nnxtron_commit']}); MaxText: {interpreter}", file=sys.stderr)
    about: dict[str, Any] = {
        "machine": machine(),
        **identity,
        "maxtext": maxtext_reference.versions(interpreter),
        "load_before": os.getloadavg(),
        "rounds": args.rounds,
        "steps": args.steps,
        "quick": args.quick,
    }
    out = args.out or RESULTS / f"vs_maxtext-{about['machine']['backend']}{'-quick' if args.quick else ''}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    selected = {name: case for name, case in cases(args.quick).items() if not args.only or name in args.only}
    results: dict[str, Any] = {}
    for name, case in selected.items():
        runs = []
        for round_ in range(args.rounds):
            for system in SYSTEMS:
                for label, extra in case.runs(system).items():
                    run = {"round": round_, **one_run(system, case, label, extra, ctx, args.steps)}
                    runs.append(run)
                    took = f"{run['step_seconds']:.3f} s/step" if "error" not in run else "FAILED"
                    print(f"{name} round {round_} {system} {label}: {took} ({run['wall_seconds']:.0f} s)", file=sys.stderr)
        results[name] = {"about": case.about, "devices": case.devices, "runs": runs, "summary": summarize_runs(runs)}
        if name in (args.breakdown or ()):
            results[name]["breakdown"] = profile_both(name, case, ctx, args.steps)
        about["load_after"] = os.getloadavg()
        table = render(results, about)  # written after each config: a stopped run keeps what it measured
        table += "".join(render_breakdown(n, r["breakdown"]) for n, r in results.items() if "breakdown" in r)
        out.write_text(table)
        out.with_suffix(".json").write_text(json.dumps({"about": about, "results": results}, indent=1, default=str) + "\n")
    print(table, end="")
    return results


if __name__ == "__main__":
    main()
