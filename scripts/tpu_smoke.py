"""The TPU smoke suite: one command on a TPU VM proves the documented paths run on the chip.

    python scripts/tpu_smoke.py [--out FILE.json] [--only NAME ...]

Checks (each one's own process where it is a command; one line each, PASS or FAIL):

* ``train_default``: the README's main job, ``nnxtron train`` with its defaults;
* ``generate``: ``nnxtron generate`` from that run;
* ``deepseek3_mtp`` / ``deepseek3_mtp_fp8_full``: the README's DeepSeek-V3 + MTP regression
  command and its ``quantization=fp8_full`` variant; both must report an ``mtp`` loss;
* ``kill_resume``: a run SIGKILLed after its first checkpoint, then resumed, ends with the
  same per-step losses, bit for bit, as the same run uninterrupted;
* ``scan_vs_unrolled_bf16`` and ``splash_vs_xla_bf16``: loss, input gradient and every
  parameter gradient of a bfloat16 model, scanned vs unrolled layers and ``attention=splash``
  vs ``xla``, within the bfloat16 bounds below (tests/parity on CPU use float32);
* ``to_hf_round_trip``: ``convert to-hf`` then ``from-hf`` of the default run: the same greedy continuation.

It refuses to run off a TPU. The last result is kept in docs/tpu.md. bfloat16 bounds (from
the strategy tests' aggregate + per-leaf rule, DESIGN.md): loss within 2e-2 relative,
gradients within 5e-2 of the aggregate norm and per leaf 0.1 relative + 1e-3 of the largest leaf.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BF16_BOUNDS = dict(loss_rtol=2e-2, rel=1e-1, abs_frac=1e-3, aggregate_rel=5e-2)
DS3 = "model_name=deepseek3-tiny per_device_batch_size=1 max_target_length=128 steps=20 dataset_type=synthetic mtp_num_layers=1 mtp_loss_scaling_factor=0.1 enable_checkpointing=false"  # noqa: E501
FP8 = "model_name=deepseek3-tiny mtp_num_layers=1 use_qwix_quantization=true quantization=fp8_full dataset_type=synthetic per_device_batch_size=1 max_target_length=32 steps=20"  # noqa: E501
RESUME = "dataset_type=synthetic steps=12 checkpoint_period=4 eval_interval=-1 log_period=1 enable_tensorboard=false"


def nnxtron(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nnxtron", *args], capture_output=True, text=True, timeout=timeout)


def _ok(proc: subprocess.CompletedProcess) -> None:
    if proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}")


def _train_records(run: Path) -> list[dict]:
    """The run's training records (``metrics.jsonl`` also holds evaluation records)."""
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def _losses(run: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in _train_records(run)]


class Smoke:
    def __init__(self, base: Path):
        self.base = base

    def train_default(self) -> str:
        _ok(nnxtron("train", f"base_output_directory={self.base}", "run_name=default", "--no-progress", timeout=600))
        losses = _losses(self.base / "default")
        return f"loss {losses[0][1]:.2f} -> {losses[-1][1]:.2f} in {losses[-1][0]} steps"

    def generate(self) -> str:
        proc = nnxtron("generate", str(self.base / "default"), "--prompt", "The ", "max_new_tokens=32")
        _ok(proc)
        return f"{len(proc.stdout)} characters"

    def _mtp(self, command: str, name: str) -> str:
        _ok(nnxtron("train", *command.split(), f"base_output_directory={self.base}", f"run_name={name}", "--no-progress"))
        last = _train_records(self.base / name)[-1]
        if not last.get("aux/mtp", 0) > 0:
            raise AssertionError(f"no positive aux/mtp loss in the last training record: {last}")
        return f"loss {last['loss']:.3f}, aux/mtp {last['aux/mtp']:.3f}"

    def deepseek3_mtp(self) -> str:
        return self._mtp(DS3, "ds3")

    def deepseek3_mtp_fp8_full(self) -> str:
        return self._mtp(FP8, "ds3-fp8")

    def kill_resume(self) -> str:
        common = [*RESUME.split(), f"base_output_directory={self.base}", "--no-progress"]
        _ok(nnxtron("train", *common, "run_name=straight"))
        checkpoints = self.base / "killed" / "checkpoints"
        proc = subprocess.Popen([sys.executable, "-m", "nnxtron", "train", *common, "run_name=killed"], stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 300
        while proc.poll() is None and time.monotonic() < deadline:
            if checkpoints.is_dir() and any(p.name.isdigit() for p in checkpoints.iterdir()):
                proc.send_signal(signal.SIGKILL)
                break
            time.sleep(0.01)
        proc.wait()
        killed = proc.returncode == -signal.SIGKILL
        _ok(nnxtron("train", *common, "run_name=killed"))
        straight, resumed = _losses(self.base / "straight"), _losses(self.base / "killed")
        if straight != resumed:
            raise AssertionError(f"losses differ: {straight} vs {resumed}")
        return f"{len(straight)} steps bit-exact ({'killed after a checkpoint' if killed else 'finished before the kill'})"

    def _parity(self, a: dict, b: dict, **common) -> str:
        import numpy as np

        from nnxtron.config import load_config
        from nnxtron.models.build import build_model
        from nnxtron.tools.parity import assert_grad_parity, loss_and_grads

        cfg = load_config(values={**common, **a})
        seq = cfg.max_target_length
        tokens = np.random.default_rng(0).integers(3, cfg.vocab_size, size=(4, seq + 1)).astype(np.int32)
        segments = np.repeat(np.array([[1] * (seq // 2) + [2] * (seq - seq // 2)], np.int32), 4, axis=0)  # two documents
        positions = np.where(segments == 1, np.arange(seq), np.arange(seq) - seq // 2).astype(np.int32)
        batch = {
            "inputs": tokens[:, :-1],
            "targets": tokens[:, 1:],
            "positions": positions,
            "segment_ids": segments,
            "loss_mask": np.ones((4, seq), np.float32),
        }
        got = loss_and_grads(build_model(load_config(values={**common, **b})), batch)
        ref = loss_and_grads(build_model(cfg), batch)
        assert_grad_parity(got, ref, **BF16_BOUNDS)
        return f"loss {float(got.loss):.5f} vs {float(ref.loss):.5f}"

    def scan_vs_unrolled_bf16(self) -> str:
        model = dict(
            model_name="llama3.1-tiny", dtype="bfloat16", base_emb_dim=256, head_dim=64, base_mlp_dim=512, max_target_length=256
        )
        return self._parity({"scan_layers": True}, {"scan_layers": False}, **model)

    def splash_vs_xla_bf16(self) -> str:
        model = dict(
            model_name="llama3.1-tiny", dtype="bfloat16", base_emb_dim=256, head_dim=64, base_mlp_dim=512, max_target_length=256
        )
        return self._parity({"attention": "xla"}, {"attention": "splash"}, **model)

    def to_hf_round_trip(self) -> str:
        _ok(nnxtron("convert", "to-hf", str(self.base / "default"), str(self.base / "hf")))
        _ok(nnxtron("convert", "from-hf", str(self.base / "hf"), str(self.base / "back")))
        logits = []
        for run in ("default", "back"):
            proc = nnxtron(
                "generate",
                str(self.base / run),
                "--prompt",
                "The ",
                "--json",
                "max_new_tokens=8",
                "decode_sampling_strategy=greedy",
            )
            _ok(proc)
            logits.append(proc.stdout.strip())
        if logits[0] != logits[1]:
            raise AssertionError(f"greedy continuations differ: {logits}")
        return "greedy continuation identical after to-hf -> from-hf"


CHECKS = (
    "train_default",
    "generate",
    "deepseek3_mtp",
    "deepseek3_mtp_fp8_full",
    "kill_resume",
    "scan_vs_unrolled_bf16",
    "splash_vs_xla_bf16",
    "to_hf_round_trip",
)
NEEDS = {"generate": "train_default", "to_hf_round_trip": "train_default"}  # checks that read another's run


def missing_prerequisites(chosen: list[str]) -> list[str]:
    """One line per chosen check whose prerequisite (``NEEDS``) is not chosen before it."""
    return [
        f"{name} reads the run {NEEDS[name]} makes; put {NEEDS[name]} before it in --only"
        for i, name in enumerate(chosen)
        if name in NEEDS and NEEDS[name] not in chosen[:i]
    ]


def _backend() -> str:
    """The JAX backend, asked in a child process: the parent never holds the chip, which one
    process at a time may open (every check runs in a process of its own)."""
    proc = subprocess.run([sys.executable, "-c", "import jax; print(jax.default_backend())"], capture_output=True, text=True)
    return proc.stdout.strip() or f"none ({proc.stderr.strip().splitlines()[-1:]})"


def _child(name: str, base: Path) -> int:
    """Run one check in this process; its one-line JSON result on stdout."""
    start = time.monotonic()
    try:
        status, detail = "PASS", getattr(Smoke(base), name)()
    except Exception as err:  # noqa: BLE001  (every failure is one row of the report)
        status, detail = "FAIL", f"{type(err).__name__}: {err}"[:400]
    print(json.dumps({"check": name, "status": status, "seconds": round(time.monotonic() - start, 1), "detail": detail}))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="JSON result file")
    parser.add_argument("--only", nargs="*", default=None, choices=CHECKS)
    parser.add_argument("--child", nargs=2, default=None, metavar=("CHECK", "DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return _child(args.child[0], Path(args.child[1]))
    problems = missing_prerequisites(args.only or list(CHECKS))
    if problems:
        print(f"error: {problems[0]}", file=sys.stderr)
        return 2
    backend = _backend()
    if backend != "tpu":
        print(f"tpu_smoke.py runs on a TPU; this machine's JAX backend is {backend}", file=sys.stderr)
        return 2
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.only or CHECKS:
            proc = subprocess.run([sys.executable, __file__, "--child", name, tmp], capture_output=True, text=True)
            lines = proc.stdout.strip().splitlines()
            row = (
                json.loads(lines[-1])
                if lines
                else {"check": name, "status": "FAIL", "seconds": None, "detail": proc.stderr[-400:]}
            )
            rows.append(row)
            print(f"{row['status']} {name} ({row['seconds']} s): {row['detail']}", flush=True)
    version = subprocess.run([sys.executable, "-c", "import jax; print(jax.__version__, '|', jax.devices()[0].device_kind)"],
                             capture_output=True, text=True).stdout.strip()  # fmt: skip
    result = {"date": time.strftime("%Y-%m-%d"), "jax_and_device": version, "checks": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0 if all(r["status"] == "PASS" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
