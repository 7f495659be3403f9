"""The ``nnxtron`` command: train | generate | convert | config | bench.

Every subcommand takes an optional YAML file and ``key=value`` overrides. Bad input
(config, data, checkpoint, command line) is reported as one line on stderr with exit
status 2 and no traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from nnxtron.errors import UserError

EXIT_USER_ERROR = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2 (argparse prints usage + message)
        raise UserError(f"{self.prog}: {message} (see `{self.prog} --help`)")


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
    import jax

    from nnxtron.config import config_to_yaml, derive, load_config

    cfg = load_config(*_split_file_and_overrides(ns.args))
    print(config_to_yaml(cfg), end="")
    print("# derived for", jax.device_count(), "device(s):")
    for key, value in derive(cfg, jax.device_count()).as_dict().items():
        print(f"#   {key}: {value}")
    return 0


def _cmd_train(ns: argparse.Namespace) -> int:
    from nnxtron.config import load_config
    from nnxtron.train.loop import train

    cfg = load_config(*_split_file_and_overrides(ns.args))
    result = train(cfg, progress=None if not ns.no_progress else False)
    first, last = (result.losses[0], result.losses[-1]) if result.losses else (None, None)
    if first is not None:
        print(
            f"trained steps {result.start_step}..{result.end_step}: loss {first:.4f} -> {last:.4f}"
            + (f" (eval {list(result.eval_losses.values())[-1]:.4f})" if result.eval_losses else "")
        )
    print(f"run directory: {result.run_dir}")
    if cfg.sample_after_training and result.state is not None:
        _print_sample_from_state(cfg, result)
    return 0


def _print_sample_from_state(cfg, result) -> None:
    from flax import nnx

    from nnxtron.data.sources import tokenizer_for
    from nnxtron.decoder import abstract_model
    from nnxtron.infer.sample import generate_tokens

    graphdef = nnx.split(abstract_model(cfg))[0]
    model = nnx.merge(graphdef, result.state["params"], result.state["rest"])
    tokenizer = tokenizer_for(cfg)
    prompt = [tokenizer.bos_id, *tokenizer.encode(cfg.prompt).tolist()]
    ids = list(generate_tokens(model, prompt, cfg, cfg.sample_after_training, (tokenizer.eos_id,)))
    print(f"--- sample ({cfg.decode_sampling_strategy}, {len(ids)} tokens) ---")
    print(cfg.prompt + tokenizer.decode(ids))


def _cmd_generate(ns: argparse.Namespace) -> int:
    from nnxtron.data.sources import tokenizer_for
    from nnxtron.infer.sample import generate_tokens
    from nnxtron.runs import load_model

    overrides = list(ns.overrides)
    if ns.prompt is not None:
        overrides.append(f"prompt={ns.prompt}")
    model = load_model(ns.path, overrides)
    cfg = model.config
    tokenizer = tokenizer_for(cfg)
    prompt = [tokenizer.bos_id, *tokenizer.encode(cfg.prompt).tolist()]
    stream = generate_tokens(model, prompt, cfg, cfg.max_new_tokens, (tokenizer.eos_id,))
    if ns.json:
        ids = list(stream)
        print(json.dumps({"prompt": cfg.prompt, "completion": tokenizer.decode(ids), "tokens": ids}))
        return 0
    sys.stdout.write(cfg.prompt)
    pending: list[int] = []
    for token in stream:  # stream whole UTF-8 characters as they complete
        pending.append(token)
        text = tokenizer.decode(pending)
        if "\ufffd" not in text:
            sys.stdout.write(text)
            sys.stdout.flush()
            pending = []
    sys.stdout.write(tokenizer.decode(pending) + "\n")
    return 0


def _cmd_convert(ns: argparse.Namespace) -> int:
    from nnxtron import hf
    from nnxtron.config.loader import config_to_yaml, parse_overrides
    from nnxtron.runs import load_model

    if ns.direction == "to-hf":
        model = load_model(ns.source, ns.overrides)
        out = hf.to_hf(model, ns.dest, overwrite=ns.overwrite)
        print(f"wrote HF checkpoint to {out}")
        return 0
    from flax import nnx

    from nnxtron.train.checkpoint import Checkpointer

    dest = Path(ns.dest)
    if (dest / "config.yml").exists() or (dest / "checkpoints").exists():
        raise UserError(f"'{dest}' already holds an nnxtron run; choose an empty output directory")
    model = hf.from_hf(ns.source, **parse_overrides(ns.overrides))
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "config.yml").write_text(config_to_yaml(model.config))
    ckpt = Checkpointer(dest / "checkpoints", max_to_keep=1)
    ckpt.save(0, {"params": nnx.to_pure_dict(nnx.state(model, nnx.Param))}, {"source": str(Path(ns.source).absolute())})
    ckpt.wait()
    print(f"wrote nnxtron checkpoint to {dest} (use: nnxtron generate {dest} | nnxtron train load_parameters_path={dest})")
    return 0


def _cmd_bench(ns: argparse.Namespace) -> int:
    from nnxtron.bench import run_bench

    print(json.dumps(run_bench(*_split_file_and_overrides(ns.args), steps=ns.steps)))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="nnxtron", description="Train and sample decoder-only language models with JAX + NNX.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    file_help = "[FILE.yml] [key=value ...]: an optional YAML config, then overrides"

    p = sub.add_parser("train", help="train a model (no arguments: the default small byte-level run)")
    p.add_argument("args", nargs="*", help=file_help)
    p.add_argument("--no-progress", action="store_true", help="print log lines instead of the live progress bar")
    p.set_defaults(func=_cmd_train)

    p = sub.add_parser("generate", help="sample from a run directory or an HF directory")
    p.add_argument("path", help="run directory (config.yml + checkpoints/) or HF model directory")
    p.add_argument("overrides", nargs="*", help="key=value (prompt, max_new_tokens, decode_sampling_*)")
    p.add_argument("--prompt", help="prompt text (same as prompt=...)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    p.set_defaults(func=_cmd_generate)

    p = sub.add_parser("convert", help="convert between HF checkpoints and nnxtron runs")
    p.add_argument("direction", choices=["from-hf", "to-hf"])
    p.add_argument("source", help="from-hf: HF model directory; to-hf: nnxtron run directory")
    p.add_argument("dest", help="output directory")
    p.add_argument("overrides", nargs="*", help="key=value (e.g. scan_layers=false, dtype=bfloat16)")
    p.add_argument("--overwrite", action="store_true", help="to-hf: replace an existing model.safetensors")
    p.set_defaults(func=_cmd_convert)

    p = sub.add_parser("config", help="print the resolved config")
    p.add_argument("action", choices=["show"])
    p.add_argument("args", nargs="*", help=file_help)
    p.set_defaults(func=_cmd_config)

    p = sub.add_parser("bench", help="compile and time the train step; prints one JSON line")
    p.add_argument("args", nargs="*", help=file_help)
    p.add_argument("--steps", type=int, default=10, help="timed steps after warm-up (median reported)")
    p.set_defaults(func=_cmd_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        parser = build_parser()
        ns, extra = parser.parse_known_args(argv)
        target = "overrides" if hasattr(ns, "overrides") else "args"
        unknown = [arg for arg in extra if "=" not in arg or arg.startswith("-")]
        if unknown:
            parser.error(f"unrecognized arguments: {' '.join(unknown)}")
        getattr(ns, target).extend(extra)  # key=value given after an --option
        return ns.func(ns)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
