"""`nnxtron train`: the training loop with eval, checkpoints, metrics and resume."""

from __future__ import annotations

import errno
import json
import os
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import numpy as np
import yaml

from nnxtron.config.derived import Derived, derive
from nnxtron.config.fingerprint import check_same_model, fingerprint, of_stored, other_changes
from nnxtron.config.flops import training_flops_per_token
from nnxtron.config.loader import RUN_TOKENIZER_DIR, run_config_to_yaml
from nnxtron.config.schema import Config
from nnxtron.config.stacks import pipeline_summary
from nnxtron.data.pipeline import BatchSource, DataIterator
from nnxtron.data.sources import keep_tokenizer, make_sources
from nnxtron.errors import CheckpointError, DataError, TrainingError, UserError
from nnxtron.layers.attention import attention_in_use
from nnxtron.models.quant import summary
from nnxtron.parallel.mesh import make_mesh
from nnxtron.params import flatten_with_treedef
from nnxtron.runtime.compile_cache import enable_compilation_cache
from nnxtron.runtime.interrupt import stop_if_interrupted
from nnxtron.runtime.peak import peak_flops_total
from nnxtron.train.checkpoint import Checkpointer, UnreadableCheckpoint
from nnxtron.train.checksum import DPO_REFERENCE_FILE, check_recorded
from nnxtron.train.metrics import LogWriteError, MetricsWriter, ProgressBar
from nnxtron.train.optimizer import make_optimizer
from nnxtron.train.preemption import StopRequests
from nnxtron.train.run_dir import (
    RunDirError,
    RunLock,
    disk_error,
    make_run_dir,
    refuse_links,
    remove_unused_run_dir,
    resolve_run_dir,
)
from nnxtron.train.schedules import schedule_change_note
from nnxtron.train.state import TrainState, init_state, setup
from nnxtron.train.step import (
    Extras,
    Reference,
    batch_sharding,
    device_batch,
    make_eval_step,
    make_train_step,
    reference_from,
)
from nnxtron.train.wandb_logger import require_wandb
from nnxtron.train.weights import ParamsLoader, checkpoint_model, lora_base, starting_weights

# (abstract {"params", "rest"}, their shardings) -> the starting (params, model state or None) of an init_from run


@dataclass
class TrainResult:
    run_dir: Path
    start_step: int
    end_step: int
    losses: list[float] = field(default_factory=list)
    eval_losses: dict[int, float] = field(default_factory=dict)
    eval_mtp_acceptance: dict[int, float] = field(default_factory=dict)  # with mtp_eval_target_module > 0
    skipped_steps: list[int] = field(default_factory=list)  # non-finite updates dropped (non_finite_policy=skip)
    stopped_by: int | None = None  # the signal (SIGTERM, SIGINT) that stopped the run early, after a checkpoint
    state: TrainState | None = None
    frozen: Any = None  # lora_rank > 0: the frozen base parameters the adapters in ``state`` apply to


def _check_same_model(run_dir: Path, cfg: Config) -> list[str]:
    """An existing run may change training keys (steps, lr, mesh...) but not the model
    (``config.fingerprint``); returns the keys that changed (``key old -> new``)."""
    stored_file = run_dir / "config.yml"
    if not stored_file.is_file():
        return []
    try:
        stored = yaml.safe_load(stored_file.read_text()) or {}
    except yaml.YAMLError:
        raise CheckpointError(f"{stored_file} is not valid YAML; repair it or use a new run_name") from None
    if not isinstance(stored, dict):
        raise CheckpointError(f"{stored_file} is not a mapping of key: value; repair it or use a new run_name")
    check_same_model(of_stored(stored), cfg, f"run '{run_dir}'", "use the same values to resume, or a new run_name")
    return other_changes(stored, cfg)


def _check_no_history(run_dir: Path) -> None:
    """With ``enable_checkpointing=false`` a run can never resume: running it again starts a
    new run at step 0 that replaces the metrics logged before, refused (one line) unless
    ``restart`` asks for it. (With checkpoints, a run with none yet resumes from step 0 like
    any resume: the records after the newest checkpoint are those of the lost steps.)"""
    log = run_dir / "metrics.jsonl"
    records = sum(1 for line in log.read_text(errors="replace").splitlines() if line.strip()) if log.is_file() else 0
    if records:
        raise RunDirError(
            f"run '{run_dir}' already holds {records} logged records and enable_checkpointing=false cannot resume it "
            "(it would start again at step 0 and rewrite them); choose a new run_name, or pass --restart to start it again"
        )


class Trainer:
    """Owns the mesh, compiled steps, data and checkpoints of one run."""

    def __init__(
        self,
        cfg: Config,
        run_dir: Path | None = None,
        *,
        progress: bool | None = None,
        restart: bool = False,
        init_params: ParamsLoader | None = None,
    ):
        if cfg.init_from and init_params is None:
            raise UserError(
                f"init_from={cfg.init_from} needs its weights reader: pass init_params=nnxtron.convert.runs.init_params(cfg) "
                "(`nnxtron train` does)"
            )
        self.cfg = cfg
        self.init_params = init_params  # reads the init_from weights of a new run
        self.compilation_cache = enable_compilation_cache(cfg)  # before anything compiles; None = off
        self.derived: Derived = derive(cfg, jax.device_count(), jax.process_count())
        self.run_dir = run_dir or resolve_run_dir(cfg)
        if cfg.enable_wandb:
            require_wandb()  # a missing extra fails here, before the run directory is written
        self.mesh = make_mesh(cfg)
        self.train_source, self.eval_source = make_sources(cfg, self.derived.global_batch_size)  # bad data fails fast
        self.tx, self.schedule = make_optimizer(cfg, self.derived)
        self.setup = setup(cfg, self.mesh, self.tx)
        self.batch_shardings = batch_sharding(cfg, self.setup)
        self.progress_enabled = progress
        self.restart = restart  # a run without checkpoints may start again over its logged steps
        self.notes: list[str] = []  # lines for the start-up print (checkpoints skipped on resume)
        self.train_step = make_train_step(cfg, self.setup, self.tx, self.schedule)
        self.eval_step = make_eval_step(cfg, self.setup)
        self.step_args: tuple = ()  # LoRA / use_dpo: (Extras(frozen base, reference model),), set when the run starts

    def _data(self, source: BatchSource) -> DataIterator:
        return source.iterator(jax.process_index(), jax.process_count())

    def initial_state(self, ckpt: Checkpointer | None, weights: Any = None) -> tuple[TrainState, int, dict | None]:
        """(state, first step, this process's saved data-iterator state or None for a new run).

        Resumes from the newest checkpoint that reads back completely; newer unreadable ones
        (truncated, corrupted) are reported in ``self.notes`` and renamed
        ``<step>.unreadable``, never deleted. None readable at all is an error."""
        unreadable: list[tuple[int, UnreadableCheckpoint]] = []
        for step in ckpt.steps() if ckpt is not None else []:
            try:
                state, meta = ckpt.restore(step, self.setup.abstract_state, self.setup.state_shardings)
            except UnreadableCheckpoint as err:
                unreadable.append((step, err))
                continue
            fix = "use the same values to resume, or a new run_name"
            check_same_model(checkpoint_model(meta), self.cfg, f"checkpoint '{ckpt.directory / str(step)}'", fix)
            if int(state["step"]) != step or meta.get("data_position") != step:
                raise CheckpointError(
                    f"checkpoint {step} in {ckpt.directory} is inconsistent (step/data position); use a new run_name"
                )
            for bad, err in unreadable:
                kept = ckpt.set_aside(bad)
                self.notes.append(f"skipped checkpoint {bad}: {str(err).split('; ')[0]}; kept as '{kept.name}'")
            return state, step, _process_data_state(meta, ckpt.directory / str(step))
        if unreadable:
            raise CheckpointError(
                f"none of the {len(unreadable)} checkpoints in '{ckpt.directory}' reads back (newest: "
                f"{str(unreadable[0][1]).split('; ')[0]}); repair them or use a new run_name"
            )
        return self.starting_state(weights=weights), 0, None

    def read_weights(self) -> tuple[Any, Any] | None:
        """The starting ``(params, model state or None)`` read from init_from / load_parameters_path
        (with LoRA: the base model's parameters), or None: a seeded init."""
        abstract = {key: self.setup.abstract_state[key] for key in ("params", "rest")}
        shardings = {key: self.setup.state_shardings[key] for key in ("params", "rest")}
        if self.cfg.lora_rank:
            abstract["params"], shardings["params"] = self.setup.abstract_frozen, self.setup.frozen_shardings
        return starting_weights(self.cfg, self.init_params, abstract, shardings)

    def starting_state(self, optimizer: bool = True, weights: Any = None) -> TrainState:
        """The state of step 0: the init_from / load_parameters_path weights (``weights``: as
        ``read_weights`` returned them, else read now), else a seeded init (``optimizer=False``:
        its parameters and model state only). With LoRA the parameters are fresh adapters."""
        weights = self.read_weights() if weights is None else weights
        params, rest = weights or (None, None)
        if self.cfg.lora_rank:
            params = None  # the weights read are the frozen base's (``lora_base``)
        return init_state(self.cfg, self.setup, self.tx if optimizer else None, params, rest)

    def lora_base(self, weights: Any) -> Any:
        """LoRA's frozen base parameters, placed on the devices from ``weights`` (``read_weights``)
        or the seeded init, and checked against the checksum recorded when the run started."""
        return lora_base(
            self.cfg, self.run_dir, self.setup.frozen_shardings, weights, "lora_rank > 0: the frozen base weights", record_step=0
        )

    def dpo_reference(self, state: TrainState, start: int, weights: Any = None) -> Reference:
        """DPO's frozen reference model: the run's starting weights (a copy of ``state``'s at step 0;
        read again on resume, and checked against the checksum recorded when the run started)."""
        reference = reference_from(state if start == 0 else self.starting_state(False, weights), self.setup)
        tree = {"params": reference.params, "rest": reference.rest}
        check_recorded(self.run_dir, DPO_REFERENCE_FILE, tree, "use_dpo=true: the reference weights", record_step=start)
        return reference

    def evaluate(self, state: TrainState) -> dict[str, float]:
        """``{"loss": token-mean eval loss}`` plus ``"mtp_acceptance"`` (fraction) when configured;
        with ``use_dpo`` the pair-mean DPO loss and its ``dpo/*`` statistics."""
        sums: dict[str, float] = {}
        batches = self._data(self.eval_source)  # the same first eval_steps batches every time
        try:
            for _ in range(self.cfg.eval_steps):
                out = self.eval_step(state, device_batch(next(batches), self.batch_shardings), *self.step_args)
                for key, value in out.items():
                    sums[key] = sums.get(key, 0.0) + float(value)
        finally:
            batches.close()
        result = {"loss": sums["loss_sum"] / max(sums["tokens"], 1.0)}
        result.update({key: value / max(sums["tokens"], 1.0) for key, value in sums.items() if key.startswith("dpo/")})
        if "mtp_accepted" in sums:
            result["mtp_acceptance"] = sums["mtp_accepted"] / max(sums["mtp_predictions"], 1.0)
        return result

    def run(self) -> TrainResult:
        """Train as the run directory's one writer (``train.run_dir``). A start that fails before
        the run's ``config.yml`` is written removes the directory it created (nothing else). A
        disk that refuses a write (full, read-only) is one line."""
        refuse_links(self.run_dir)  # every write stays under base_output_directory
        self.changes = _check_same_model(self.run_dir, self.cfg)  # before anything is written
        created = not self.run_dir.exists()
        make_run_dir(self.run_dir)
        lock = RunLock(self.run_dir)
        try:
            lock.acquire()
            if lock.previous:
                self.notes.append(f"run lock taken over from {lock.previous}, which ended without releasing it")
            try:
                return self._run()
            except OSError as err:
                if err.errno not in DISK_ERRORS:
                    raise
                raise RunDirError(
                    f"cannot write '{err.filename or self.run_dir}' ({disk_error(err)}); free space or fix the "
                    "permissions of that disk, or choose another base_output_directory"
                ) from None
        except BaseException:
            lock.release()
            if created and not (self.run_dir / "config.yml").exists():
                remove_unused_run_dir(self.run_dir)
            raise
        finally:
            lock.release()

    def _run(self) -> TrainResult:
        cfg = self.cfg
        changes = self.changes
        if changes:
            self.notes.append("changed since the run's config.yml: " + "; ".join(changes))
        stop_if_interrupted()  # a Ctrl-C during start-up whose exception a library swallowed
        ckpt = Checkpointer(self.run_dir / "checkpoints", cfg.max_num_checkpoints_to_keep) if cfg.enable_checkpointing else None
        if ckpt is not None:
            ckpt.check_writable()
        weights = self.read_weights() if cfg.lora_rank else None  # read once: the frozen base and the state
        state, start, data_state = self.initial_state(ckpt, weights)
        if cfg.lora_rank or cfg.use_dpo:  # the steps' extra argument
            frozen = self.lora_base(weights) if cfg.lora_rank else None
            reference = self.dpo_reference(state, start, weights) if cfg.use_dpo else None
            self.step_args = (Extras(frozen, reference),)
        stored = self.run_dir / "config.yml"  # a resume whose schedule moved says so (train/schedules.py)
        note = schedule_change_note(yaml.safe_load(stored.read_text()), cfg, self.derived, start) if stored.is_file() else None
        if note:
            self.notes.append(note)
        stop_if_interrupted()
        if jax.process_index() == 0 and not (self.run_dir / "config.yml").exists():  # the inputs are valid: record the run
            keep_tokenizer(cfg, self.run_dir / RUN_TOKENIZER_DIR)  # its files, with the chat template the run uses
            _write_atomically(self.run_dir / "config.yml", run_config_to_yaml(cfg))  # whole or absent
        if ckpt is None and not self.restart:
            _check_no_history(self.run_dir)
        batches = self._data(self.train_source)
        if data_state is not None:
            batches.set_state(data_state)
        result = TrainResult(self.run_dir, start, start)
        peak, peak_source = peak_flops_total(cfg)
        writer = MetricsWriter(self.run_dir, cfg, start) if jax.process_index() == 0 else None
        try:
            silent = jax.process_index() != 0
            with ProgressBar(cfg.steps, start, self.progress_enabled, silent=silent) as bar, StopRequests() as stops:
                bar.log(f"run {self.run_dir} | {'resumed at step ' + str(start) if start else 'new run'} | "
                        f"mesh {self.derived.mesh_shape} | global batch {self.derived.global_batch_size} x {cfg.max_target_length}")  # fmt: skip
                for note in self.notes:
                    bar.log(note)
                for line in pipeline_summary(cfg):  # the layout over the stages, and how it was chosen
                    bar.log(line)
                bar.log(self.train_source.describe())
                bar.log(f"parameters unsharded over model axes: {100 * self.setup.unsharded_fraction:.3f}% "
                        f"(sharding_tolerance {100 * cfg.sharding_tolerance:g}%)")  # fmt: skip
                bar.log(f"peak {peak / 1e12:.3f} TFLOP/s from {peak_source}")
                bar.log(f"attention: {attention_in_use(cfg)} (attention={cfg.attention}; docs/attention.md)")
                bar.log(_cache_line(cfg, self.compilation_cache))
                if cfg.use_qwix_quantization:
                    bar.log(summary(cfg))
                recorder = _Recorder(self, peak, writer, bar, result, start)
                for step in range(start, cfg.steps):
                    batch = device_batch(_next_batch(batches, step, cfg), self.batch_shardings)
                    state, metrics = self.train_step(state, batch, *self.step_args)
                    done = result.end_step = step + 1
                    recorder.submit(done, metrics)  # records the previous step while this one runs
                    stop = stops.stop_after(done)  # a SIGTERM / SIGINT: this step is the last, and it is saved
                    if (
                        cfg.eval_interval > 0
                        and self.eval_source is not None
                        and (done % cfg.eval_interval == 0 or done == cfg.steps)
                    ):
                        recorder.flush()
                        evaluation = self.evaluate(state)
                        result.eval_losses[done] = evaluation["loss"]
                        line = f"step {done}: eval loss {evaluation['loss']:.4f}"
                        if "mtp_acceptance" in evaluation:
                            result.eval_mtp_acceptance[done] = evaluation["mtp_acceptance"]
                            line += f" | MTP acceptance {100 * evaluation['mtp_acceptance']:.1f}%"
                        bar.log(line)
                        if writer:
                            writer.write({"step": done, **{f"eval_{k}": v for k, v in evaluation.items()}})
                        recorder.restart_clock()
                    if ckpt is not None and (done % cfg.checkpoint_period == 0 or done == cfg.steps or stop):
                        recorder.flush()  # the guard sees this step first, and the log holds every saved step
                        if writer:
                            writer.flush()
                        recorder.last_checkpoint = done
                        data_states = all_process_states(batches.get_state())
                        ckpt.save(
                            done,
                            state,
                            {
                                "data_position": done,
                                "data_state": data_states,
                                "config": cfg.model_dump(mode="json"),
                                "model": fingerprint(cfg),
                            },
                        )
                    if stop:
                        result.stopped_by = stops.signal
                        bar.log(_stopped_line(stops.signal, done, ckpt is not None))
                        break
                recorder.flush()
                if writer:
                    writer.flush()
                data_state = batches.get_state()
                skipped = data_state.get("counts", {}).get("bad_records", 0)
                if skipped:
                    bar.log(f"data: skipped {skipped:,} bad records so far (skip_bad_records=true); the first: "
                            f"{data_state.get('first_problem')}")  # fmt: skip
        except LogWriteError as err:  # the disk filled between checkpoints: say which are kept
            raise LogWriteError(f"{err} ({_kept(ckpt)})") from None
        finally:  # also on an error: a save in flight is completed, never left half-written
            batches.close()
            if ckpt is not None:
                ckpt.wait()
        if writer:
            writer.close()
        result.state = state
        result.frozen = self.step_args[0].frozen if cfg.lora_rank else None
        return result


DISK_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG, errno.EIO)  # a write the disk refused


def _write_atomically(path: Path, text: str) -> None:
    """Write ``path`` through a temporary file renamed over it: never a half-written file."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _kept(ckpt: Checkpointer | None) -> str:
    """Which checkpoints a stopped run leaves (after the save in flight, if any, completes)."""
    if ckpt is None:
        return "enable_checkpointing=false: no checkpoints"
    ckpt.wait()
    steps = ckpt.steps()
    return f"checkpoints up to step {steps[0]} are kept" if steps else "no checkpoint was written"


def _stopped_line(signum: int, step: int, saved: bool) -> str:
    name = signal.Signals(signum).name
    if saved:
        return f"{name}: stopped after step {step} and saved checkpoint {step}; run the same command to resume"
    return f"{name}: stopped after step {step} (enable_checkpointing=false: nothing saved, a new run starts again at 0)"


def _cache_line(cfg: Config, directory: str | None) -> str:
    """The start-up line saying where compiled steps are stored (or that they are not)."""
    if directory is None:
        return "compilation cache: off (compilation_cache_dir is empty)"
    return f"compilation cache: {directory} (compiles of {cfg.compilation_cache_min_compile_seconds:g} s or more are kept)"


def _next_batch(batches: DataIterator, step: int, cfg: Config) -> dict:
    try:
        return next(batches)
    except StopIteration:
        raise DataError(
            f"the training data ran out at step {step} after data_num_epochs={cfg.data_num_epochs} epochs; "
            "raise data_num_epochs (-1 = endless) or lower steps"
        ) from None


def all_process_states(state: dict) -> list[dict]:
    """Every process's data-iterator state, in process order, on every process."""
    if jax.process_count() == 1:
        return [state]
    from jax.experimental import multihost_utils

    payload = np.frombuffer(json.dumps(state).encode("utf-8"), dtype=np.uint8)
    sizes = multihost_utils.process_allgather(np.array([payload.size], dtype=np.int64))
    padded = np.zeros(int(sizes.max()), dtype=np.uint8)
    padded[: payload.size] = payload
    gathered = multihost_utils.process_allgather(padded)
    return [json.loads(bytes(row[: int(n)]).decode("utf-8")) for row, n in zip(gathered, sizes.ravel())]


def _process_data_state(meta: dict, where: Path) -> dict:
    states = meta.get("data_state")
    if not isinstance(states, list) or not states:
        raise CheckpointError(f"checkpoint '{where}' holds no data-iterator state; resume it with the nnxtron that wrote it")
    if len(states) != jax.process_count():
        raise CheckpointError(
            f"checkpoint '{where}' was written by {len(states)} processes but this run has {jax.process_count()}; "
            f"resume with {len(states)} processes (each one continues its own share of the data)"
        )
    return states[jax.process_index()]


class _Recorder:
    """Turns step metrics into records one step late, so reading them never stalls dispatch."""

    def __init__(
        self, trainer: Trainer, peak: float, writer: MetricsWriter | None, bar: ProgressBar, result: TrainResult, start: int
    ):
        self.cfg, self.tokens_per_step = trainer.cfg, trainer.derived.tokens_per_step
        self.flops_per_step = training_flops_per_token(trainer.cfg) * self.tokens_per_step
        self.peak, self.writer, self.bar, self.result = peak, writer, bar, result
        self.pending: tuple[int, dict] | None = None
        self.last_time = time.perf_counter()
        self.leaf_names = list(flatten_with_treedef(trainer.setup.abstract_state["params"])[0])
        self.last_checkpoint = start  # the newest step saved or resumed from (for the non-finite report)

    def submit(self, step: int, metrics: dict) -> None:
        self.flush()
        self.pending = (step, metrics)

    def restart_clock(self) -> None:
        self.last_time = time.perf_counter()

    def _guard(self, step: int, values: dict[str, float]) -> None:
        """Stop (``non_finite_policy=stop``) or report a skipped update on a NaN/Inf step."""
        leaf, loss = int(values.pop("non_finite_leaf")), values["loss"]
        if not values["skipped"]:
            return
        if values["non_finite_state"]:
            what = f"step {step}: the update made the parameters or optimizer state non-finite (loss {loss} and gradients were finite)"
        else:
            where = self.leaf_names[leaf] if 0 <= leaf < len(self.leaf_names) else "none (only the loss)"
            what = f"step {step}: the loss ({loss}) or a gradient is not finite (first parameter with one: {where})"
        if self.cfg.non_finite_policy == "skip":
            self.result.skipped_steps.append(step)
            self.bar.log(f"{what}; update skipped (non_finite_policy=skip)")
            return
        last = f"step {self.last_checkpoint}" if self.last_checkpoint else "none written"
        raise TrainingError(
            f"{what}; stopped without saving it (last checkpoint: {last}). Lower learning_rate, set "
            "gradient_clipping_threshold, or set non_finite_policy=skip to drop such updates"
        )

    def flush(self) -> None:
        if self.pending is None:
            return
        step, metrics = self.pending
        self.pending = None
        values = {k: float(v) for k, v in metrics.items()}  # blocks until that step finished
        self._guard(step, values)
        now = time.perf_counter()
        seconds = max(now - self.last_time, 1e-9)
        self.last_time = now
        tflops = self.flops_per_step / seconds / 1e12
        record = {
            "step": step,
            **values,
            "step_seconds": seconds,
            "tokens_per_s": self.tokens_per_step / seconds,
            "tflops": tflops,
            "mfu": tflops * 1e12 / self.peak,
        }
        self.result.losses.append(values["loss"])
        if self.writer:
            self.writer.write(record)
            if step % self.cfg.log_period == 0:
                self.writer.flush()
        self.bar.update(step, record)
        if not self.bar.enabled and (step % self.cfg.log_period == 0 or step == self.cfg.steps):
            aux = "".join(f" | {k[4:]} {v:.4f}" for k, v in values.items() if k.startswith("aux/"))
            self.bar.log(
                f"step {step}: loss {record['loss']:.4f}{aux} | {record['tokens_per_s']:,.0f} tok/s | "
                f"{tflops:.4f} TFLOP/s | MFU {100 * record['mfu']:.1f}%"
            )


def train(
    cfg: Config,
    *,
    progress: bool | None = None,
    restart: bool = False,
    init_params: ParamsLoader | None = None,
    notes: Sequence[str] = (),
) -> TrainResult:
    """``notes``: start-up lines from loading the config (MaxText keys ignored ...)."""
    trainer = Trainer(cfg, progress=progress, restart=restart, init_params=init_params)
    trainer.notes.extend(notes)
    return trainer.run()
