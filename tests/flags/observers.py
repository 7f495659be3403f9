"""Observers of the flag-sensitivity matrix (``tests/unit/test_flag_sensitivity.py``).

An observer maps a config, given as override values (``model_name`` included), to what a
user of that config would see: the traced program of the train step, the batches, the
files a training run writes, the sampler's choices ... Two configs that differ in one key
must give different observations unless that key is in ``nnxtron.config.inert.INERT``.
Observations are plain values (text, tuples, bytes) compared with ``==``; each observer is
the cheapest real reader of its keys (tracing rather than running wherever tracing sees
the key). Baselines are cached per (observer, overrides).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import hashlib
import io
import json
import re
import shutil
import sys
import tempfile
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from nnxtron.config import load_config
from nnxtron.errors import DataError, UserError
from nnxtron.params import flatten
from tests.conftest import setup_train_state, sub_jaxprs, trace_train_step

Overrides = tuple[tuple[str, Any], ...]  # sorted (key, value) pairs: hashable, so baselines are cached
TRACE_DEVICES = 4  # the train/eval steps are lowered over this many fake devices
WORK = Path(tempfile.mkdtemp(prefix="nnxtron-flags-"))  # corpora, tokenizers and run directories of this process
atexit.register(shutil.rmtree, WORK, ignore_errors=True)
PARAGRAPH = "The quick brown fox jumps over the lazy dog. A stitch in time saves nine. All that glitters is not gold.\n"


def frozen(values: dict[str, Any]) -> Overrides:
    return tuple(sorted(values.items()))


def _config(values: Overrides):
    return load_config(values=dict(values))


def _digest(*arrays: Any) -> str:
    h = hashlib.sha256()
    for a in arrays:
        a = np.asarray(a)
        h.update(f"{a.dtype}{a.shape}".encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


# --------------------------------------------------------------------------- fixtures on disk


@functools.cache
def corpus() -> dict[str, str]:
    """Globs of small fixed corpora: ``text`` (6 files), ``text_a`` (3 of them), ``jsonl``
    (records with a ``text`` and a ``body`` field), ``jsonl_bad`` (one record without text),
    ``sft`` (records with a ``text`` and chat ``messages``) and four chat templates for it (``template_big``
    allocates 50 MB while it renders, ``template_slow`` takes ~20 ms)."""
    root = WORK / "corpus"
    (root / "text").mkdir(parents=True)
    words = PARAGRAPH.split()
    rng = np.random.default_rng(0)
    texts = [" ".join(rng.choice(words, size=60 + 25 * i)) + "\n" for i in range(6)]  # each document its own text
    for i, text in enumerate(texts):
        (root / "text" / f"doc{i}.txt").write_text(text)
    records = [{"text": text, "body": text.upper()[::-1]} for text in texts]
    (root / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (root / "bad.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + '{"text": null}\n')
    chats = [
        {"text": text, "messages": [{"role": "user", "content": text[:40]}, {"role": "assistant", "content": text[40:90]}]}
        for text in texts
    ]
    (root / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chats))
    pairs = [{"text": text, "prompt": text[:40], "chosen": text[40:90], "rejected": text[90:120]} for text in texts]
    (root / "dpo.jsonl").write_text("".join(json.dumps(r) + "\n" for r in pairs))
    turn = "{% for m in messages %}<{{ m['role'] }}>{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}</s>{% endgeneration %}{% else %}{{ m['content'] }}{% endif %}\n{% endfor %}"
    (root / "chat.jinja").write_text(turn)
    (root / "chat_b.jinja").write_text(turn.replace("<{{ m['role'] }}>", "### {{ m['role'] }}: "))
    (root / "chat_big.jinja").write_text("{% set pad = 'x' * 50000000 %}" + turn)  # holds 50 MB while it renders
    slow = "{% for i in range(1000) %}{% for j in range(800) %}{% endfor %}{% endfor %}"  # ~20 ms a rendering
    (root / "chat_slow.jinja").write_text(slow + turn)
    return {
        "text": str(root / "text" / "*.txt"),
        "text_a": str(root / "text" / "doc[0-2].txt"),
        "text_b": str(root / "text" / "doc[3-5].txt"),
        "jsonl": str(root / "a.jsonl"),
        "jsonl_bad": str(root / "bad.jsonl"),
        "sft": str(root / "sft.jsonl"),
        "dpo": str(root / "dpo.jsonl"),
        "template": str(root / "chat.jinja"),
        "template_b": str(root / "chat_b.jinja"),
        "template_big": str(root / "chat_big.jinja"),
        "template_slow": str(root / "chat_slow.jinja"),
    }


@functools.cache
def tokenizers() -> dict[str, str]:
    """Two different byte-level BPE ``tokenizer.json`` directories (``bpe_a``, ``bpe_b``)."""
    from tests.tokenizer_files import write_bpe

    text = [PARAGRAPH * 5]
    return {
        "bpe_a": str(write_bpe(WORK / "bpe_a", text, vocab_size=290)),
        "bpe_b": str(write_bpe(WORK / "bpe_b", [PARAGRAPH.upper() * 5], vocab_size=300)),
    }


# --------------------------------------------------------------------------- traced programs


def program_text(model_setup: Any, traced: Any) -> str:
    """The traced program as text: its jaxpr (every primitive, shape, sharding constraint,
    memory kind and hyperparameter literal; names are given per print, so the text does not
    depend on what the process traced before — lowered StableHLO does, through JAX's
    process-wide numbering of helper functions) and the shardings of the state it reads."""
    shardings = "\n".join(f"{path}: {sharding}" for path, sharding in sorted(flatten(model_setup.state_shardings).items()))
    return f"{traced.jaxpr}\n{shardings}\n{_constants(traced.jaxpr)}"


def _constants(closed: Any) -> str:
    """Digests of the constant arrays a jaxpr closes over, at any depth (RoPE tables and
    other numpy-computed values, which the jaxpr prints by name only)."""
    found = []

    def walk(jaxpr: Any) -> None:
        found.extend(_digest(np.asarray(c)) for c in getattr(jaxpr, "consts", ()) if hasattr(c, "shape"))
        for eqn in getattr(getattr(jaxpr, "jaxpr", jaxpr), "eqns", ()):
            for sub in sub_jaxprs(eqn):
                walk(sub)

    walk(closed)
    return " ".join(found)


def train_step(values: Overrides) -> str:
    """The real train step traced on abstract sharded state."""
    return program_text(*trace_train_step(_config(values), TRACE_DEVICES))


def eval_step(values: Overrides) -> str:
    """The eval step (the model's forward and its loss: no gradient, no optimizer) traced on
    abstract sharded state: the observer of the keys that shape the model, at about a third of
    the train step's tracing."""
    from nnxtron.tools.plan import abstract_step_inputs
    from nnxtron.train.step import make_eval_step

    cfg = _config(values)
    model_setup, _, _, derived = setup_train_state(cfg, TRACE_DEVICES)
    traced = make_eval_step(cfg, model_setup).trace(*abstract_step_inputs(cfg, model_setup, derived))
    return program_text(model_setup, traced)


def setup(values: Overrides) -> tuple:
    """Whether ``train.state.setup`` accepts the config's parameter shardings (and the
    fraction it leaves unsharded), or the error it refuses them with."""
    try:
        model_setup, _ = trace_train_step(_config(values), TRACE_DEVICES)
    except UserError as err:
        return ("refused", type(err).__name__)
    return ("accepted", round(model_setup.unsharded_fraction, 6))


def init(values: Overrides) -> str:
    """The initial parameter values (a digest)."""
    from nnxtron.models.build import build_model

    params = nnx.state(build_model(_config(values)), nnx.Param)
    return _digest(*jax.tree.leaves(params))


# --------------------------------------------------------------------------- data


def data(values: Overrides) -> tuple:
    """The first train and eval batches, when the train data ends (up to 100 batches), the
    start-up statistics and the reader / prefetch threads configured; or the DataError (or the
    chat template's time limit, which stops the data: ``TemplateTimeout``)."""
    from nnxtron.data.sources import make_sources
    from nnxtron.data.template_render import TemplateTimeout

    cfg = _config(values)
    try:
        train, evaluation = make_sources(cfg, 4)
    except (DataError, TemplateTimeout) as err:
        return ("refused", str(err).split(";")[0])
    it = train.iterator()
    try:
        threads = _threads(it)
        batches = []
        for i in range(100):
            try:
                batch = next(it)
            except StopIteration:
                batches.append(("ended", i))
                break
            if i < 3:
                batches.append(_digest(*(batch[k] for k in sorted(batch))))
    finally:
        it.close()
    evals = []
    if evaluation is not None:
        ev = evaluation.iterator()
        try:
            evals = [_digest(*(b[k] for k in sorted(b))) for b in (next(ev), next(ev))]
        finally:
            ev.close()
    stats = {k: v for k, v in train.stats().items() if k != "first_problem"}
    return tuple(batches), tuple(evals), tuple(sorted(stats.items())), threads


def _threads(it: Any) -> tuple:
    """(prefetched batches, document reader threads) of a corpus iterator (grain's settings)."""
    ahead = getattr(it, "ahead", None)
    packer = getattr(getattr(it, "batches", None), "packer", None)
    docs = getattr(packer, "documents", None)
    read = getattr(getattr(docs, "_read_options", None), "num_threads", None)
    return (getattr(ahead, "_target_prefetch_buffer_size", None), read)


# --------------------------------------------------------------------------- runs and their files


def run_dir(values: Overrides) -> str:
    """The run directory a run of the config writes to (digits masked: a fresh name is timestamped)."""
    from nnxtron.train.run_dir import resolve_run_dir

    return re.sub(r"\d", "0", str(resolve_run_dir(_config(values))))


def compile_cache(values: Overrides) -> tuple:
    """What ``enable_compilation_cache`` points JAX at (directory, minimum compile time); JAX's
    settings are put back afterwards."""
    from nnxtron.runtime.compile_cache import enable_compilation_cache

    with _jax_cache_settings():
        directory = enable_compilation_cache(_config(values))
        return directory, jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs


def peak(values: Overrides) -> tuple:
    """The peak FLOP/s MFU is measured against, and its source."""
    from nnxtron.runtime.peak import peak_flops_per_device

    return peak_flops_per_device(_config(values))


def metrics_writer(values: Overrides) -> tuple:
    """The sinks a run's ``MetricsWriter`` opens: TensorBoard, and the arguments of
    ``wandb.setup`` / ``wandb.init`` (a stand-in ``wandb`` module records them; the logged
    config dict and the run id are left out)."""
    from nnxtron.train.metrics import MetricsWriter

    calls: list = []
    fake = types.ModuleType("wandb")
    fake.Error = RuntimeError
    fake.Settings = lambda **kw: kw
    fake.setup = lambda settings=None: calls.append(("setup", tuple(sorted(settings.items()))))

    def fake_init(**kw):
        kw = {k: v for k, v in kw.items() if k not in ("config", "id", "dir")}
        calls.append(("init", tuple(sorted(kw.items()))))
        return types.SimpleNamespace(log=lambda *a, **k: None, finish=lambda: None)

    fake.init = fake_init
    cfg = _config(values)
    directory = Path(tempfile.mkdtemp(dir=WORK)) / "run"
    directory.mkdir()
    saved = sys.modules.get("wandb")
    sys.modules["wandb"] = fake
    try:
        writer = MetricsWriter(directory, cfg)
        writer.write({"step": 1, "loss": 1.0})
        writer.close()
    finally:
        if saved is None:
            sys.modules.pop("wandb", None)
        else:
            sys.modules["wandb"] = saved
    return _files(directory), tuple(calls)


def _files(directory: Path) -> tuple[str, ...]:
    """The files under ``directory`` (relative; TensorBoard's host- and time-stamped names masked)."""
    names = {re.sub(r"events\.out\.tfevents\..*", "events", str(p.relative_to(directory))) for p in directory.rglob("*")}
    return tuple(sorted(n for n in names if (directory / n).is_file() or n.endswith("events")))


def _cli(*args: str) -> str:
    """``nnxtron ARGS`` in this process; its standard output (a non-zero exit is an error)."""
    from nnxtron.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(list(args))
    assert code == 0, out.getvalue()
    return out.getvalue()


def _cli_values(values: Overrides) -> list[str]:
    """``key=value`` arguments (text as it is, lists and booleans as YAML reads them)."""
    return [f"{k}={v if isinstance(v, str) else json.dumps(list(v) if isinstance(v, tuple) else v)}" for k, v in values]


@contextlib.contextmanager
def _jax_cache_settings():
    """Put JAX's compilation-cache settings back as they were (a run points JAX at its cache)."""
    from nnxtron.runtime.compile_cache import _point_jax_at

    before = (jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs)
    try:
        yield
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", before[1])
        _point_jax_at(before[0])


_TRAINED: dict[Overrides, tuple[Path, str]] = {}
_RETRAIN = False  # set by ``retraining``


@contextlib.contextmanager
def retraining():
    """Inside: ``run`` trains its config again even where this process trained the same config
    before (another case's variant or reference): the reads a case records must not depend on
    which case the scheduler gave this worker first (a cached run executes none of them)."""
    global _RETRAIN
    _RETRAIN = True
    try:
        yield
    finally:
        _RETRAIN = False


def _train(values: Overrides, again: bool = False) -> tuple[Path, str]:
    """``nnxtron train`` of the config into a fresh directory: (run directory, its output),
    cached per config unless ``again``. The runs share one compilation cache (their steps are
    mostly the same programs)."""
    if again or values not in _TRAINED:
        _TRAINED[values] = _train_now(values)
    return _TRAINED[values]


def _train_now(values: Overrides) -> tuple[Path, str]:
    if dict(values).get("init_from"):  # init_from brings the model: model_name is refused with it
        values = tuple((k, v) for k, v in values if k != "model_name")
    base = Path(tempfile.mkdtemp(dir=WORK))
    cache = ("compilation_cache_dir", str(WORK / "run-cache")), ("compilation_cache_min_compile_seconds", 0)
    args = _cli_values(cache + values)
    with _jax_cache_settings():
        out = _cli("train", *args, f"base_output_directory={base}", "run_name=run", "--no-progress")
    return base / "run", out


def run(values: Overrides) -> tuple:
    """What ``nnxtron train`` leaves and says: the files of the run directory, the metrics
    records (steps, names, losses), the checkpoints kept, the steps it printed and its sample."""
    directory, out = _train(values, again=_RETRAIN)
    files = _files(directory)
    checkpoints = sorted(p.name for p in (directory / "checkpoints").iterdir()) if (directory / "checkpoints").is_dir() else []
    records = []
    for line in (directory / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        losses = {k: round(v, 4) for k, v in record.items() if "loss" in k}
        records.append((record["step"], tuple(sorted(record)), tuple(sorted(losses.items()))))
    printed = [line.split(":")[0] for line in out.splitlines() if line.startswith("step ")]
    sample = out.split("--- sample", 1)[1] if "--- sample" in out else None
    return files, tuple(checkpoints), tuple(records), tuple(printed), sample


def run_outcome(values: Overrides) -> tuple:
    """``run``'s observation, or ``("failed",)`` where ``nnxtron train`` exits non-zero (a run
    stopped by a non-finite loss)."""
    try:
        return ("ran", *run(values))
    except AssertionError:
        return ("failed",)


def baseline_run(values: Overrides) -> str:
    """The run directory of ``nnxtron train`` with ``values`` (cached: a checkpoint to load from)."""
    return str(_train(values)[0])


GENERATE_KEYS = ("prompt", "max_new_tokens")  # given to `generate`; the other values train its run


def generate(values: Overrides) -> tuple:
    """``nnxtron generate --json`` with the ``GENERATE_KEYS`` of ``values`` on the run directory
    that ``nnxtron train`` with the other values wrote: the prompt and the tokens sampled."""
    run_values = tuple((k, v) for k, v in values if k not in GENERATE_KEYS)
    overrides = tuple((k, v) for k, v in values if k in GENERATE_KEYS)
    out = _cli("generate", baseline_run(run_values), *_cli_values(overrides), "--json")
    record = json.loads(out.strip().splitlines()[-1])
    return record["prompt"], tuple(record["tokens"])


def sample(values: Overrides) -> tuple:
    """What the CLI's sampler (``cli._sample``: tokenizer, prompt, limits, KV-cached decoding)
    gives a freshly initialised model of the config for 6 new tokens: the prompt and the
    tokens, or the UserError that refuses them."""
    from nnxtron.cli import _sample
    from nnxtron.models.build import build_model

    cfg = _config(values)
    try:
        text, stream = _sample(build_model(cfg), cfg, 6)
        return tuple(stream), text.text()
    except UserError as err:
        return ("refused", type(err).__name__)


def lm_eval(values: Overrides) -> tuple:
    """The log-likelihoods (and greedy flags) the lm-eval adapter (``infer.harness.NnxtronLM``,
    ``nnxtron eval --tasks``) gives two requests on a freshly initialised model of the config."""
    from nnxtron.infer.harness import NnxtronLM
    from nnxtron.models.build import build_model

    adapter = NnxtronLM(build_model(_config(values)), batch_size=2)
    requests = [
        types.SimpleNamespace(args=(PARAGRAPH[:60], PARAGRAPH[60:70])),
        types.SimpleNamespace(args=("A stitch", " in time")),
    ]
    return tuple((round(logprob, 5), greedy) for logprob, greedy in adapter.loglikelihood(requests))


def sample_chat(values: Overrides) -> tuple:
    """``sample``'s observation with the corpus's chat template (``nnxtron generate --chat``:
    the prompt as one user message rendered with the generation prompt)."""
    from nnxtron.cli import _sample
    from nnxtron.data.chat_template import ChatTemplate
    from nnxtron.models.build import build_model

    cfg = _config(values)
    text, stream = _sample(build_model(cfg), cfg, 6, ChatTemplate(Path(corpus()["template"]).read_text()))
    return tuple(stream), text.text()


def serve_engine(values: Overrides) -> tuple:
    """The context length of the engine ``nnxtron serve`` builds for the config (its default options)."""
    from nnxtron.models.build import build_model
    from nnxtron.serve.server import ServeOptions, make_engine

    return (make_engine(build_model(_config(values)), ServeOptions(max_sequences=2)).max_length,)


def score(values: Overrides) -> tuple:
    """What ``nnxtron eval`` scores of the config's corpus with a freshly initialised model,
    holding out what a run trained with the config held out (``infer.score``): documents,
    bad records, tokens, total NLL and bytes — or the UserError that refuses it."""
    from nnxtron.infer.score import held_out_by_training, score_corpus
    from nnxtron.models.build import build_model

    cfg = _config(values)
    try:
        totals = score_corpus(build_model(cfg), cfg, 4, held_out_by_training(cfg))
    except UserError as err:
        return ("refused", type(err).__name__)
    return totals.documents, totals.bad_records, totals.tokens, round(totals.nll, 3), totals.bytes


def sampler(values: Overrides) -> tuple:
    """The token ids the configured sampler (``infer.decode.sampler``) picks from fixed logits
    (64 rows over 256 ids, three steps: each step draws a fresh key)."""
    from nnxtron.infer.decode import sampler as make_sampler

    choose = make_sampler(_config(values))
    logits = np.random.default_rng(0).normal(size=(64, 256)).astype(np.float32) * 3
    return tuple(tuple(int(t) for t in choose(logits)) for _ in range(3))


OBSERVERS: dict[str, Callable[..., Any]] = {
    "train_step": train_step,
    "eval_step": eval_step,
    "setup": setup,
    "init": init,
    "data": data,
    "run_dir": run_dir,
    "compile_cache": compile_cache,
    "peak": peak,
    "metrics_writer": metrics_writer,
    "run": run,
    "generate": generate,
    "sampler": sampler,
    "score": score,
    "sample_chat": sample_chat,
    "lm_eval": lm_eval,
    "serve_engine": serve_engine,
    "run_outcome": run_outcome,
    "sample": sample,
}
