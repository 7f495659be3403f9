"""nnxtron models in EleutherAI's ``lm-eval`` harness: its ``LM`` interface over
``infer.score`` (log-likelihoods) and ``infer.decode`` (greedy generation).

- ``loglikelihood``: ``(context, continuation)`` -> (sum of the continuation tokens'
  log-probabilities given the context, whether greedy decoding would produce exactly them).
  The pair is tokenized as HF's ``HFLM`` does: trailing whitespace of the context moves to
  the continuation, the whole is tokenized once and the continuation is what follows the
  context's tokens; BOS (``add_bos``) is prepended. A sequence longer than ``max_length``
  + 1 keeps its last tokens.
- ``loglikelihood_rolling``: a whole text's log-likelihood, scored in windows of
  ``max_length`` (the harness's disjoint rolling windows), every token predicted once.
- ``generate_until``: greedy decoding of up to ``max_gen_toks`` tokens, cut before the first
  of the ``until`` strings (EOS also stops). A request for sampling (``do_sample`` or a
  temperature > 0) is refused: this adapter decodes greedily.

Requests are scored in batches of ``batch_size`` rows padded to a power-of-two length
(one compile per length bucket). ``lm-eval`` is an optional dependency (``nnxtron[lmeval]``).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import numpy as np
from flax import nnx

from nnxtron.data.sources import tokenizer_for
from nnxtron.data.tokenizer import Tokenizer
from nnxtron.errors import DataError, UserError
from nnxtron.infer.decode import bucket, decode
from nnxtron.infer.score import score_tokens

try:
    from lm_eval import utils as lm_eval_utils
    from lm_eval.api.model import LM
    from lm_eval.api.task import Task
except ImportError as err:  # pragma: no cover - exercised by the CLI's message
    raise UserError("the lm-eval adapter needs the lm-eval package: pip install 'nnxtron[lmeval]'") from err

__all__ = ["NnxtronLM"]


class NnxtronLM(LM):
    """``lm_eval.api.model.LM`` over an nnxtron model (``convert.runs.load_model``)."""

    def __init__(self, model: nnx.Module, batch_size: int = 8, max_length: int | None = None) -> None:
        super().__init__()
        if batch_size < 1:
            raise UserError(f"--batch-rows must be at least 1, got {batch_size}")
        self.model, self.cfg = model, model.config
        self.batch_size = int(batch_size)
        self.max_length = int(max_length or self.cfg.max_target_length)

    @functools.cached_property
    def tokenizer(self) -> Tokenizer:
        """The model's tokenizer (read when text is first encoded: token-level requests need none)."""
        return tokenizer_for(self.cfg)

    @functools.cached_property
    def prefix(self) -> list[int]:
        """BOS, when the model's config adds one."""
        return [self.tokenizer.bos_id] if self.cfg.add_bos and self.tokenizer.bos_id >= 0 else []

    @functools.cached_property
    def start(self) -> list[int]:
        """The token that starts a text with no context (HFLM's prefix token): BOS, else EOS."""
        if self.tokenizer.bos_id >= 0:
            return [self.tokenizer.bos_id]
        return [self.tokenizer.eos_id] if self.tokenizer.eos_id >= 0 else []

    # ------------------------------------------------------------------ log-likelihoods
    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """(context ids, continuation ids) of a request, tokenized as HF's ``HFLM`` does."""
        if not context:  # as HFLM: the start token alone is the context
            return self.start, self.tokenizer.encode(continuation).tolist()
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole = self.prefix + self.tokenizer.encode(context + continuation).tolist()
        context_ids = self.prefix + self.tokenizer.encode(context).tolist()
        return whole[: len(context_ids)], whole[len(context_ids) :]

    def loglikelihood(self, requests: Sequence[Any]) -> list[tuple[float, bool]]:
        pairs = [self.encode_pair(*request.args) for request in requests]
        for context, continuation in pairs:
            if not continuation:
                raise UserError("an lm-eval request has an empty continuation: there is nothing to score")
            if not context:
                raise UserError("an lm-eval request has an empty context and the tokenizer has neither BOS nor EOS to start it")
        return self.loglikelihood_tokens(pairs)

    def loglikelihood_tokens(self, pairs: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[tuple[float, bool]]:
        """(log-likelihood, greedy) of each continuation given its context, both token ids."""
        rows = []
        for context, continuation in pairs:
            if len(continuation) > self.max_length:
                raise UserError(
                    f"an lm-eval continuation of {len(continuation)} tokens is longer than the context "
                    f"(max_length {self.max_length}); raise max_target_length"
                )
            tokens = (list(context) + list(continuation))[-(self.max_length + 1) :]
            rows.append((tokens, len(continuation)))
        results: list[tuple[float, bool]] = []
        for start in range(0, len(rows), self.batch_size):
            chunk = rows[start : start + self.batch_size]
            logprobs, greedy, targets = self._score([tokens for tokens, _ in chunk])
            for row, (tokens, scored) in enumerate(chunk):
                end = len(tokens) - 1  # targets 0 .. end-1 predict tokens 1 .. end
                window = slice(end - scored, end)
                total = float(np.sum(logprobs[row, window], dtype=np.float64))
                results.append((total, bool(np.all(greedy[row, window] == targets[row, window]))))
        return results

    def loglikelihood_rolling(self, requests: Sequence[Any]) -> list[float]:
        results = []
        for request in requests:
            (text,) = request.args[:1]
            ids = self.tokenizer.encode(text).tolist()
            if not ids:
                results.append(0.0)
                continue
            if not self.start:
                raise UserError("rolling log-likelihoods need a start token; the tokenizer has neither BOS nor EOS")
            prefix = self.start[0]
            windows = [
                lm_eval_utils.make_disjoint_window(window)
                for window in lm_eval_utils.get_rolling_token_windows(ids, prefix, self.max_length, context_len=1)
            ]
            results.append(sum(score for score, _ in self.loglikelihood_tokens(windows)))
        return results

    def _score(self, rows: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per-target log-probabilities, greedy choices and targets of right-padded rows."""
        length = min(bucket(max(len(tokens) for tokens in rows) - 1), self.max_length)
        inputs = np.zeros((self.batch_size, length), np.int32)
        targets = np.zeros_like(inputs)
        segments = np.zeros_like(inputs)
        for row, tokens in enumerate(rows):
            n = len(tokens) - 1
            inputs[row, :n], targets[row, :n], segments[row, :n] = tokens[:-1], tokens[1:], 1
        positions = np.broadcast_to(np.arange(length, dtype=np.int32), inputs.shape).copy()
        batch = {"inputs": inputs, "targets": targets, "positions": positions, "segment_ids": segments}
        logprobs, greedy = score_tokens(self.model, batch)
        return logprobs, greedy, targets

    # ------------------------------------------------------------------ generation
    def generate_until(self, requests: Sequence[Any]) -> list[str]:
        results = []
        for request in requests:
            context, options = request.args[0], dict(request.args[1] if len(request.args) > 1 else {})
            if options.get("do_sample") or float(options.get("temperature", 0.0) or 0.0) > 0:
                raise UserError(
                    "an lm-eval task asks for sampling (do_sample / temperature > 0); nnxtron's adapter decodes greedily: "
                    "pass --gen-kwargs temperature=0 or choose a task that generates greedily"
                )
            until = options.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            limit = int(options.get("max_gen_toks", 256))
            if limit < 1 or limit >= self.max_length:
                raise UserError(
                    f"an lm-eval task asks for max_gen_toks={limit}; it must be in [1, {self.max_length - 1}] (max_length)"
                )
            prompt = (self.prefix + self.tokenizer.encode(context).tolist())[-(self.max_length - limit) :]
            tokens: list[int] = []
            stops = [self.tokenizer.eos_id] if self.tokenizer.eos_id >= 0 else []
            for step, done in decode(self.model, [prompt], limit, lambda logits: np.argmax(logits, axis=-1), stops):
                if done[0] or int(step[0]) in stops:
                    break
                tokens.append(int(step[0]))
                if until and any(stop in self.tokenizer.decode(tokens) for stop in until):
                    break
            text = self.tokenizer.decode(tokens)
            cut = min((text.index(stop) for stop in until if stop in text), default=len(text))
            results.append(text[:cut])
        return results


def evaluate_tasks(
    model: nnx.Module,
    tasks: Sequence[str],
    include_path: str | None = None,
    limit: int | None = None,
    num_fewshot: int | None = None,
    batch_size: int = 8,
) -> dict[str, dict[str, float]]:
    """Run lm-eval ``tasks`` (its own, or task YAML files under ``include_path``) on ``model``:
    ``{task: {metric: value}}`` as the harness reports them."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=include_path) if include_path else TaskManager()
    unknown = [task for task in tasks if task not in manager.all_tasks]
    if unknown:
        where = f" or under --include-path {include_path}" if include_path else ""
        raise UserError(
            f"unknown lm-eval task {', '.join(repr(t) for t in unknown)}: not one of the harness's tasks{where}; "
            "list them with `lm-eval ls tasks`"
        )
    try:
        out = simple_evaluate(
            model=NnxtronLM(model, batch_size=batch_size), tasks=list(tasks), num_fewshot=num_fewshot, limit=limit,
            task_manager=manager, log_samples=False, bootstrap_iters=0,
        )  # fmt: skip
    except OSError as err:  # a task's dataset: not downloadable (offline), not found, not readable
        known = _dataset_error(err)
        if known is None:
            raise
        raise known from None
    return {
        task: {metric: float(value) for metric, value in metrics.items() if isinstance(value, (int, float))}
        for task, metrics in out["results"].items()
    }


def _dataset_error(err: OSError) -> UserError | None:
    """The one line for an error raised while a harness task loads its dataset (a ``Task`` of
    lm-eval's is on the traceback: the task and its ``dataset_path`` are named); None: the
    error came from elsewhere."""
    task = None
    frame = err.__traceback__
    while frame is not None:
        candidate = frame.tb_frame.f_locals.get("self")
        task = candidate if isinstance(candidate, Task) else task
        frame = frame.tb_next
    if task is None:
        return None
    config = getattr(task, "config", None)
    name = getattr(config, "task", None) or type(task).__name__
    dataset = f" '{config.dataset_path}'" if getattr(config, "dataset_path", None) else ""
    reason = (str(err).strip().splitlines() or [type(err).__name__])[0][:300]
    local = "or run a task of your own over local files with --include-path DIR (docs/post-training.md)"
    if isinstance(err, ConnectionError):
        return DataError(
            f"lm-eval task '{name}' needs its dataset{dataset} downloaded from the HF Hub, which cannot be reached "
            f"({reason}); run it once with network access (the HF datasets cache then serves it offline), {local}"
        )
    return DataError(
        f"lm-eval task '{name}' cannot load its dataset{dataset} ({reason}); check the task's dataset_path and "
        f"dataset_kwargs, {local}"
    )
