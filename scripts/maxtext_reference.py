"""Reference runs of MaxText for nnxtron's step-for-step reproduction tests
(tests/parity/test_maxtext_reproduction.py). Not run in CI: the tests read what this writes.

MaxText (PyPI ``maxtext``) needs Python >= 3.12, so it lives in its own cached virtual environment
(default ``~/.cache/nnxtron/maxtext-<version>``), made on first use the way MaxText's decoupled
(CPU, no Google Cloud) install works: ``python3.12 -m venv``, ``pip install uv``, the wheel's own
``dependencies/requirements/generated_requirements/decoupled-requirements.txt`` installed with
``uv pip install --resolution=lowest``, then the wheel itself with ``--no-deps``.

For each config of ``CONFIGS`` (MaxText ``key=value`` overrides on MaxText's ``base.yml``, the
same list ``nnxtron train tests/assets/maxtext/base.yml k=v ...`` takes) the MaxText environment's
Python runs ``scripts/maxtext/driver.py`` (MaxText is imported only there), which writes to
``tests/assets/maxtext/reference/<family>/``: MaxText's initial checkpoint, the initial and final
parameters, the token batches, the logits on fixed tokens and every step's metrics. For each config
of ``INIT_CONFIGS`` it writes only ``init/<family>/initial_statistics.json`` (every initial tensor's
mean, standard deviation, minimum and maximum: tests/parity/test_init_parity.py). Then
``manifest.json`` records the versions, the commands, the overrides and each file's sha256.

    python scripts/maxtext_reference.py                       # all families (about 2 minutes)
    python scripts/maxtext_reference.py --families llama2     # one
    python scripts/maxtext_reference.py --families --init-families qwen3   # one family's initial statistics
    python scripts/maxtext_reference.py --python /path/to/python3.12 --env DIR

Deterministic on CPU: MaxText's initialiser is seeded (init_weights_seed=0) and the batches come
from a seeded NumPy generator.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Mapping
from pathlib import Path

import numpy as np

MAXTEXT_VERSION = "0.2.5"
ROOT = Path(__file__).resolve().parents[1]
BASE_YML = ROOT / "tests" / "assets" / "maxtext" / "base.yml"  # MaxText 0.2.5's own base.yml
OUT = ROOT / "tests" / "assets" / "maxtext" / "reference"
DRIVER = ROOT / "scripts" / "maxtext" / "driver.py"
DEFAULT_ENV = Path.home() / ".cache" / "nnxtron" / f"maxtext-{MAXTEXT_VERSION}"  # the cached environment
REQUIREMENTS = "dependencies/requirements/generated_requirements/decoupled-requirements.txt"  # in the wheel

# float32, one CPU device, 20 steps at learning_rate 1e-3 with MaxText's optimizer defaults
# (AdamW b1 0.9 b2 0.95 eps 1e-8, weight decay 0.1, cosine schedule with 10% warm-up, gradient
# clipping at 1.0)
TRAINING = (
    "per_device_batch_size=2",
    "max_target_length=32",
    "dtype=float32",
    "weight_dtype=float32",
    "steps=20",
    "learning_rate=1e-3",
    "dataset_type=synthetic",
)
ATTENTION = ("base_emb_dim=32", "base_num_query_heads=4", "base_num_kv_heads=2", "head_dim=8", "vocab_size=128")
CONFIGS: dict[str, tuple[str, ...]] = {
    "llama2": ("decoder_block=llama2", *ATTENTION, "base_mlp_dim=64", "base_num_decoder_layers=2", *TRAINING),
    # the tied head with MaxText's normalize_embedding_logits=true (base.yml): logits / sqrt(emb_dim)
    "llama2_tied": (
        "decoder_block=llama2",
        *ATTENTION,
        "base_mlp_dim=64",
        "base_num_decoder_layers=2",
        "logits_via_embedding=true",
        *TRAINING,
    ),
    "mixtral": (  # dropless routed experts through MaxText's sparse (ragged) path, with its load-balance loss
        "decoder_block=mixtral",
        *ATTENTION,
        "base_mlp_dim=32",
        "base_moe_mlp_dim=32",
        "base_num_decoder_layers=2",
        "num_experts=4",
        "num_experts_per_tok=2",
        "megablox=false",
        "sparse_matmul=true",
        "load_balance_loss_weight=0.01",
        *TRAINING,
    ),
    "deepseek3": (  # MaxText's deepseek3-tiny, smaller: MLA + YaRN, 1 dense + 1 MoE layer, MTP depth 1
        "model_name=deepseek3-tiny",
        "override_model_config=true",
        "base_emb_dim=32",
        "base_num_query_heads=2",
        "base_num_kv_heads=2",
        "base_num_decoder_layers=2",
        "first_num_dense_layers=1",
        "num_experts=4",
        "num_experts_per_tok=2",
        "vocab_size=128",
        "qk_nope_head_dim=16",
        "qk_rope_head_dim=8",
        "v_head_dim=16",
        "q_lora_rank=16",
        "kv_lora_rank=16",
        "base_mlp_dim=32",
        "base_moe_mlp_dim=32",
        "mtp_num_layers=1",
        "mtp_loss_scaling_factor=0.1",
        "sparse_matmul=false",
        "megablox=false",
        *TRAINING,
    ),
}


# initial parameters only (``driver.py --init-statistics``): each tensor's statistics, for
# tests/parity/test_init_parity.py. MaxText's own model config of the family, shrunk; the tied head's
# normalize_embedding_logits=false that qwen3-0.6b and gpt3-52k set is repeated on the command line
# so that nnxtron's loader sees MaxText's value too.
INIT = ("per_device_batch_size=2", "max_target_length=32", "dtype=float32", "weight_dtype=float32", "dataset_type=synthetic")
MOE = ("megablox=false", "sparse_matmul=false")
INIT_CONFIGS: dict[str, tuple[str, ...]] = {
    "gemma3": ("model_name=gemma3-4b", "override_model_config=true", *ATTENTION, "base_mlp_dim=64",
               "base_num_decoder_layers=2", *INIT),
    "gpt3": ("model_name=gpt3-52k", "override_model_config=true", *ATTENTION, "base_mlp_dim=64",
             "base_num_decoder_layers=2", "normalize_embedding_logits=false", *INIT),
    "llama4": ("model_name=llama4-17b-16e", "override_model_config=true", *ATTENTION, "base_mlp_dim=64",
               "base_moe_mlp_dim=32", "base_num_decoder_layers=4", "num_experts=16", "num_experts_per_tok=1", *MOE, *INIT),
    "qwen3": ("model_name=qwen3-0.6b", "override_model_config=true", *ATTENTION, "base_mlp_dim=64",
              "base_num_decoder_layers=2", "normalize_embedding_logits=false", *INIT),
    "qwen3_moe": ("model_name=qwen3-30b-a3b", "override_model_config=true", *ATTENTION, "base_mlp_dim=32",
                  "base_moe_mlp_dim=32", "base_num_decoder_layers=2", "num_experts=4", "num_experts_per_tok=2", *MOE, *INIT),
}  # fmt: skip


def nnxtron_batch(batches: Mapping[str, np.ndarray], step: int) -> dict[str, np.ndarray]:
    """Step ``step`` of batches in MaxText's layout (``driver.make_batches``: ``inputs``, ``targets``,
    ``inputs_position``, ``inputs_segmentation``, ``targets_segmentation``, each [steps, B, S]) as
    nnxtron's host batch; the loss counts the targets inside a document (segment id != 0), as MaxText's."""
    return {
        "inputs": batches["inputs"][step],
        "targets": batches["targets"][step],
        "positions": batches["inputs_position"][step],
        "segment_ids": batches["inputs_segmentation"][step],
        "loss_mask": (batches["targets_segmentation"][step] != 0).astype(np.float32),
    }


def run(cmd: list[str], **kwargs) -> None:
    print("+", " ".join(map(str, cmd)), flush=True)
    subprocess.run(cmd, check=True, **kwargs)


def ensure_env(env: Path, python: str) -> Path:
    """The MaxText environment's interpreter, creating the environment if it is missing."""
    interpreter = env / "bin" / "python"
    if interpreter.exists():
        return interpreter
    run([python, "-m", "venv", str(env)])
    run([str(interpreter), "-m", "pip", "install", "-q", "uv"])
    with tempfile.TemporaryDirectory() as tmp:
        run([str(interpreter), "-m", "pip", "download", "-q", "--no-deps", f"maxtext=={MAXTEXT_VERSION}", "-d", tmp])
        wheel = next(Path(tmp).glob("maxtext-*.whl"))
        with zipfile.ZipFile(wheel) as archive:
            archive.extract(REQUIREMENTS, tmp)
        uv = [str(env / "bin" / "uv"), "pip", "install", "--python", str(interpreter)]
        run([*uv, "--resolution=lowest", "-r", str(Path(tmp) / REQUIREMENTS)])
        run([*uv, "--no-deps", str(wheel)])
    return interpreter


def versions(interpreter: Path) -> dict[str, str]:
    code = (
        "import json, sys, importlib.metadata as m; "
        "print(json.dumps({'python': sys.version.split()[0], "
        "**{p: m.version(p) for p in ('maxtext', 'jax', 'jaxlib', 'flax', 'optax', 'orbax-checkpoint', 'numpy')}}))"
    )
    return json.loads(subprocess.run([str(interpreter), "-c", code], check=True, capture_output=True, text=True).stdout)


def shown(path: Path) -> str:
    """``path`` relative to the repository when inside it."""
    return str(path.resolve().relative_to(ROOT)) if path.resolve().is_relative_to(ROOT) else str(path)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def reference(interpreter: Path, out: Path, overrides: tuple[str, ...], env: dict[str, str], *flags: str) -> dict:
    """Run the driver for one config into ``out`` (emptied first); its manifest entry."""
    if out.exists():
        shutil.rmtree(out)
    driver = ["scripts/maxtext/driver.py", "--out", shown(out), "--base-yml", str(BASE_YML.relative_to(ROOT)), *flags]
    run([str(interpreter), str(DRIVER), *driver[1:], "--", *overrides], env=env, cwd=ROOT)
    files = sorted(p for p in out.rglob("*") if p.is_file())
    return {
        "overrides": list(overrides),
        "command": f"python {' '.join(driver)} -- {' '.join(overrides)}",
        "files": {str(p.relative_to(out)): {"bytes": p.stat().st_size, "sha256": sha256(p)} for p in files},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", default="python3.12", help="a Python >= 3.12 to make the MaxText environment with")
    parser.add_argument("--env", type=Path, default=DEFAULT_ENV)
    parser.add_argument("--families", nargs="*", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--init-families", nargs="*", default=list(INIT_CONFIGS), choices=list(INIT_CONFIGS))
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    interpreter = ensure_env(args.env, args.python)
    manifest_path = args.out / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {"families": {}}
    manifest["versions"] = versions(interpreter)
    manifest["base_yml"] = {"path": str(BASE_YML.relative_to(ROOT)), "sha256": sha256(BASE_YML)}
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "DECOUPLE_GCLOUD": "TRUE", "XDG_CACHE_HOME": cache, "MPLCONFIGDIR": cache}
        for family in args.families:
            manifest["families"][family] = reference(interpreter, args.out / family, CONFIGS[family], env)
        for family in args.init_families:
            entry = reference(interpreter, args.out / "init" / family, INIT_CONFIGS[family], env, "--init-statistics")
            manifest.setdefault("init_statistics", {})[family] = entry
    manifest["families"] = {f: manifest["families"][f] for f in CONFIGS if f in manifest["families"]}
    init = manifest.get("init_statistics", {})
    manifest["init_statistics"] = {f: init[f] for f in INIT_CONFIGS if f in init}
    manifest_path.write_text(json.dumps(manifest, indent=1) + "\n")
    entries = [*manifest["families"].values(), *manifest["init_statistics"].values()]
    total = sum(v["bytes"] for fam in entries for v in fam["files"].values())
    print(f"wrote {manifest_path} ({total / 1e6:.2f} MB of reference files)")


if __name__ == "__main__":
    sys.exit(main())
