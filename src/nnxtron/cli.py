"""The ``nnxtron`` command: train | generate | serve | convert | config | bench | plan.

Every subcommand takes an optional YAML file and ``key=value`` overrides. Bad input
(config, data, checkpoint, command line) is reported as one line on stderr with exit
status 2 and no traceback.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import select
import sys
from collections.abc import Sequence
from pathlib import Path

from nnxtron.errors import CheckpointError, ConfigError, UserError
from nnxtron.runtime import interrupt
from nnxtron.runtime.distributed import INIT_TIMEOUT_S, PEER_TIMEOUT_S

EXIT_USER_ERROR = 2
EXIT_BROKEN_PIPE = 128 + 13  # as a shell reports a process that SIGPIPE ended (the reader of stdout left)
MAX_PLAN_DEVICES = 2048  # measured: 27 s / 3 GB for llama3.1-8b; 4096 fake CPU devices fail inside XLA


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2 (argparse prints usage + message)
        raise UserError(f"{self.prog}: {message} (see `{self.prog} --help`)")

    def add_argument(self, *names, **kwargs):
        """A positional ``nargs="*"`` (``[key=value ...]``) is optional: before Python 3.13
        argparse marks one without a default required ("the following arguments are required:
        path, overrides")."""
        if kwargs.get("nargs") == "*" and names and not names[0].startswith("-"):
            kwargs.setdefault("default", [])
        return super().add_argument(*names, **kwargs)


MAX_SEARCH_WORKERS = os.cpu_count() or 1  # plan --search: one compile process per core at most


def _number(kind: type[int] | type[float], *, at_least: float = -math.inf, above: float = -math.inf,
            at_most: float = math.inf, why: str = ""):  # fmt: skip
    """An argparse ``type``: a finite ``kind`` (``int`` or ``float``) ``>= at_least``, ``> above`` and
    ``<= at_most``; anything else is argparse's one error line naming the option, the range and
    ``why`` the bound is there."""
    noun = "an integer" if kind is int else "a number"
    bounds = [f">= {at_least}" if at_least > -math.inf else "", f"> {above}" if above > -math.inf else "",
              f"<= {at_most}" if at_most < math.inf else ""]  # fmt: skip
    wanted = f"{noun} {' and '.join(b for b in bounds if b)}".strip()

    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not math.isfinite(value) or not (at_least <= value <= at_most and value > above):
            raise argparse.ArgumentTypeError(f"must be {wanted}{why}, got {text!r}")
        return value

    return parse


def _split_file_and_overrides(args: Sequence[str]) -> tuple[str | None, list[str]]:
    """``[FILE] [key=value ...]``: the first argument without '=' is the YAML file."""
    file, overrides = None, []
    for arg in args:
        if "=" in arg:
            overrides.append(arg)
        elif file is None:
            file = arg
        else:
            raise UserError(f"unexpected argument '{arg}': give at most one YAML file, then key=value overrides")
    return file, overrides


def _cmd_config(ns: argparse.Namespace) -> int:
    if ns.action == "readers":
        return _config_readers(ns)
    if ns.json:
        raise UserError("--json is an option of `nnxtron config readers`")
    import jax

    from nnxtron.config import config_to_yaml, derive
    from nnxtron.config.loader import load_config_report

    if ns.inert:  # the keys that change nothing observable (config/inert.py), not a config
        from nnxtron.config.inert import inert_lines

        print("# config keys without effect (nnxtron/config/inert.py; every other key is read: docs/config.md)")
        for line in inert_lines():
            print(line)
        return 0
    cfg, report = load_config_report(*_split_file_and_overrides(ns.args))
    print(config_to_yaml(cfg), end="")
    for line in report.comment_block():
        print(line)
    print("# derived for", jax.device_count(), "device(s):")
    for key, value in derive(cfg, jax.device_count()).as_dict().items():
        print(f"#   {key}: {value}")
    return 0


def _config_readers(ns: argparse.Namespace) -> int:
    """``nnxtron config readers [KEY ...]``: where the package reads each key (tools/read_sites.py)."""
    from nnxtron.tools.read_sites import KEYS, format_sites, read_sites, sites_json

    unknown = [key for key in ns.args if key not in KEYS]
    if unknown or ns.inert:
        import difflib

        close = difflib.get_close_matches(unknown[0], KEYS, n=1) if unknown else []
        hint = f"; did you mean {close[0]}?" if close else "; give config keys (nnxtron config show lists them)"
        raise UserError("--inert is an option of `nnxtron config show`" if ns.inert else f"{unknown[0]}: not a config key{hint}")
    sites = read_sites(ns.args)
    print(sites_json(sites, ns.args) if ns.json else "\n".join(format_sites(sites, ns.args)))
    return 0


def _cmd_train(ns: argparse.Namespace) -> int:
    """``nnxtron train``; a Ctrl-C at any moment of the start-up stops it (``runtime/interrupt.py``).
    Its modules are loaded first, while nothing is done yet: under the ``nnxtron`` command's own
    handling (``nnxtron/__main__.py``) a Ctrl-C during them ends the command at once."""
    from nnxtron.runtime.distributed import check_flags

    check_flags(ns.coordinator_address, ns.num_processes, ns.process_id, ns.distributed, ns.peer_timeout, ns.init_timeout)
    from nnxtron.convert import runs  # noqa: F401 - the heavy modules (JAX, orbax, grain), loaded here: see above
    from nnxtron.train import loop  # noqa: F401

    with interrupt.installed():
        try:
            code = _train_command(ns)
        except BaseException as err:  # after a Ctrl-C, what it cut short (an extension's import, a Rust panic) is no news
            if not isinstance(err, (KeyboardInterrupt, SystemExit)):
                interrupt.stop_if_interrupted()
            raise
        interrupt.stop_if_interrupted()  # one that came during an import (raised after it) or that a library swallowed
        return code


def _train_command(ns: argparse.Namespace) -> int:
    from nnxtron.config.families import check_decodes
    from nnxtron.config.loader import is_hf_directory, load_config_report, parse_overrides, read_config_file
    from nnxtron.convert.hf import check_tokenizer
    from nnxtron.convert.runs import init_config_report, init_params
    from nnxtron.data.sources import tokenizer_for
    from nnxtron.runtime.distributed import initialize, peer_lost, shutdown

    file, overrides = _split_file_and_overrides(ns.args)
    given = {**(read_config_file(file) if file is not None else {}), **parse_overrides(overrides)}
    notes: list[str] = []
    if given.get("init_from"):
        cfg, notes = init_config_report(file, overrides, given)  # with the fine-tuning defaults it applied
    else:
        cfg, report = load_config_report(file, overrides)
        notes = report.startup_lines(cfg)
    sample = cfg.sample_after_training
    if sample:  # said before training, not after it
        if sample >= cfg.max_position_embeddings:
            raise UserError(
                f"sample_after_training={sample} leaves no room for the prompt within "
                f"max_position_embeddings={cfg.max_position_embeddings}; sample fewer tokens"
            )
        try:
            check_decodes(cfg)
            prompt = _prompt_ids(cfg, tokenizer_for(cfg))
            if cfg.init_from and is_hf_directory(cfg.init_from):  # synthetic data: checked here only, for the sample
                check_tokenizer(cfg.init_from, given)
        except (ConfigError, CheckpointError) as err:  # the model's ids are not this tokenizer's: training on ids still works
            notes = [*notes, f"no sample after training: {err} (sample_after_training=0 drops this note)"]
            sample = 0
        else:
            _check_room(prompt, sample, cfg, "sample_after_training")
    interrupt.stop_if_interrupted()  # a Ctrl-C during the imports above (``handle`` raises it once they are done)
    loader = init_params(cfg)
    joined = initialize(ns.coordinator_address, ns.num_processes, ns.process_id, ns.distributed, ns.peer_timeout, ns.init_timeout)
    if not joined:
        return _train_and_report(cfg, ns, loader, sample, notes=notes)
    import jax

    try:
        code = _train_and_report(cfg, ns, loader, sample, quiet=jax.process_index() != 0, notes=notes)
    except jax.errors.JaxRuntimeError as err:  # a collective with a process that is gone
        first = str(err).strip().splitlines()[0][:300] if str(err).strip() else type(err).__name__
        peer_lost(f"a collective with another process failed ({first})")
    shutdown()
    return code


def _train_and_report(
    cfg, ns: argparse.Namespace, init_params, sample: int, quiet: bool = False, notes: Sequence[str] = ()
) -> int:
    """Train; then report the losses and, when ``sample`` > 0, print a sample of that many tokens."""
    import jax

    from nnxtron.train.loop import train

    result = train(cfg, progress=None if not ns.no_progress else False, restart=ns.restart, init_params=init_params, notes=notes)
    status = 128 + result.stopped_by if result.stopped_by else 0  # stopped by a signal, after a checkpoint
    if quiet:  # another process of a multi-host run: process 0 reports
        return status
    first, last = (result.losses[0], result.losses[-1]) if result.losses else (None, None)
    if first is not None:
        print(
            f"trained steps {result.start_step}..{result.end_step}: loss {first:.4f} -> {last:.4f}"
            + (f" (eval {list(result.eval_losses.values())[-1]:.4f})" if result.eval_losses else "")
        )
    print(f"run directory: {result.run_dir}")
    if status:
        return status
    if sample and result.state is not None:
        if jax.process_count() > 1:
            print("no sample: decoding runs in one process; run `nnxtron generate` on the run directory")
        else:
            _print_sample_from_state(cfg, result, sample)
    return 0


def _sample(model, cfg, max_new_tokens: int, template=None):
    """(text stream, token-id iterator) for ``cfg.prompt``: BOS (if the tokenizer has one) +
    prompt, or with a chat ``template`` the prompt as one user message rendered with the
    generation prompt (the template writes its own BOS, as in ``serve``); stop at EOS, decoded
    with the KV cache (``infer.decode``); the stream turns the ids into text as the
    tokenizer's ``decode`` joins prompt and completion."""
    from nnxtron.data.detokenize import TextStream
    from nnxtron.data.sources import tokenizer_for
    from nnxtron.infer.generate import generate

    tokenizer = tokenizer_for(cfg)
    prompt = _prompt_ids(cfg, tokenizer, template)
    _check_room(prompt, max_new_tokens, cfg, "max_new_tokens")  # decode checks too, but only once the stream has begun printing
    stop = (tokenizer.eos_id,) if tokenizer.eos_id >= 0 else ()
    rows = generate(model, [prompt], cfg, max_new_tokens, stop)
    return TextStream(tokenizer, prompt), (step[0] for step in rows if step[0] is not None)


def _prompt_ids(cfg, tokenizer, template=None) -> list[int]:
    """``cfg.prompt`` as token ids: BOS (if the tokenizer has one) + prompt, or with a chat
    ``template`` the prompt as one user message rendered with the generation prompt."""
    if template is not None:
        prompt = tokenizer.encode(template.render([{"role": "user", "content": cfg.prompt}])).tolist()
    else:
        prompt = [tokenizer.bos_id] * (tokenizer.bos_id >= 0) + tokenizer.encode(cfg.prompt).tolist()
    if not prompt:
        raise UserError("the prompt is empty and the tokenizer has no BOS token; pass --prompt TEXT")
    return prompt


def _check_room(prompt: list[int], new_tokens: int, cfg, key: str) -> None:
    """One line when ``prompt`` + ``new_tokens`` (the value of ``key``) exceed ``max_position_embeddings``."""
    if len(prompt) + new_tokens > cfg.max_position_embeddings:
        raise UserError(
            f"prompt ({len(prompt)} tokens) + {key} ({new_tokens}) exceed max_position_embeddings="
            f"{cfg.max_position_embeddings}; shorten the prompt or lower {key}"
        )


def _print_sample_from_state(cfg, result, max_new_tokens: int) -> None:
    import jax

    from nnxtron.convert.runs import model_from_state

    def on_device(tree):  # (parameter_memory_host_offload keeps them on the host)
        return jax.tree.map(lambda x: jax.device_put(x, x.sharding.with_memory_kind("device")), tree)

    frozen = None if result.frozen is None else on_device(result.frozen)
    model = model_from_state(cfg, on_device(result.state["params"]), result.state["rest"], frozen)  # LoRA: merged
    from nnxtron.infer.decode import DegenerateLogits

    text, stream = _sample(model, model.config, max_new_tokens)
    try:
        ids = list(stream)
    except DegenerateLogits as err:  # the training itself finished: say why there is no sample
        print(f"no sample: {err}")
        return
    text.push(ids)
    print(f"--- sample ({cfg.decode_sampling_strategy}, {len(ids)} tokens) ---")
    print(text.text())


def _cmd_generate(ns: argparse.Namespace) -> int:
    from nnxtron.convert.runs import check_text_tokenizer, load_model
    from nnxtron.runtime.compile_cache import enable_compilation_cache

    overrides = list(ns.overrides)
    if ns.prompt is not None:
        overrides.append(f"prompt={ns.prompt}")
    check_text_tokenizer(ns.path, overrides)
    model = load_model(ns.path, overrides)  # an HF directory or a run brings its own tokenizer
    cfg = model.config
    template = None
    if ns.chat:  # the chat template that came with the model
        from nnxtron.data.chat_template import find_chat_template
        from nnxtron.data.sources import tokenizer_directories, tokenizer_for

        template, reason = find_chat_template(tokenizer_directories(cfg, ns.path), tokenizer_for(cfg))
        if template is None:
            raise UserError(f"--chat: '{ns.path}' has no chat template ({reason}); drop --chat to continue the prompt as text")
    enable_compilation_cache(cfg)  # before prefill and the decode step compile
    text, stream = _sample(model, cfg, cfg.max_new_tokens, template)
    if ns.json:
        ids = list(stream)
        text.push(ids)
        print(json.dumps({"prompt": cfg.prompt, "completion": text.completion(), "tokens": ids}))
        return 0
    prompt = text.push()  # the prompt, as the tokenizer writes it back (a chat prints the answer alone)
    sys.stdout.write("" if ns.chat else prompt)
    for token in stream:
        sys.stdout.write(text.push([token]))
        sys.stdout.flush()
    sys.stdout.write(text.finish() + "\n")
    return 0


def _cmd_eval(ns: argparse.Namespace) -> int:
    from nnxtron.config.loader import is_hf_directory, parse_overrides
    from nnxtron.convert.runs import check_text_tokenizer, load_model
    from nnxtron.infer.score import CORPUS_KEYS, held_out_by_training, run_corpus_line, score_corpus
    from nnxtron.runtime.compile_cache import enable_compilation_cache

    given = [
        flag
        for flag, value in (("--include-path", ns.include_path), ("--limit", ns.limit), ("--num-fewshot", ns.num_fewshot))
        if value is not None
    ]
    if given and not ns.tasks:
        raise UserError(f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} read only with --tasks (lm-eval harness tasks)")
    own_corpus = not ns.tasks and not set(CORPUS_KEYS) & set(parse_overrides(ns.overrides))
    if own_corpus and is_hf_directory(ns.path):
        raise UserError(
            f"nnxtron eval {ns.path}: an HF directory has no training corpus to score; give one with dataset_type= and "
            "dataset_path= (or lm-eval harness tasks with --tasks)"
        )
    check_text_tokenizer(ns.path, ns.overrides)
    model = load_model(ns.path, list(ns.overrides))  # the data keys among the overrides choose the corpus
    cfg = model.config
    enable_compilation_cache(cfg)
    if ns.tasks:
        return _harness_tasks(model, ns)
    held_out = own_corpus and held_out_by_training(cfg)  # the run's own corpus: what its training did not see

    def announce(described: str) -> None:
        print(run_corpus_line(cfg, held_out, described), file=sys.stderr, flush=True)

    score = score_corpus(model, cfg, ns.batch_rows, held_out, announce if own_corpus else None)
    if ns.json:
        print(json.dumps(score.as_dict()))
        return 0
    bpb = "" if score.bits_per_byte is None else f", {score.bits_per_byte:.4f} bits per byte ({score.bytes:,} bytes)"
    skipped = f" ({score.bad_records:,} bad records skipped)" if score.bad_records else ""
    scored = "answer tokens" if cfg.use_sft else "tokens"
    print(
        f"{score.documents:,} documents{skipped}, {score.tokens:,} {scored} scored: loss {score.loss:.4f}, "
        f"perplexity {score.perplexity:.4f}{bpb}"
    )
    return 0


def _harness_tasks(model, ns: argparse.Namespace) -> int:
    """``nnxtron eval --tasks``: lm-eval harness tasks on the model (``infer/harness.py``)."""
    from nnxtron.infer.harness import evaluate_tasks

    tasks = [task for task in ns.tasks.split(",") if task]
    results = evaluate_tasks(model, tasks, ns.include_path, ns.limit, ns.num_fewshot, ns.batch_rows)
    if ns.json:
        print(json.dumps(results))
        return 0
    for task, metrics in results.items():
        print(f"{task}: " + ", ".join(f"{metric} {value:.4f}" for metric, value in sorted(metrics.items())))
    return 0


def _cmd_serve(ns: argparse.Namespace) -> int:
    import os

    from nnxtron.serve.server import ServeOptions, serve

    options = ServeOptions(
        host=ns.host, port=ns.port, api_key=ns.api_key if ns.api_key is not None else os.environ.get("NNXTRON_API_KEY") or None,
        model_name=ns.served_model_name, max_length=ns.max_length, max_sequences=ns.max_sequences, block_size=ns.block_size,
        kv_blocks=ns.kv_blocks, prefill_chunk=ns.prefill_chunk, max_queue=ns.max_queue,
        request_timeout=None if ns.request_timeout == 0 else ns.request_timeout, chat_template=ns.chat_template,
        log_level=ns.log_level, max_body_bytes=ns.max_body_bytes, read_timeout=ns.read_timeout,
        max_connections=ns.max_connections, drain_timeout=ns.drain_timeout, template_timeout=ns.chat_template_timeout,
        template_memory_mib=ns.chat_template_memory_mib, template_max_chars=ns.chat_template_max_chars,
    )  # fmt: skip
    serve(ns.path, ns.overrides, options)
    return 0


def _cmd_convert(ns: argparse.Namespace) -> int:
    from nnxtron.config.fingerprint import fingerprint
    from nnxtron.config.loader import parse_overrides, run_config_to_yaml
    from nnxtron.convert import hf
    from nnxtron.convert.runs import check_output_directory, load_model

    for flag, given, reader in (
        ("--adapter-only", ns.adapter_only, "to-hf"),
        ("--overwrite", ns.overwrite, "to-hf"),
        ("--scanned" if ns.scanned else "--unscanned", ns.scanned is not None, "to-maxtext"),
    ):
        if given and ns.direction != reader:
            raise UserError(f"{flag} is read by `convert {reader}`, not by {ns.direction}; drop it")
    if ns.direction in ("to-hf", "to-maxtext"):
        check_output_directory(ns.dest)  # before the model is loaded
    if ns.direction == "to-maxtext":
        from nnxtron.convert.maxtext import export_maxtext

        model = load_model(ns.source, ns.overrides)
        scanned = model.config.scan_layers if ns.scanned is None else ns.scanned
        items = export_maxtext(model, ns.dest, scanned=scanned)
        layout = "scanned" if scanned else "unscanned"
        print(f"wrote MaxText checkpoint ({layout}) to {items} (use: load_parameters_path={items} with MaxText)")
        return 0
    if ns.direction == "to-hf" and ns.adapter_only:
        from nnxtron.convert.lora_adapter import export_adapter

        out = export_adapter(ns.source, ns.dest, ns.overrides, overwrite=ns.overwrite)
        print(f"wrote the LoRA adapters to {out} (PEFT: adapter_model.safetensors, adapter_config.json)")
        return 0
    if ns.direction == "to-hf":
        from nnxtron.config.loader import RUN_TOKENIZER_DIR

        model = load_model(ns.source, ns.overrides)
        kept = Path(ns.source) / RUN_TOKENIZER_DIR  # a run keeps its tokenizer's files and chat template there
        out = hf.to_hf(model, ns.dest, overwrite=ns.overwrite, kept=kept if kept.is_dir() else None)
        cfg = model.config
        tokenizer = f"its {cfg.tokenizer_type} tokenizer" if hf.model_tokenizer(cfg) else "no tokenizer: the model has none"
        print(f"wrote HF checkpoint to {out} ({tokenizer}, generation_config.json)")
        return 0
    import jax
    from flax import nnx

    from nnxtron.config.loader import RUN_TOKENIZER_DIR
    from nnxtron.data.sources import BYTE_MODEL_VOCAB_LIMIT
    from nnxtron.data.tokenizer import make_tokenizer
    from nnxtron.data.tokenizer_files import copy_tokenizer
    from nnxtron.train.checkpoint import Checkpointer
    from nnxtron.train.run_dir import make_run_dir

    dest = Path(ns.dest)
    if (dest / "config.yml").exists() or (dest / "checkpoints").exists():
        raise UserError(f"'{dest}' already holds an nnxtron run; choose an empty output directory")
    if ns.direction == "from-maxtext":
        from nnxtron.convert.maxtext import checkpoint_config, load_maxtext_model

        model = load_maxtext_model(ns.source, checkpoint_config(*_split_file_and_overrides(ns.overrides)))
    else:
        model = hf.from_hf(ns.source, **parse_overrides(ns.overrides))
    cfg = model.config
    tokenizer = make_tokenizer(cfg.tokenizer_type, cfg.tokenizer_path)
    make_run_dir(dest)
    kept = copy_tokenizer(tokenizer, dest / RUN_TOKENIZER_DIR)  # the run carries its tokenizer
    if kept:
        cfg = cfg.model_copy(update={"tokenizer_path": str((dest / RUN_TOKENIZER_DIR).absolute())})
    elif cfg.vocab_size > BYTE_MODEL_VOCAB_LIMIT:
        print(
            f"note: '{ns.source}' holds no tokenizer file (tokenizer.json, tokenizer.model, *.tiktoken); generate and "
            "train need tokenizer_type=... tokenizer_path=... for this model",
            file=sys.stderr,
        )
    (dest / "config.yml").write_text(run_config_to_yaml(cfg))
    ckpt = Checkpointer(dest / "checkpoints", max_to_keep=1)
    meta = {"source": str(Path(ns.source).absolute()), "model": fingerprint(model.config)}
    _, params, rest = nnx.split(model, nnx.Param, ...)  # the model state (router biases, hash tables) travels too
    state = {"params": nnx.to_pure_dict(params), "rest": nnx.to_pure_dict(rest)}
    ckpt.save(0, state if jax.tree.leaves(state["rest"]) else {"params": state["params"]}, meta)
    ckpt.wait()
    print(f"wrote nnxtron checkpoint to {dest} (use: nnxtron generate {dest} | nnxtron train init_from={dest} ...)")
    return 0


def _cmd_bench(ns: argparse.Namespace) -> int:
    from nnxtron.tools.bench import run_bench, run_decode_bench

    if ns.decode and ns.profile:
        raise UserError("--profile traces the train step; it cannot be combined with --decode")
    args = _split_file_and_overrides(ns.args)
    result = run_decode_bench(*args, steps=ns.steps) if ns.decode else run_bench(*args, steps=ns.steps, profile=ns.profile)
    print(json.dumps(result))
    return 0


def _cmd_plan(ns: argparse.Namespace) -> int:
    """Parameter counts, shardings and per-device memory from an AOT compile of the train step.

    ``devices=N`` (a plan argument, not a config key) plans over N fake CPU devices: the
    XLA flag is set before jax starts, or the plan re-runs in a child process when this
    process's jax is already running with other devices.
    """
    import os

    devices, args = None, []
    for arg in ns.args:
        key, _, value = arg.partition("=")
        if key.strip() != "devices":
            args.append(arg)
            continue
        try:
            devices = int(value.strip())
        except ValueError:
            raise UserError(f"devices={value!r} is not an integer; give the number of fake CPU devices, e.g. devices=8") from None
        if devices < 1:
            raise UserError(f"devices={devices} must be at least 1")
        if devices > MAX_PLAN_DEVICES:
            raise UserError(
                f"devices={devices}: plan over at most {MAX_PLAN_DEVICES} fake CPU devices (XLA's CPU backend fails beyond "
                "that, and the compile grows with the count: 27 s for llama3.1-8b on 2048); plan the largest slice that fits"
            )
    if ns.search:
        return _plan_search(ns, args, devices)
    _refuse_search_flags(ns)
    if devices is not None:
        if "jax" in sys.modules:
            if not _jax_has_cpu_devices(devices):
                return _rerun_plan_with_devices(ns, devices)
        else:
            from nnxtron.runtime.fake_devices import fake_device_env

            os.environ.update(fake_device_env(devices))

    from nnxtron.config import load_config
    from nnxtron.tools.plan import format_plan, make_plan, to_json_ready

    cfg = load_config(*_split_file_and_overrides(args))
    plan = make_plan(cfg, device_memory_gib=ns.device_memory_gib)
    print(json.dumps(to_json_ready(plan), indent=1) if ns.json else format_plan(plan).rstrip("\n"))
    return 0


SEARCH_FLAGS = ("device", "top", "time_budget", "workers")


def _refuse_search_flags(ns: argparse.Namespace) -> None:
    given = [f"--{f.replace('_', '-')}" for f in SEARCH_FLAGS if getattr(ns, f) is not None]
    if given:
        raise UserError(f"{', '.join(given)} only apply to plan --search; add --search or drop them")


def _plan_search(ns: argparse.Namespace, args: list[str], devices: int | None) -> int:
    """``plan --search``: rank the parallel configurations of ``devices`` devices (tools/search/)."""
    if devices is None:
        raise UserError("plan --search needs devices=N: the number of devices to plan for, e.g. devices=64")
    if "jax" not in sys.modules:  # the cpu preset's probes run on the same fake devices as the compiles
        import os

        from nnxtron.runtime.fake_devices import fake_device_env

        os.environ.update(fake_device_env(devices))
    from nnxtron.tools.search import SearchRequest, format_search, preset, search, with_memory

    try:
        device = with_memory(preset(ns.device or "h100", devices), ns.device_memory_gib)
    except ValueError as err:
        raise UserError(str(err)) from None
    file, overrides = _split_file_and_overrides(args)
    request = SearchRequest(
        file, overrides, devices, device, top=ns.top or 5, budget_seconds=ns.time_budget or 600.0, workers=ns.workers or 2
    )
    result = search(request)
    from nnxtron.tools.plan import to_json_ready

    print(json.dumps(to_json_ready(result), indent=1) if ns.json else format_search(result).rstrip("\n"))
    return 0


def _jax_has_cpu_devices(devices: int) -> bool:
    """Whether the already-imported jax runs on exactly ``devices`` CPU devices (False if
    its backends are not started yet: their flags can no longer be trusted to apply)."""
    import jax

    from nnxtron.runtime.private_api import backends_are_initialized

    if not backends_are_initialized():
        return False
    return jax.default_backend() == "cpu" and jax.device_count() == devices


def _rerun_plan_with_devices(ns: argparse.Namespace, devices: int) -> int:
    """Run ``nnxtron plan`` in a child process with ``devices`` fake CPU devices, forwarding
    its stdout, stderr and exit status."""
    import os
    import subprocess

    from nnxtron.runtime.fake_devices import child_env

    if os.environ.get("NNXTRON_PLAN_CHILD"):  # the child must never recurse
        raise UserError(f"could not start jax with {devices} fake CPU devices (XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r})")
    env = {**child_env(devices), "NNXTRON_PLAN_CHILD": "1"}
    argv = [sys.executable, "-m", "nnxtron", "plan", *ns.args]
    if ns.json:
        argv.append("--json")
    if ns.device_memory_gib is not None:
        argv += ["--device-memory-gib", str(ns.device_memory_gib)]
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    sys.stdout.write(proc.stdout)
    sys.stdout.flush()
    sys.stderr.write(proc.stderr)
    sys.stderr.flush()
    return proc.returncode


# `nnxtron train --help`: the keys most runs set (tests/unit/test_small_frictions.py checks
# that each is a config key); every key is in `nnxtron config show` and base.yml
TRAIN_KEYS_HELP = """\
config keys: key=value after the optional FILE.yml (every default:
src/nnxtron/config/presets/base.yml). The most used:
  model_name=NAME          a preset (llama3.1-8b, qwen3-0.6b, mixtral-tiny,
                           deepseek3-tiny, ...); default: a small byte model
  steps=N                  optimizer steps
  per_device_batch_size=N  rows per device and step
  max_target_length=N      tokens per row
  learning_rate=X          peak learning rate (warmup_steps_fraction,
                           lr_schedule_type, opt_type: docs/optimizers.md)
  dataset_type=TYPE        text | jsonl | parquet | arrayrecord | synthetic
  dataset_path=PATH        corpus files, directories or globs (docs/data.md)
  tokenizer_type=TYPE      byte | hf | sentencepiece | tiktoken, with
                           tokenizer_path=PATH
  run_name=NAME            the run's directory under base_output_directory;
                           an existing run resumes
  init_from=DIR            fine-tune an HF model directory or a run
                           (docs/finetune.md)
  use_sft=true  use_dpo=true  lora_rank=N
                           instruction / preference tuning, LoRA adapters
                           (docs/post-training.md)
  eval_interval=N  checkpoint_period=N  enable_checkpointing=false
  ici_fsdp_parallelism=N  remat_policy=NAME  dtype=bfloat16
                           devices and memory (README: Memory and parallel
                           strategies)

every key with its value: nnxtron config show [FILE.yml] [key=value ...]
what each key does: README "Configuration", docs/config.md and docs/*.md;
MaxText configs and keys work too (docs/maxtext.md)
"""


def build_parser() -> argparse.ArgumentParser:
    from nnxtron import __version__

    parser = _Parser(prog="nnxtron", description="Train and sample decoder-only language models with JAX + NNX.")
    parser.add_argument("--version", action="version", version=f"nnxtron {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    file_help = "[FILE.yml] [key=value ...]: an optional YAML config, then overrides"

    p = sub.add_parser(
        "train", help="train a model (no arguments: the default small byte-level run)", epilog=TRAIN_KEYS_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    p.add_argument("args", nargs="*", help=file_help)
    p.add_argument("--no-progress", action="store_true", help="print log lines instead of the live progress bar")
    p.add_argument(
        "--restart", action="store_true",
        help="with enable_checkpointing=false: start a run that has logged steps again at step 0, replacing its metrics",
    )  # fmt: skip
    p.add_argument("--coordinator-address", help="multi-host: HOST:PORT of process 0 (with --num-processes, --process-id)")
    p.add_argument("--num-processes", type=_number(int, at_least=1), help="multi-host: how many processes take part")
    p.add_argument(
        "--process-id", type=_number(int, at_least=0), help="multi-host: this process's number, 0 .. num-processes - 1"
    )
    p.add_argument(
        "--distributed", action="store_true",
        help="multi-host: let JAX detect the coordinator, count and id (SLURM, Open MPI, TPU VMs, Kubernetes)",
    )  # fmt: skip
    p.add_argument(
        "--peer-timeout", type=_number(int, at_least=1), default=None, metavar="SECONDS",
        help=f"multi-host: a process that has not been heard from for this long is dead and the others stop (default {PEER_TIMEOUT_S})",
    )  # fmt: skip
    p.add_argument(
        "--init-timeout", type=_number(int, at_least=1), default=None, metavar="SECONDS",
        help=f"multi-host: stop with one line when the coordinator and every process have not joined within this long (default {INIT_TIMEOUT_S})",
    )  # fmt: skip
    p.set_defaults(func=_cmd_train)

    p = sub.add_parser("generate", help="sample from a run directory or an HF directory")
    p.add_argument("path", help="run directory (config.yml + checkpoints/) or HF model directory")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="optional: prompt, max_new_tokens, decode_sampling_*, ...")
    p.add_argument("--prompt", help="prompt text (same as prompt=...)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    p.add_argument("--chat", action="store_true", help="the prompt is one user message, rendered with the model's chat template")
    p.set_defaults(func=_cmd_generate)

    p = sub.add_parser(
        "eval", help="loss, perplexity and bits per byte of a run or an HF directory on a corpus, or lm-eval tasks"
    )
    p.add_argument("path", help="run directory (config.yml + checkpoints/) or HF model directory")
    p.add_argument(
        "overrides", nargs="*", help="key=value: the corpus (dataset_type, dataset_path, dataset_text_field, use_sft, ...)"
    )
    p.add_argument(
        "--batch-rows",
        type=_number(int, at_least=1),
        default=8,
        help="rows of max_target_length tokens scored per call (default 8)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--tasks", default="", help="lm-eval harness tasks, comma-separated (needs nnxtron[lmeval])")
    p.add_argument("--include-path", default=None, help="a directory of lm-eval task YAML files (with --tasks)")
    p.add_argument(
        "--limit", type=_number(int, at_least=1), default=None, help="with --tasks: at most this many documents per task"
    )
    p.add_argument(
        "--num-fewshot", type=_number(int, at_least=0), default=None, help="with --tasks: few-shot examples per prompt"
    )
    p.set_defaults(func=_cmd_eval)

    p = sub.add_parser("serve", help="serve a run directory or an HF directory over an OpenAI-compatible HTTP API")
    p.add_argument("path", help="run directory (config.yml + checkpoints/) or HF model directory")
    p.add_argument(
        "overrides", nargs="*", metavar="key=value", help="optional config overrides for loading the model (e.g. dtype=bfloat16)"
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000; 0 picks a free one)")
    p.add_argument(
        "--api-key", default=None,
        help="require 'Authorization: Bearer KEY' on /v1/* (default: $NNXTRON_API_KEY if set, else no key)",
    )  # fmt: skip
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: the directory's name)")
    p.add_argument(
        "--max-length", type=int, default=None,
        help="context of one sequence, prompt + completion (default: max_position_embeddings, at most 4096)",
    )  # fmt: skip
    p.add_argument("--max-sequences", type=int, default=16, help="sequences decoded together (default 16)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block (default 16)")
    p.add_argument("--kv-blocks", type=int, default=None, help="KV cache blocks (default: every sequence at --max-length)")
    p.add_argument("--prefill-chunk", type=int, default=64, help="prompt tokens prefilled per step (power of two >= 16)")
    p.add_argument("--max-queue", type=int, default=64, help="waiting sequences before requests get 429 (default 64)")
    p.add_argument(
        "--request-timeout", type=float, default=600.0,
        help="seconds a request may take before it is cancelled with 504 (default 600; 0: no limit)",
    )  # fmt: skip
    p.add_argument("--chat-template", default=None, help="a Jinja chat template file replacing the tokenizer's")
    p.add_argument("--log-level", default="info", help="uvicorn log level: critical, error, warning, info, debug")
    p.add_argument(
        "--max-body-bytes", type=int, default=8 * 1024 * 1024, help="a larger request body is refused with 413 (default 8 MiB)"
    )
    p.add_argument(
        "--read-timeout", type=float, default=30.0,
        help="seconds a client has to send a request's headers, and again its body, before 408 (default 30)",
    )  # fmt: skip
    p.add_argument(
        "--max-connections", type=int, default=512, help="open connections and requests together; more get 503 (default 512)"
    )
    p.add_argument(
        "--drain-timeout", type=float, default=30.0,
        help="after SIGTERM / SIGINT, seconds the requests in flight get to finish (default 30)",
    )  # fmt: skip
    p.add_argument(
        "--chat-template-timeout", type=_number(float, above=0), default=10.0, metavar="SECONDS",
        help="seconds one rendering of the chat template may take; then it is stopped and the request gets 400 (default 10)",
    )  # fmt: skip
    p.add_argument(
        "--chat-template-memory-mib", type=_number(int, at_least=64), default=512, metavar="MIB",
        help="address space of the chat template's rendering process, Linux (default 512, at least 64)",
    )  # fmt: skip
    p.add_argument(
        "--chat-template-max-chars", type=_number(int, at_least=1), default=1 << 24, metavar="N",
        help="characters one rendering of the chat template may produce (default 16777216)",
    )  # fmt: skip
    p.set_defaults(func=_cmd_serve)

    p = sub.add_parser("convert", help="convert between HF or MaxText checkpoints and nnxtron runs")
    p.add_argument("direction", choices=["from-hf", "to-hf", "from-maxtext", "to-maxtext"])
    p.add_argument(
        "source", help="from-hf: HF model directory; from-maxtext: MaxText checkpoint directory; to-*: nnxtron run directory"
    )
    p.add_argument("dest", help="output directory")
    p.add_argument(
        "overrides", nargs="*",
        help="key=value (e.g. scan_layers=false, dtype=bfloat16); from-maxtext: [config.yml] and the model's keys "
        "(model_name=... and overrides: a MaxText checkpoint does not carry its config)",
    )  # fmt: skip
    p.add_argument("--overwrite", action="store_true", help="to-hf: replace an existing model.safetensors")
    p.add_argument(
        "--adapter-only", action="store_true",
        help="to-hf of a LoRA run: write the adapters alone for HF PEFT (without it: the merged model)",
    )  # fmt: skip
    p.add_argument("--scanned", action="store_true", default=None, help="to-maxtext: layers stacked (MaxText scan_layers=true)")
    p.add_argument("--unscanned", action="store_false", dest="scanned", help="to-maxtext: one array per layer")
    p.set_defaults(func=_cmd_convert)

    p = sub.add_parser("config", help="print the resolved config (show) or where the code reads each key (readers)")
    p.add_argument("action", choices=["show", "readers"])
    p.add_argument("args", nargs="*", help=file_help + "; readers: [KEY ...], the keys to list (default: all)")
    p.add_argument("--inert", action="store_true", help="print the keys that change nothing, with their reasons (docs/config.md)")
    p.add_argument("--json", action="store_true", help="readers: the read sites as one JSON object")
    p.set_defaults(func=_cmd_config)

    p = sub.add_parser("bench", help="compile and time the train step (or decoding); prints one JSON line")
    p.add_argument("args", nargs="*", help=file_help)
    p.add_argument("--steps", type=_number(int, at_least=1), default=10, help="timed steps after warm-up (median reported)")
    p.add_argument(
        "--decode", action="store_true",
        help="time KV-cached decoding instead: prefill of the global batch x max_target_length, then max_new_tokens steps",
    )  # fmt: skip
    p.add_argument(
        "--profile", metavar="DIR",
        help="also trace 3 more steps into DIR (jax.profiler) with the step's HLO, and add where their time goes "
        "(profile_breakdown: ms and ops per step by place, pass and kind of op)",
    )  # fmt: skip
    p.set_defaults(func=_cmd_bench)

    p = sub.add_parser(
        "plan",
        help="parameter counts, shardings and per-device memory from an ahead-of-time compile (nothing allocated)",
    )
    p.add_argument("args", nargs="*", help=file_help + "; devices=N plans over N fake CPU devices")
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    p.add_argument(
        "--device-memory-gib",
        type=_number(float, above=0),
        default=None,
        help="say whether the peak fits in this much device memory",
    )
    p.add_argument(
        "--search", action="store_true",
        help="search the mesh, remat, accumulation, pipeline and offload settings that fit and run fastest (docs/plan.md)",
    )  # fmt: skip
    p.add_argument(
        "--device", default=None, help="--search: accelerator preset (h100, h200, b200, tpu-v5e, tpu-v5p, tpu-v6e, cpu)"
    )
    p.add_argument(
        "--top", type=_number(int, at_least=1), default=None, help="--search: how many configurations to print (default 5)"
    )
    p.add_argument(
        "--time-budget", type=_number(float, above=0), default=None, help="--search: seconds for the whole search (default 600)"
    )
    p.add_argument(
        "--workers", type=_number(int, at_least=1, at_most=MAX_SEARCH_WORKERS, why=" (one compile process per CPU core)"),
        default=None, help=f"--search: parallel compile processes (default 2, at most the {MAX_SEARCH_WORKERS} CPU cores)",
    )  # fmt: skip
    p.set_defaults(func=_cmd_plan)
    return parser


def _key_value_hint(unknown: Sequence[str], words: Sequence[str]) -> str:
    """For ``--steps 100`` / ``--steps=100``: config keys are given as ``steps=100``."""
    from nnxtron.config.schema import Config

    for arg in unknown:
        name, _, value = arg.lstrip("-").partition("=")
        key = name.replace("-", "_")
        if arg.startswith("--") and key in Config.model_fields:
            after = words.index(arg) + 1 if arg in words else len(words)
            if not value and after < len(words) and not words[after].startswith("-"):
                value = words[after]
            return f"; config keys are given as key=value: write {key}={value or '...'}"
    return ""


def main(argv: Sequence[str] | None = None) -> int:
    try:
        parser = build_parser()
        ns, extra = parser.parse_known_args(argv)
        target = "overrides" if hasattr(ns, "overrides") else "args"
        keys = getattr(ns, "action", None) == "readers"  # `config readers --json KEY`: a key after an option
        unknown = [arg for arg in extra if arg.startswith("-") or ("=" not in arg and not keys)]
        if unknown:
            words = list(sys.argv[1:] if argv is None else argv)
            parser.error(f"unrecognized arguments: {' '.join(unknown)}{_key_value_hint(unknown, words)}")
        setattr(ns, target, [*getattr(ns, target), *extra])  # key=value given after an --option
        code = ns.func(ns)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit
        return code
    except UserError as err:
        print("error: " + " ".join(str(err).split()), file=sys.stderr)  # always one line
        return EXIT_USER_ERROR
    except KeyboardInterrupt as err:
        print(str(err) or "interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        if not _stdout_reader_gone():
            raise  # another pipe (a child process's): a real failure
        # `nnxtron config show | head`: the reader has what it wanted. Stop quietly, as a unix
        # tool killed by SIGPIPE does; Python's docs (signal, "Note on SIGPIPE"): point stdout
        # at devnull so that the interpreter's final flush does not fail again
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):  # stdout without a descriptor (an embedding program's)
            pass
        return EXIT_BROKEN_PIPE


def _stdout_reader_gone() -> bool:
    """Whether stdout is a pipe whose reading end is closed (poll reports an error on it)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll (Windows), stdout without a descriptor
        return True


if __name__ == "__main__":
    sys.exit(main())
