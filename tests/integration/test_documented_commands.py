"""Every ``nnxtron ...`` command shown in README.md and docs/*.md runs as written.

The commands are read from the fenced code blocks of the documents (a ``$ `` prompt and
``\\`` continuations are understood) and run, one document at a time, in its order, as a
user would type them: the ``nnxtron`` console script in a child process, in a fresh working
directory, with ``HOME`` pointing at a home that holds what the documents name (``~/hf/...``
model directories, ``~/corpus``, ``~/data``, a SentencePiece ``~/llama2/tokenizer.model`` ...,
all tiny and made here) and the repository's ``tests/`` beside the runs, with a ``docs/`` of
three of its documents (:data:`DOCS_BESIDE`).

What the test changes, and only by adding or rescaling ``key=value`` overrides (never by
editing an example):

- step counts: ``steps``, ``learning_rate_schedule_steps``, ``eval_interval`` and
  ``checkpoint_period`` are divided by 100 (at least 2; ``steps=2`` where none is given),
  ``eval_steps=1``, and at most 16 decoded tokens (``max_new_tokens``,
  ``sample_after_training``): the commands run the same code paths in seconds;
- the sample after training: the README's default run (:data:`SAMPLED`) and a command that sets
  ``sample_after_training`` decode theirs; the other ``train`` commands get
  ``sample_after_training=0`` (each sample compiles a prefill and a decode loop, 3-5 s a command
  on 2 cores; decoding every family is proven against HF in tests/parity/test_kv_cache.py);
- a command shown again (the same words in another document) runs once, where first shown;
- ``--port``: a free port (``serve`` is started, asked ``/health``, and stopped with SIGINT);
- the few commands of :data:`ADDED` (a 7B+ preset shrunk to fit this machine, ...), each with
  its reason.

A command with placeholders (``...``, ``[FILE.yml]``, ``CKPT_DIR``, ``$RANK``) is a synopsis:
its flags must be the subcommand's and its keys config keys (:func:`check_synopsis`). A
command that documents an error (:data:`ERRORS`) must fail with exit status 2 and that one
line. Tables that name a command no document shows fail the test, so they cannot go stale.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from nnxtron.runtime.fake_devices import fake_device_env

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = ["README.md", *sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))]
NNXTRON = Path(sys.executable).with_name("nnxtron")  # the console script pip installed
TIMEOUT_S = 600
SCALED_KEYS = ("steps", "learning_rate_schedule_steps", "eval_interval", "checkpoint_period")
DECODED_TOKENS = 16  # at most, for max_new_tokens and sample_after_training
SAMPLED = {"nnxtron train run_name=demo steps=200"}  # train commands whose sample after training runs
# the docs/ beside the runs: three of the documents (post-training.md's eval of docs/*.md scores
# every file there; all of them are 100k tokens, 100 s on 2 cores, for the same code path)
DOCS_BESIDE = ("docs/logging.md", "docs/config.md", "docs/init.md")

# A 7B+ preset (vocabularies of 32k-129k ids) does not fit a 2-core CI machine: the test keeps
# every key the example sets and adds these, which shrink the model and leave the byte tokenizer usable.
SHRINK = (
    "base_num_decoder_layers=2", "base_emb_dim=64", "base_mlp_dim=128", "base_num_query_heads=4", "base_num_kv_heads=2",
    "head_dim=16", "vocab_size=320",
)  # fmt: skip

#: command (as written, comments dropped) -> (overrides the test adds, why)
ADDED: dict[str, tuple[tuple[str, ...], str]] = {
    "nnxtron train model_name=llama3.1-8b dtype=bfloat16 attention=auto": (SHRINK, "an 8B model"),
    "nnxtron train model_name=mistral-7b attention=dot_product": (SHRINK, "a 7B model"),
    "nnxtron train model_name=llama3.1-8b ici_context_parallelism=4 ici_fsdp_parallelism=2": (SHRINK, "an 8B model"),
    "nnxtron train model_name=llama3.1-8b use_qwix_quantization=true quantization=fp8_full": (SHRINK, "an 8B model"),
    "nnxtron train model_name=deepseek3-tiny mtp_num_layers=1 use_qwix_quantization=true quantization=fp8_full "
    "dataset_type=synthetic per_device_batch_size=1 max_target_length=32 steps=20": (
        ("base_num_decoder_layers=5",),
        "fp8 is emulated on CPU (a step of the 61-layer preset takes ~20 s); tests/integration/test_quantized_training.py "
        "runs it at 5 layers too",
    ),
    "nnxtron train init_from=~/hf/Qwen3-0.6B run_name=sft1 use_sft=true dataset_type=jsonl dataset_path=~/data/rows.jsonl "
    "steps=500 learning_rate=1e-5 warmup_steps_fraction=0.03 per_device_batch_size=4 max_target_length=2048 "
    "eval_interval=100 eval_split_fraction=0.02": (
        ("per_device_batch_size=1", "max_target_length=256"),
        "4 rows of 2048 tokens a step: 50 s of CPU; the chat records are ~30 tokens, so 256 packs them the same way",
    ),
    "nnxtron plan model_name=deepseek3-671b mtp_num_layers=1 use_qwix_quantization=true quantization=fp8_full": (
        ("base_num_decoder_layers=4", "first_num_dense_layers=1", "num_experts=16"),
        "planning 61 layers of 256 experts takes ~50 s of compilation; 4 layers of 16 exercise the same code",
    ),
}

#: command -> the fragment of the one error line it documents
ERRORS: dict[str, str] = {
    "nnxtron train init_from=~/hf/Llama-2-7b-hf base_emb_dim=256": "was created with base_emb_dim=",
    # the harness downloads these tasks' data sets; CI (like this test) has no network
    "nnxtron eval runs/sft1 --tasks hellaswag,arc_easy --num-fewshot 0 --limit 500 --batch-rows 16": "hellaswag",
}


#: transcripts of measurements (docs/plan.md's worked examples: minutes of compilation on 8 to 256
#: fake devices each); checked like a synopsis, their output is what the document records
TRANSCRIPTS = {
    "nnxtron plan --search model_name=llama3.1-8b dtype=bfloat16 per_device_batch_size=1 max_target_length=4096 devices=8 "
    "--device h100 --time-budget 300",
    "nnxtron plan --search model_name=llama3.1-70b dtype=bfloat16 per_device_batch_size=1 max_target_length=4096 devices=64 "
    "--device h100 --time-budget 450",
    "nnxtron plan --search model_name=deepseek3-671b dtype=bfloat16 per_device_batch_size=1 max_target_length=4096 "
    "devices=256 --device h200 --time-budget 450",
}


@dataclass(frozen=True)
class Documented:
    """One command as a document shows it."""

    document: str  # "README.md", "docs/x.md"
    line: int  # where it starts (1-based)
    block: str  # the fence's language ("bash", "text", "")
    text: str  # continuations joined, the `$ ` prompt dropped, comments kept

    @property
    def words(self) -> list[str]:
        return shlex.split(self.text, comments=True)

    @property
    def line_text(self) -> str:
        """The command as a shell reads it, without its ``# comment`` and a trailing ``&``."""
        quote = None
        for i, char in enumerate(self.text):
            if quote:
                quote = None if char == quote else quote
            elif char in "'\"":
                quote = char
            elif char == "#" and (i == 0 or self.text[i - 1].isspace()):
                return self.text[:i].rstrip().removesuffix("&").rstrip()
        return self.text.rstrip().removesuffix("&").rstrip()

    @property
    def key(self) -> str:
        return " ".join(self.words)

    def __str__(self) -> str:
        return f"{self.document}:{self.line}: {self.text}"


def documented_commands(documents=DOCUMENTS) -> list[Documented]:
    """The ``nnxtron`` commands of the fenced code blocks of ``documents``, in order."""
    found = []
    for document in documents:
        lines = (ROOT / document).read_text().splitlines()
        block, i = None, 0
        while i < len(lines):
            stripped = lines[i].strip()
            if stripped.startswith("```"):
                block = stripped[3:].strip() if block is None else None
            elif block is not None:
                text = stripped[2:] if stripped.startswith("$ ") else stripped
                if re.match(r"^([A-Z_]+=\S+\s+)*nnxtron\s", text):
                    start = i
                    while text.endswith("\\") and i + 1 < len(lines):
                        i += 1
                        text = text[:-1].rstrip() + " " + lines[i].strip()
                    found.append(Documented(document, start + 1, block, text))
            i += 1
    return found


PLACEHOLDER = re.compile(r"^(\.\.\.|\[.*|.*\]|[A-Z][A-Z0-9_]*(:[A-Z0-9_]+)?|\$[A-Z]+|path/to/.*)$")

VALUE_PLACEHOLDER = re.compile(r"^(\.\.\.|[A-Z][A-Z0-9_]*|path/to/.*)$")


def is_synopsis(cmd: Documented) -> bool:
    """A command with placeholders (``...``, ``[optional parts]``, ``UPPER_CASE`` or ``path/to/``
    values, ``$RANK``) or the transcript of a measurement too long for CI (:data:`TRANSCRIPTS`)."""
    if cmd.key in TRANSCRIPTS:
        return True
    words = cmd.words[cmd.words.index("nnxtron") + 1 :]
    return any(
        VALUE_PLACEHOLDER.match(w.split("=", 1)[1]) if "=" in w and not w.startswith("[") else PLACEHOLDER.match(w) for w in words
    )


def check_synopsis(cmd: Documented) -> list[str]:
    """A synopsis's problems: flags its subcommand does not have, keys the config does not have."""
    from nnxtron.cli import build_parser
    from nnxtron.config.maxtext_keys import KEYS as MAXTEXT_KEYS
    from nnxtron.config.schema import Config

    known_keys = {*Config.model_fields, *MAXTEXT_KEYS}

    words = cmd.words[cmd.words.index("nnxtron") + 1 :]
    parser = build_parser()
    sub = parser._subparsers._group_actions[0].choices  # noqa: SLF001 - the subcommands argparse built
    flags = {option for action in sub[words[0]]._actions for option in action.option_strings}  # noqa: SLF001
    problems = []
    for word in words:
        for part in word.strip("[]").split("|"):
            if part.startswith("--") and part.split("=")[0] not in flags:
                problems.append(f"{part}: not a flag of `nnxtron {words[0]}`")
            key = part.split("=", 1)[0]
            generic = key in ("key", "k") or (words[0] == "plan" and key == "devices")  # `[key=value ...]`; plan's own
            if "=" in part and re.fullmatch(r"[a-z][a-z0-9_]*", key) and not generic and key not in known_keys:
                problems.append(f"{key}: not a config key")
    return problems


def scaled(text: str, subcommand: str, keys: set[str], sampled: bool = False) -> str:
    """``text`` with its step counts divided by 100 (at least 2) and at most
    :data:`DECODED_TOKENS` decoded; for ``train`` ``steps=2``, ``eval_steps=1`` and, where none is
    given, the sample's tokens (``sampled``, else none), for ``generate`` its tokens."""

    def one(match: re.Match) -> str:
        value = int(match.group(2))
        return f"{match.group(1)}={max(2, math.ceil(value / 100)) if value > 0 else value}"

    def capped(match: re.Match) -> str:
        return f"{match.group(1)}={min(int(match.group(2)), DECODED_TOKENS)}"

    text = re.sub(rf"(?<![\w.])({'|'.join(SCALED_KEYS)})=(-?\d+)(?![\w.])", one, text)
    text = re.sub(r"(?<![\w.])(max_new_tokens|sample_after_training)=(\d+)(?![\w.])", capped, text)
    sample = DECODED_TOKENS if sampled else 0
    added = {"train": (("steps", 2), ("eval_steps", 1), ("sample_after_training", sample)),
             "generate": (("max_new_tokens", DECODED_TOKENS),)}.get(subcommand, ())  # fmt: skip
    return text + "".join(f" {k}={v}" for k, v in added if k not in keys)


def devices_for(words: list[str]) -> int:
    """The fake CPU devices the command's mesh keys ask for (their product; 1 without any)."""
    product = 1
    for word in words:
        key, _, value = word.partition("=")
        if key.startswith(("ici_", "dcn_")) and key.endswith("_parallelism") and value.isdigit():
            product *= int(value)
    return product


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# -- the home the documents name ----------------------------------------------------------------------

ENGLISH = (
    "The license grants you the right to use, copy and modify the software. The licensor is not liable "
    "for any claim, damages or other liability. Where there is a will there is a way. "
)
CHAT = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: "
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}{{ eos_token }}{% endgeneration %}"
    "{% else %}{{ m['content'] }}{% endif %}\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
)

#: Llama 2's chat template as its hub directory ships it (tokenizer_config.json)
LLAMA2_CHAT = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}{% set system_message = "
    "messages[0]['content'] %}{% else %}{% set loop_messages = messages %}{% set system_message = false %}{% endif %}"
    "{% for message in loop_messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}{% set content = '<<SYS>>\\n' + system_message + "
    "'\\n<</SYS>>\\n\\n' + message['content'] %}{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}"
)


def write_hf_model(directory: Path, preset: str, tokenizer: str, chat: str = "") -> None:
    """A tiny HF model directory of ``preset`` with a ``tokenizer`` ("bpe": tokenizer.json,
    "sentencepiece": tokenizer.model only) and a ``chat`` template in tokenizer_config.json."""
    from nnxtron.config import load_config
    from nnxtron.convert.hf import to_hf
    from nnxtron.models.build import build_model
    from tests.tokenizer_files import write_bpe, write_sentencepiece

    cfg = load_config(values={"model_name": preset, "vocab_size": 320, "base_num_decoder_layers": 2})
    to_hf(build_model(cfg), directory)
    for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "chat_template.jinja"):
        (directory / name).unlink(missing_ok=True)
    if tokenizer == "sentencepiece":
        write_sentencepiece(directory / "tokenizer.model", [ENGLISH] * 3, 300)
    else:
        write_bpe(directory, [ENGLISH] * 20, 300)
    if chat:
        config = directory / "tokenizer_config.json"
        settings = json.loads(config.read_text()) if config.is_file() else {"bos_token": "<s>", "eos_token": "</s>"}
        config.write_text(json.dumps({**settings, "chat_template": chat}))


def chat_records(count: int, seed: int) -> list[str]:
    words = ["red", "blue", "green", "cat", "dog", "sun", "moon", "tree"]
    rows = []
    for i in range(count):
        picked = [words[(seed + i * k) % len(words)] for k in (1, 3, 5)]
        rows.append(json.dumps({"messages": [
            {"role": "user", "content": "reverse: " + " ".join(picked)},
            {"role": "assistant", "content": " ".join(reversed(picked))},
        ]}))  # fmt: skip
    return rows


def write_home(home: Path) -> None:
    """What the documents' commands read under ``~``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tests.tokenizer_files import write_sentencepiece

    texts = [ENGLISH * (3 + i) for i in range(4)]
    for folder in ("corpus", "web", "code"):
        for i, text in enumerate(texts):
            (home / folder).mkdir(parents=True, exist_ok=True)
            (home / folder / f"doc{i}.txt").write_text(text)
    lines = [json.dumps({"text": t}) for t in texts]
    (home / "corpus" / "docs.jsonl").write_text("\n".join([*lines[:2], "{not json", *lines[2:]]) + "\n")  # skip_bad_records
    (home / "corpus" / "shards").mkdir()
    for i in range(2):
        pq.write_table(pa.table({"text": texts[2 * i : 2 * i + 2]}), home / "corpus" / "shards" / f"part-{i}.parquet")
    write_sentencepiece(home / "llama2" / "tokenizer.model", texts, 300)
    for folder in ("sft", "data/train"):
        (home / folder).mkdir(parents=True)
        (home / folder / "part-0.jsonl").write_text("\n".join(lines) + "\n")
    (home / "data" / "rows.jsonl").write_text("\n".join(chat_records(24, 0)) + "\n")
    (home / "data" / "held_out.jsonl").write_text("\n".join(chat_records(6, 1)) + "\n")
    pairs = [json.dumps({"prompt": f"reverse: {a} {b}", "chosen": f" {b} {a}", "rejected": f" {a} {b}"})
             for a, b in [("red", "cat"), ("sun", "dog"), ("moon", "tree"), ("blue", "fish")] * 6]  # fmt: skip
    (home / "data" / "pairs.jsonl").write_text("\n".join(pairs) + "\n")
    hf = home / "hf"
    write_hf_model(hf / "Llama-3.1-8B", "llama3.1-tiny", "bpe")
    write_hf_model(hf / "Llama-2-7b-hf", "llama2-tiny", "sentencepiece")
    write_hf_model(hf / "Qwen3-0.6B", "qwen3-tiny", "bpe", chat=CHAT)
    write_hf_model(hf / "Llama-2-7b-chat-hf", "llama2-tiny", "sentencepiece", chat=LLAMA2_CHAT)
    (hf / "gpt2").mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copyfile(ROOT / "tests/assets/golden/gpt2" / name, hf / "gpt2" / name)
    tasks = home / "my_tasks"
    tasks.mkdir()
    shutil.copyfile(ROOT / "tests/assets/lm_eval/choice.jsonl", tasks / "choice.jsonl")
    task = (ROOT / "tests/assets/lm_eval/nnxtron_choice.yaml").read_text()
    (tasks / "my_task.yaml").write_text(task.replace("task: nnxtron_choice", "task: my_task").replace("DATA_DIR", str(tasks)))


@pytest.fixture(scope="session")
def documented_home(tmp_path_factory) -> Path:
    home = tmp_path_factory.mktemp("home")
    write_home(home)
    return home


def shared_directory(tmp_path_factory, name: str) -> Path:
    """A directory every pytest-xdist worker of this session sees (beside the workers' own
    temporary directories), for what one worker makes and the others reuse."""
    base = tmp_path_factory.getbasetemp()
    parent = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    (parent / name).mkdir(exist_ok=True)
    return parent / name


@pytest.fixture(scope="session")
def compilation_cache(tmp_path_factory) -> Path:
    """One compilation cache for the commands of every worker (the default model's programs,
    the tiny families' ...): JAX writes its entries atomically, so workers may share it."""
    return shared_directory(tmp_path_factory, "documented-jax-cache")


# -- running ------------------------------------------------------------------------------------------


def environment(home: Path, words: list[str], env_words: list[str], cache: Path) -> dict[str, str]:
    """This process's environment with ``HOME`` = ``home``, the ``nnxtron`` script first on PATH,
    the fake CPU devices the command's mesh asks for (the command's own ``XLA_FLAGS=`` wins) and
    the shared compilation ``cache``."""
    env = {**os.environ, **fake_device_env(devices_for(words)), "HOME": str(home), "WANDB_MODE": "offline"}
    # one compilation cache for the commands of every document (runs/demo's steps, decoding ...)
    env["JAX_COMPILATION_CACHE_DIR"] = str(cache)
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    env["PATH"] = os.pathsep.join([str(NNXTRON.parent), env.get("PATH", "")])
    if any(w.startswith("XLA_FLAGS=") for w in env_words):
        env.pop("XLA_FLAGS")  # bash sets the command's own
    env.pop("COLUMNS", None)
    return env


def run_one(cmd: Documented, home: Path, workdir: Path, cache: Path) -> str | None:
    """Run ``cmd`` in bash as a user would; None when it did what its document says, else the problem."""
    words = cmd.words
    args = [w for w in words[words.index("nnxtron") + 1 :] if w != "&"]
    keys = {w.split("=", 1)[0] for w in args if "=" in w}
    added, _ = ADDED.get(cmd.key, ((), ""))
    line = scaled(cmd.line_text, args[0], keys, cmd.key in SAMPLED) + "".join(f" {w}" for w in added)
    env = environment(home, [*args, *added], words[: words.index("nnxtron")], cache)
    if args[0] == "serve":
        return serve_once(line, env, workdir)
    if "$i" in line:  # cluster.md: one process per value of $i, started together
        return run_processes(cmd, line, env, workdir)
    proc = subprocess.run(["bash", "-c", line], cwd=workdir, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    return judge(cmd, proc.returncode, proc.stdout, proc.stderr)


def judge(cmd: Documented, code: int, out: str, err: str) -> str | None:
    expected = ERRORS.get(cmd.key)
    lines = [line for line in err.splitlines() if line.strip()]
    if expected is None:
        return None if code == 0 else f"exit {code}\n{(out + err)[-3000:]}"
    errors = [line for line in lines if line.startswith("error: ")]
    if code == 2 and "Traceback" not in err and len(errors) == 1 and expected in errors[0]:
        return None
    return f"expected exit 2 with one error line holding {expected!r}; got exit {code}\n{(out + err)[-3000:]}"


def run_processes(cmd: Documented, line: str, env: dict, workdir: Path) -> str | None:
    """The processes of a multi-process command (``$i`` = 0 and 1), on a free coordinator port."""
    line = re.sub(r"localhost:\d+", f"localhost:{free_port()}", line)
    procs = [
        subprocess.Popen(
            ["bash", "-c", line], cwd=workdir, env={**env, "i": str(i)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )  # fmt: skip
        for i in range(2)
    ]
    outputs = [p.communicate(timeout=TIMEOUT_S) for p in procs]
    problems = [judge(cmd, p.returncode, *o) for p, o in zip(procs, outputs)]
    return next((p for p in problems if p), None)


def serve_once(line: str, env: dict, workdir: Path) -> str | None:
    """Start the server, wait for ``/health``, stop it with SIGINT (Ctrl-C): it must answer, then
    drain and exit with 130 (= 128 + SIGINT, whether the signal lands while loading or serving)."""
    port = free_port()
    line = re.sub(r"--port \d+", f"--port {port}", line) if "--port" in line else f"{line} --port {port}"
    proc = subprocess.Popen(["bash", "-c", f"exec env {line}"], cwd=workdir, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip
    deadline, healthy = time.monotonic() + TIMEOUT_S, False
    while proc.poll() is None and time.monotonic() < deadline and not healthy:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as answer:
                healthy = answer.status == 200
        except OSError:
            time.sleep(0.5)
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    out = proc.communicate(timeout=60)[0]
    if not healthy:
        return f"/health never answered 200 (exit {proc.returncode})\n{out[-3000:]}"
    code = proc.returncode
    return None if code == 128 + signal.SIGINT else f"exit {code} after SIGINT (expected 130)\n{out[-3000:]}"


@pytest.fixture(scope="session")
def demo_run(documented_home, compilation_cache, tmp_path_factory) -> Path:
    """``runs/demo`` as README's ``nnxtron train run_name=demo steps=200`` makes it (scaled), for
    the documents that use it without making it: made once, by the first worker to need it
    (the others wait on its lock, then find it)."""
    workdir = shared_directory(tmp_path_factory, "documented-demo")
    demo = workdir / "runs" / "demo"
    with open(workdir / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (workdir / "made").exists():
            cmd = Documented("README.md", 0, "bash", "nnxtron train run_name=demo steps=200")
            assert run_one(cmd, documented_home, workdir, compilation_cache) is None
            (workdir / "made").touch()
    return demo


def prepare(workdir: Path, demo: Path | None) -> None:
    """The repository's tests/ and :data:`DOCS_BESIDE` beside the runs (documents name them), and
    ``demo``'s run."""
    (workdir / "tests").symlink_to(ROOT / "tests")
    (workdir / "docs").mkdir()
    for document in DOCS_BESIDE:
        shutil.copyfile(ROOT / document, workdir / document)
    if demo is not None:
        shutil.copytree(demo, workdir / "runs" / "demo")


def test_the_tables_name_documented_commands():
    shown = {cmd.key for cmd in documented_commands()}
    assert not set(ADDED) - shown, set(ADDED) - shown
    assert not set(ERRORS) - shown, set(ERRORS) - shown
    assert not TRANSCRIPTS - shown, TRANSCRIPTS - shown
    assert not SAMPLED - shown, SAMPLED - shown
    assert not [str(c) for c in documented_commands() if c.key in ADDED and is_synopsis(c)]


def test_synopses_name_real_flags_and_keys():
    problems = [f"{cmd}: {p}" for cmd in documented_commands() if is_synopsis(cmd) for p in check_synopsis(cmd)]
    assert not problems, "\n".join(problems)


def _children_cpu() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def commands_to_run(document: str) -> list[Documented]:
    """The commands of ``document`` that run: not synopses, not shown before (same words) in an
    earlier document or line; commands that read a run (``runs/X``) always run where shown."""
    seen, mine = set(), []
    for cmd in documented_commands():
        if is_synopsis(cmd):
            continue
        again = cmd.key in seen and "runs/" not in cmd.text
        seen.add(cmd.key)
        if cmd.document == document and not again:
            mine.append(cmd)
    return mine


def chains(document: str) -> list[list[Documented]]:
    """``document``'s commands as independent chains, each in its order: a command that names a
    run (``run_name=NAME``, ``runs/NAME``) joins the chain that named it first."""
    out: list[list[Documented]] = []
    made: dict[str, int] = {}
    for cmd in commands_to_run(document):
        names = [*re.findall(r"run_name=([\w.-]+)", cmd.text), *re.findall(r"runs/([\w.-]+)", cmd.text)]
        owner = next((made[name] for name in names if name in made), None)
        if owner is None:
            out.append([])
            owner = len(out) - 1
        out[owner].append(cmd)
        for name in names:
            made.setdefault(name, owner)
    return out


def needs_demo(chain: list[Documented]) -> bool:
    """The chain reads ``runs/demo`` without making it."""
    return any("runs/demo" in c.text for c in chain) and not any("run_name=demo" in c.words for c in chain)


CHAINS = [chain for document in DOCUMENTS for chain in chains(document)]


@pytest.mark.parametrize("chain", CHAINS, ids=[f"{c[0].document}:{c[0].line}" for c in CHAINS])
def test_documented_commands_run(chain, documented_home, compilation_cache, tmp_path, request):
    prepare(tmp_path, request.getfixturevalue("demo_run") if needs_demo(chain) else None)
    problems = []
    for cmd in chain:
        start, cpu = time.monotonic(), _children_cpu()
        problem = run_one(cmd, documented_home, tmp_path, compilation_cache)
        print(f"{time.monotonic() - start:6.1f} s, {_children_cpu() - cpu:6.1f} s CPU  {cmd}")  # pytest -s shows the costs
        if problem:
            problems.append(f"{cmd}\n  -> {problem}")
    assert not problems, "\n\n".join(problems)
