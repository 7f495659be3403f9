"""Throughput of the input pipeline alone (no model): packed tokens per second of ``CorpusBatches``.

The corpus is text that exists on every machine: this Python's standard library ``*.py``
files (one document each; empty and non-UTF-8 files left out), written into a temporary
directory in each format the data layer reads: text files (a copy of each file), one JSON
Lines file (``{"text": ...}`` per line), one Parquet file (column ``text``, row groups of
``--row-group`` rows) and one ArrayRecord file (``group_size:1``, a record per document).

Each case builds ``CorpusBatches(corpus, all documents, tokenizer, RowSpec(seq_len),
batch, split="train", seed=0, epochs=None, read_threads=T, prefetch=P)`` exactly as
training does, takes ``--warmup`` batches, then times ``--batches`` batches:
tokens/s = batches x batch x seq_len / seconds (the packed row slots; concat packing
fills them all). Cases run interleaved, ``--repeats`` times each, with a fresh iterator
every time; the table shows the median. Every row is also given as a ratio to the
baseline measured in the same run: text files, ``read_threads=0, prefetch=0`` (all work
in the calling thread). ``--train-demand`` also compiles and times the default model's
train step (``nnxtron.tools.bench.run_bench``) and gives each row's ratio to its tokens/s:
above 1 the pipeline outruns training on this machine.

    python benchmarks/data_pipeline.py [--documents N] [--seq-len 1024] [--batch 8] [--batches 500]
        [--repeats 5] [--tokenizer byte|hf|sentencepiece|tiktoken --tokenizer-path P] [--train-demand] [--json FILE]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import shutil
import statistics
import sys
import sysconfig
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from nnxtron.config.options import DATASET_FORMATS
from nnxtron.data import CorpusBatches, RowSpec, Tokenizer, make_tokenizer, open_corpus, split_documents
from nnxtron.data.records import Corpus

BASELINE = ("text", 0, 0)  # format, read threads, prefetch
STATS_DOCUMENTS = 16  # CorpusBatches packs this many documents up front for its statistics (not timed)
VERSIONS = ("grain", "numpy", "pyarrow", "array-record")


def stdlib_documents(limit: int | None) -> list[tuple[str, str]]:
    """(file name, text) of the top-level standard-library ``*.py`` files, sorted by name:
    the first ``limit`` that are UTF-8 and not blank (the corpora reject the others)."""
    out = []
    for path in sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py"))):
        try:
            text = Path(path).read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if text.strip():
            out.append((os.path.basename(path), text))
        if limit is not None and len(out) >= limit:
            break
    if not out:
        raise SystemExit("no standard-library .py files found to build the corpus from")
    return out


def write_corpora(directory: Path, documents: list[tuple[str, str]], row_group: int) -> dict[str, Corpus]:
    """The documents written in every format under ``directory``, each opened with ``open_corpus``
    (the same documents in the same order in each)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from array_record.python.array_record_module import ArrayRecordWriter

    text_dir = directory / "text"
    text_dir.mkdir()
    for name, text in documents:
        (text_dir / name).write_text(text, encoding="utf-8")
    with open(directory / "docs.jsonl", "w", encoding="utf-8") as f:
        for _, text in documents:
            f.write(json.dumps({"text": text}) + "\n")
    pq.write_table(pa.table({"text": [text for _, text in documents]}), directory / "docs.parquet", row_group_size=row_group)
    writer = ArrayRecordWriter(str(directory / "docs.array_record"), "group_size:1")
    for _, text in documents:
        writer.write(text.encode("utf-8"))
    writer.close()
    paths = {"text": text_dir, "jsonl": "docs.jsonl", "parquet": "docs.parquet", "arrayrecord": "docs.array_record"}
    corpora = {kind: open_corpus(kind, directory / path) for kind, path in paths.items()}
    for kind, corpus in corpora.items():
        assert len(corpus) == len(documents), f"{kind}: {len(corpus)} documents, wrote {len(documents)}"
    return corpora


def tokens_per_second(corpus: Corpus, tokenizer: Tokenizer, args: argparse.Namespace, threads: int, prefetch: int) -> float:
    """One timed run of the training pipeline: a fresh iterator, warm-up, ``args.batches`` batches."""
    train, _ = split_documents(corpus, 0.0)  # every document
    source = CorpusBatches(
        corpus, train, tokenizer, RowSpec(seq_len=args.seq_len), args.batch, split="train", seed=0, epochs=None,
        read_threads=threads, prefetch=prefetch, stats_documents=STATS_DOCUMENTS,
    )  # fmt: skip
    it = source.iterator()
    try:
        for _ in range(args.warmup):
            next(it)
        start = time.perf_counter()
        for _ in range(args.batches):
            next(it)
        seconds = time.perf_counter() - start
    finally:
        it.close()
    return args.batches * args.batch * args.seq_len / seconds


def cases(args: argparse.Namespace) -> list[tuple[str, str, int, int]]:
    """(format, tokenizer, read threads, prefetch) of every row, the baseline first."""
    tok = args.tokenizer
    out = [(BASELINE[0], tok, BASELINE[1], BASELINE[2])]
    out += [("text", tok, threads, args.prefetch) for threads in args.threads_sweep]
    for kind in (
        k for k in DATASET_FORMATS if k != "text"
    ):  # each format single-threaded (its reading cost) and as training runs it
        out += [(kind, tok, BASELINE[1], BASELINE[2]), (kind, tok, args.read_threads, args.prefetch)]
    if tok != "byte":  # the same pipeline with the byte tokenizer: what the tokenizer itself costs
        out.append(("text", "byte", args.read_threads, args.prefetch))
    return list(dict.fromkeys(out))  # without repeats, in order


def machine() -> dict[str, Any]:
    versions = {}
    for name in VERSIONS:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "platform": platform.platform(),
        "processor": platform.machine(),
        "cpu_count": os.cpu_count(),
        "usable_cpus": cpus,
        "python": platform.python_version(),
        "versions": versions,
    }


def train_demand(steps: int, overrides: list[str]) -> dict[str, Any]:
    """Tokens/s of the default model's train step (compiles it: tens of seconds on a small CPU)."""
    from nnxtron.tools.bench import run_bench

    result = run_bench(None, overrides, steps=steps)
    keys = ("model_name", "params", "global_batch", "seq_len", "backend", "device_kind", "step_seconds", "tokens_per_s")
    return {k: result[k] for k in keys} | {"overrides": overrides, "timed_steps": steps}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--documents", type=int, default=None, help="use the first N stdlib files (default: all top-level)")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8, help="rows per batch (global_batch_size)")
    parser.add_argument("--batches", type=int, default=500, help="timed batches per run")
    parser.add_argument("--warmup", type=int, default=2, help="untimed batches first, per run")
    parser.add_argument("--repeats", type=int, default=5, help="runs of every case, interleaved; the median is shown")
    parser.add_argument("--read-threads", type=int, default=2, help="read threads of the non-text formats (the config default)")
    parser.add_argument("--prefetch", type=int, default=2, help="prefetched batches, but for the baseline (the config default)")
    parser.add_argument("--threads-sweep", type=int, nargs="+", default=[0, 2, 4], help="read threads of the text rows")
    parser.add_argument("--row-group", type=int, default=64, help="rows per Parquet row group")
    parser.add_argument("--tokenizer", default="byte", choices=["byte", "hf", "sentencepiece", "tiktoken"])
    parser.add_argument("--tokenizer-path", default="", help="the tokenizer file or directory (all but byte)")
    parser.add_argument("--train-demand", action="store_true", help="also time the default model's train step (compiles it)")
    parser.add_argument("--train-steps", type=int, default=5)
    parser.add_argument(
        "--train-set", action="append", default=[], metavar="KEY=VALUE", help="config override for --train-demand"
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the results to this file")
    return parser


def table(result: dict[str, Any]) -> str:
    train = result["train"]
    head = "| format | tokenizer | read threads | prefetch | tokens/s | ratio vs baseline |"
    rule = "|---|---|---|---|---|---|"
    if train:
        head, rule = head + " ratio vs training |", rule + "---|"
    lines = [head, rule]
    for row in result["rows"]:
        name = f"**{row['format']}** (baseline)" if row["baseline"] else row["format"]
        line = (
            f"| {name} | {row['tokenizer']} | {row['read_threads']} | {row['prefetch']} | "
            f"{row['tokens_per_s']:,.0f} | {row['ratio_vs_baseline']:.2f} |"
        )
        if train:
            ratio = row["ratio_vs_train"]
            line += f" {ratio:,.0f} |" if ratio >= 100 else f" {ratio:.2f} |"
        lines.append(line)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Build the corpora, time every case, print the table and return (and maybe write) the results."""
    args = build_parser().parse_args(argv)
    for name in ("seq_len", "batch", "batches", "repeats"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be at least 1")
    documents = stdlib_documents(args.documents)
    tokenizers = {name: make_tokenizer(name, args.tokenizer_path if name != "byte" else "") for name in {args.tokenizer, "byte"}}
    todo = cases(args)
    times: dict[tuple, list[float]] = {case: [] for case in todo}
    directory = Path(tempfile.mkdtemp(prefix="nnxtron-data-bench-"))
    start = time.perf_counter()
    try:
        corpora = write_corpora(directory, documents, args.row_group)
        for _ in range(args.repeats):
            for case in todo:
                kind, tok, threads, prefetch = case
                times[case].append(tokens_per_second(corpora[kind], tokenizers[tok], args, threads, prefetch))
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    pipeline_seconds = time.perf_counter() - start
    train = train_demand(args.train_steps, args.train_set) if args.train_demand else None

    base = statistics.median(times[todo[0]])
    rows = []
    for case, values in times.items():
        kind, tok, threads, prefetch = case
        tps = statistics.median(values)
        rows.append({
            "format": kind, "tokenizer": tok, "read_threads": threads, "prefetch": prefetch, "baseline": case == todo[0],
            "tokens_per_s": tps, "tokens_per_s_runs": values, "ratio_vs_baseline": tps / base,
            "ratio_vs_train": tps / train["tokens_per_s"] if train else None,
        })  # fmt: skip
    result = {
        "benchmark": "data_pipeline",
        "machine": machine(),
        "corpus": {
            "source": f"{sysconfig.get_paths()['stdlib']}/*.py",
            "documents": len(documents),
            "bytes": sum(len(text.encode("utf-8")) for _, text in documents),
            "parquet_row_group": args.row_group,
        },
        "settings": {
            k: getattr(args, k) for k in ("seq_len", "batch", "batches", "warmup", "repeats", "tokenizer", "tokenizer_path")
        },
        "pipeline_seconds": pipeline_seconds,
        "train": train,
        "rows": rows,
    }
    m = result["machine"]
    print(
        f"machine: {m['platform']} ({m['processor']}), {m['usable_cpus']} of {m['cpu_count']} CPUs usable, "
        f"Python {m['python']}, grain {m['versions']['grain']}"
    )
    c = result["corpus"]
    print(
        f"corpus: {c['documents']} stdlib .py files, {c['bytes'] / 1e6:.2f} MB; rows of {args.seq_len} tokens, "
        f"{args.batch} per batch, {args.batches} timed batches after {args.warmup} warm-up, median of {args.repeats} runs"
    )
    if train:
        print(
            f"training demand: {train['model_name']} model ({train['params']:,} parameters, {train['global_batch']} x "
            f"{train['seq_len']} per step) on {train['backend']}: {train['tokens_per_s']:,.0f} tokens/s"
        )
    print()
    print(table(result))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    sys.stdout.flush()
    return result


if __name__ == "__main__":
    main()
