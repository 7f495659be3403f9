"""Break critical code on purpose and check that a test turns red (mutation check).

Each mutation replaces one snippet in one source file, runs the tests that must catch it,
and restores the file. A mutation that leaves the tests green is reported as SURVIVED,
the mutation score (killed / total) is printed and the script exits 1 unless every
mutant is killed. Run: ``.venv/bin/python tests/mutation/run.py [NAME ...]`` (several
minutes on 2 CPU cores; not part of the CI suite). Later features append mutants.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "nnxtron"


@dataclass(frozen=True)
class Mutation:
    name: str
    file: str
    old: str
    new: str
    tests: tuple[str, ...]


MUTATIONS = [
    Mutation("drop-attention-residual", "models/prenorm.py", "h = x + self.attention(", "h = 0 * x + self.attention(",
             ("tests/parity/test_hf_golden.py",)),
    Mutation("drop-mlp-residual", "models/prenorm.py", "y = h + self.mlp(", "y = self.mlp(",
             ("tests/parity/test_hf_golden.py",)),
    Mutation("skip-remat", "parallel/scan.py", "policy = jax_policy(spec)", "policy = None",
             ("tests/unit/test_scan.py",)),
    Mutation("ignore-segments", "layers/attention.py", "return visible[None] & same_segment", "return visible[None] | (same_segment & False)",
             ("tests/unit/test_masking.py",)),
    Mutation("ignore-sliding-window", "layers/attention.py", "if sliding_window > 0:", "if False:",
             ("tests/parity/test_hf_golden.py", "tests/unit/test_masking.py")),
    Mutation("skip-llama3-rope-scaling", "layers/rope.py", 'if spec.scaling == "llama3":', 'if spec.scaling == "none":',
             ("tests/parity/test_hf_golden.py",)),
    Mutation("zero-the-loss", "models/loss.py", "return jnp.sum(per_token * weights)", "return 0.0 * jnp.sum(per_token * weights)",
             ("tests/integration/test_train.py::test_training_on_a_tiny_corpus_reduces_the_loss",)),
    Mutation("ignore-loss-mask", "models/loss.py", "jnp.ones_like(per_token) if mask is None else mask.astype(jnp.float32)",
             "jnp.ones_like(per_token)", ("tests/unit/test_loss.py",)),
    Mutation("resume-drops-data-state", "train/loop.py", "if data_state is not None:", "if False:",
             ("tests/integration/test_train.py::test_resume_equals_an_uninterrupted_run",)),
    Mutation("checkpoint-without-data-state", "train/loop.py", '"data_state": data_states,', '"data_state": [{}],',
             ("tests/integration/test_train.py::test_resume_equals_an_uninterrupted_run",)),
    Mutation("rows-do-not-overlap", "data/stream.py", "self._offset -= 1  # a row's last token", "pass  # a row's last token",
             ("tests/unit/test_data_stream.py",)),
    Mutation("resume-forgets-offset", "data/stream.py", 'self._offset = int(state["offset"])', "self._offset = 0",
             ("tests/unit/test_data_stream.py",)),
    Mutation("resume-state-after-document", "data/stream.py", "self._before, self._doc, self._offset = before, tokens, 0",
             "self._before, self._doc, self._offset = self.documents.get_state(), tokens, 0", ("tests/unit/test_data_stream.py",)),
    Mutation("same-order-every-epoch", "data/stream.py", "ds = ds.repeat(epochs)", "ds = ds.repeat(epochs, reseed_each_epoch=False)",
             ("tests/unit/test_data_stream.py",)),
    Mutation("process-shards-overlap", "data/stream.py", "repeat(epochs)[process_index::process_count]", "repeat(epochs)[process_index:]",
             ("tests/unit/test_data_stream.py",)),
    Mutation("skipped-records-uncounted", "data/stream.py", 'self.counts["bad_records"] += 1', 'self.counts["bad_records"] += 0',
             ("tests/unit/test_data_stream.py", "tests/unit/test_data_formats.py")),
    Mutation("restart-skips-completeness-check", "train/loop.py", "except UnreadableCheckpoint as err:", "except ZeroDivisionError as err:",
             ("tests/integration/test_reliability.py::test_resume_skips_an_unreadable_latest_checkpoint",)),
    Mutation("unreadable-checkpoint-deleted", "train/checkpoint.py", "source.rename(target)", "__import__('shutil').rmtree(source)",
             ("tests/integration/test_reliability.py::test_resume_skips_an_unreadable_latest_checkpoint",)),
    Mutation("non-finite-guard-off", "train/step.py", "finite = jnp.isfinite(g.loss) & jnp.all(jnp.isfinite(squares))",
             "finite = jnp.isfinite(g.loss) | True", ("tests/integration/test_reliability.py",)),
    Mutation("skip-policy-applies-the-update", "train/step.py", 'if cfg.non_finite_policy == "skip":', "if False:",
             ("tests/integration/test_reliability.py::test_non_finite_step_is_skipped_with_policy_skip",)),
    Mutation("checkpoint-saved-before-the-guard", "train/loop.py", "recorder.flush()  # the guard sees this step first", "pass  # the guard sees this step first",
             ("tests/integration/test_reliability.py::test_non_finite_step_stops_and_keeps_the_last_checkpoint",)),
    Mutation("resumed-log-keeps-lost-steps", "train/metrics.py", "_truncate_after(self.path, start_step)", "pass",
             ("tests/integration/test_kill_resume.py", "tests/integration/test_reliability.py::test_resume_skips_an_unreadable_latest_checkpoint")),
    Mutation("every-process-logs", "train/loop.py", "silent = jax.process_index() != 0", "silent = False",
             ("tests/integration/test_multihost.py",)),
    Mutation("eval-split-ignores-fraction", "data/pipeline.py", "< eval_fraction * EVAL_BUCKETS", "< 0 * eval_fraction",
             ("tests/unit/test_data_stream.py",)),
    Mutation("drop-stack-axis-name", "parallel/scan.py", "return names[:axis] + (axis_name,) + names[axis:]", "return names",
             ("tests/unit/test_scan.py", "tests/parity/test_sharding_robustness.py")),
    Mutation("accumulation-skips-token-normalisation", "train/step.py", "grads = jax.tree.map(lambda a, p: (a / norm).astype(p.dtype), acc, params)",
             "grads = jax.tree.map(lambda a, p: (a / jnp.float32(batch[\"targets\"].size)).astype(p.dtype), acc, params)",
             ("tests/parity/test_grad_accumulation.py",)),
    Mutation("zero-aux-loss", "train/step.py", "total = loss_sum + sum(aux.values()) if aux else loss_sum", "total = loss_sum",
             ("tests/parity/test_grad_accumulation.py",)),
    Mutation("accumulation-drops-state-carry", "train/step.py", "return (acc, loss_sum + mb_loss, tokens + mb_tokens, aux_sum, rest), None",
             "return (acc, loss_sum + mb_loss, tokens + mb_tokens, aux_sum, carry[4]), None",
             ("tests/parity/test_grad_accumulation.py",)),
    Mutation("unrolled-layers-share-a-key", "parallel/scan.py", "make_block(nnx.Rngs(keys[i]))", "make_block(nnx.Rngs(keys[0]))",
             ("tests/parity/test_strategies.py::test_scan_and_unroll_build_identical_weights",)),
    Mutation("rules-shard-nothing", "parallel/sharding.py", "used.update(axes)", "used.update(axes); axes = ()",
             ("tests/parity/test_strategies.py::test_parameter_shardings_follow_the_rules",)),
    Mutation("no-weight-decay-mask", "train/optimizer.py", "len([n for n in variable_names(v) or () if not is_stack_axis(n)]) >= 2)", "True)",
             ("tests/unit/test_optimizer.py",)),
    # mixture of experts, DeepSeek-V3, multi-token prediction
    Mutation("zero-mtp-loss", "models/mtp.py", 'out: Aux = {"losses": {"mtp": self.scale * mtp_loss', 'out: Aux = {"losses": {"mtp": 0.0 * mtp_loss',
             ("tests/unit/test_mtp.py",)),
    Mutation("decoder-drops-mtp-losses", "models/decoder.py", 'out_aux["losses"] = sum_aux(out_aux["losses"], mtp.pop("losses"))', 'mtp.pop("losses")',
             ("tests/unit/test_mtp.py",)),
    Mutation("decoder-drops-stack-aux", "models/decoder.py", 'out_aux: dict[str, Any] = {"losses": sum_aux(*stack_aux)}', 'out_aux: dict[str, Any] = {"losses": {}}',
             ("tests/unit/test_decoder_aux.py",)),
    Mutation("drop-shared-expert", "layers/moe.py", "y = y + self.shared(x, intermediate)", "y = y", ("tests/unit/test_moe.py",)),
    Mutation("skip-bias-update", "train/step.py", "rest = update_router_bias(g.rest, cfg.routed_bias_update_rate) if", "rest = g.rest if False and",
             ("tests/integration/test_moe_training.py",)),
    Mutation("bias-update-sign", "layers/moe.py", "step = jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load)",
             "step = jnp.sign(load - jnp.mean(load, axis=-1, keepdims=True))", ("tests/unit/test_moe.py",)),
    Mutation("bias-ignored-in-selection", "layers/moe.py", 'bias = self.router_bias[...] if hasattr(self, "router_bias") else None', "bias = None",
             ("tests/parity/test_hf_golden.py",)),
    Mutation("no-group-limit", "layers/router.py", "if spec.n_groups > 0:", "if False:", ("tests/unit/test_router.py", "tests/parity/test_hf_golden.py")),
    Mutation("capacity-off", "layers/moe.py", "if factor <= 0:", "if True:", ("tests/unit/test_moe.py",)),
    Mutation("capacity-sequence-as-call", "layers/moe.py", "return int(max(math.ceil(seq * k / experts) * factor, factor))",
             "return math.ceil(factor * batch * seq * k / experts)", ("tests/unit/test_moe_capacity.py",)),
    Mutation("capacity-sequence-over-the-call", "layers/moe.py", 'if scope == "sequence":\n        return jax.vmap', 'if False:\n        return jax.vmap',
             ("tests/unit/test_moe_capacity.py",)),
    Mutation("maxtext-capacity-on-sparse-path", "config/maxtext_keys.py", 'if number(value, "capacity_factor") > 0 and not _sparse(ctx):',
             'if number(value, "capacity_factor") > 0:', ("tests/unit/test_moe_capacity.py",)),
    Mutation("matmul-precision-ignored", "models/decoder.py", 'if self.config.matmul_precision == "default":', "if True:",
             ("tests/unit/test_matmul_precision.py",)),
    Mutation("ep-no-expert-offset", "parallel/expert.py", "offset = jax.lax.axis_index(ep_name) * wi_0.shape[0] if ep_name is not None else 0",
             "offset = 0", ("tests/parity/test_expert_parallel.py",)),
    Mutation("unsort-wrong", "parallel/expert.py", "out = out[inverse]", "out = out[order]", ("tests/unit/test_moe.py",)),
    Mutation("dense-drops-routing-weights", "parallel/expert.py", "weights = jnp.where(keep, combine.astype(jnp.float32), 0.0)",
             "weights = jnp.where(keep, jnp.ones_like(combine, jnp.float32), 0.0)", ("tests/unit/test_moe_dense.py",)),
    Mutation("dense-ignores-capacity", "parallel/expert.py", "weights = jnp.where(keep, combine.astype(jnp.float32), 0.0)",
             "weights = combine.astype(jnp.float32)", ("tests/unit/test_moe_dense.py",)),
    Mutation("dense-path-never-taken", "parallel/expert.py", 'if compute == "dense":', "if False:", ("tests/unit/test_moe_dense.py",)),
    Mutation("dense-casts-weights-before-qwix", "parallel/expert.py", "    xw = x.astype(wi_0.dtype)",
             "    xw, wi_0, wi_1, wo = x, wi_0.astype(dtype), wi_1.astype(dtype), wo.astype(dtype)", ("tests/unit/test_moe_dense.py",)),
    Mutation("sparse-matmul-not-translated", "config/maxtext_keys.py", 'lambda v, c: {"moe_compute": "grouped" if v else "dense"}',
             "lambda v, c: {}", ("tests/unit/test_moe_dense.py",)),
    Mutation("yarn-softmax-mscale-dropped", "layers/mla.py", "self.scale = qk_dim**-0.5 * softmax_scale_multiplier(self.rope)", "self.scale = qk_dim**-0.5",
             ("tests/parity/test_hf_golden.py",)),
    Mutation("qk-norm-skipped", "layers/attention.py", "q, k = self.query_norm(q), self.key_norm(k)", "q, k = q, k",
             ("tests/parity/test_hf_golden.py",)),
    Mutation("dense-prefix-uses-moe", "config/layout.py", "moe = cfg.num_experts > 1 and i >= cfg.first_num_dense_layers and", "moe = cfg.num_experts > 1 and",
             ("tests/parity/test_hf_golden.py",)),
    # layer patterns (Gemma 3, Llama 4, GPT-3)
    Mutation("swap-local-global", "config/layout.py", 'attention = "global" if (i + 1) % cfg.sliding_window_pattern == 0 else "sliding"',
             'attention = "sliding" if (i + 1) % cfg.sliding_window_pattern == 0 else "global"', ("tests/parity/test_hf_golden.py::test_logits_match_hf[gemma3-scan]",)),
    Mutation("drop-remainder-block", "config/layout.py", "    if leftover:", "    if False:", ("tests/parity/test_hf_golden.py::test_logits_match_hf[gemma3-scan]",)),
    Mutation("rope-on-nope-layers", "layers/attention.py", "rope = RopeSpec.from_config(cfg, head_dim) if kind.rope else None",
             "rope = RopeSpec.from_config(cfg, head_dim)", ("tests/parity/test_hf_golden.py::test_logits_match_hf[llama4-scan]",)),
    Mutation("gemma-norm-forgets-one", "layers/norms.py", "(normed * (1.0 + self.scale[...].astype(jnp.float32)))",
             "(normed * self.scale[...].astype(jnp.float32))", ("tests/parity/test_hf_golden.py::test_logits_match_hf[gemma3-scan]",)),
    Mutation("ignore-chunks", "layers/attention.py", "if chunk_size > 0:", "if False:", ("tests/parity/test_hf_golden.py::test_logits_match_hf[llama4-scan]",)),
    Mutation("drop-l2-qk-norm", "layers/attention.py", "        if self.qk_norm == \"l2\":\n            q, k = l2_norm(q, self.norm_eps), l2_norm(k, self.norm_eps)\n",
             "", ("tests/parity/test_hf_golden.py::test_logits_match_hf[llama4-scan]",)),
    Mutation("no-temperature-tuning", "layers/attention.py", "        if self.temperature_tuning is not None:", "        if False:",
             ("tests/parity/test_hf_golden.py::test_logits_match_hf[llama4-scan]",)),
    Mutation("no-embedding-scale", "models/decoder.py", "        if self.embed_scale:", "        if False:", ("tests/parity/test_hf_golden.py::test_logits_match_hf[gemma3-scan]",)),
    Mutation("no-position-embeddings", "models/decoder.py", '        if hasattr(self, "position_embed"):', "        if False:",
             ("tests/parity/test_hf_golden.py::test_logits_match_hf[gpt2-scan]",)),
    Mutation("router-scales-output-not-input", "layers/moe.py", "combine, in_scale = jnp.ones_like(weights), weights",
             "combine, in_scale = weights, None", ("tests/parity/test_hf_golden.py::test_logits_match_hf[llama4-scan]",)),
    # DeepSeek-V4
    Mutation("drop-attention-sink", "models/deepseek4/compressed.py", "jnp.concatenate([logits, sinks], axis=-1)",
             "jnp.concatenate([logits, sinks * 0 - jnp.inf], axis=-1)", ("tests/parity/test_hf_golden.py::test_logits_match_hf[deepseek4-scan]",)),
    Mutation("skip-sinkhorn", "models/deepseek4/mhc.py", "comb = sinkhorn(comb_logits, self.iterations, self.eps)",
             "comb = jax.nn.softmax(comb_logits, axis=-1)", ("tests/parity/test_hf_golden.py::test_logits_match_hf[deepseek4-scan]",)),
    Mutation("optimizer-updates-tid2eid", "layers/moe.py", "class HashTable(nnx.Variable):", "class HashTable(nnx.Param):",
             ("tests/integration/test_family_training.py::test_deepseek4_trains_on_synthetic_data_and_keeps_its_hash_table",)),
    Mutation("misplaced-window-position", "models/deepseek4/compressed.py", "reshape(batch, n, m)[:, :, 0]  # the window's first",
             "reshape(batch, n, m)[:, :, -1]  # the window's first", ("tests/parity/test_hf_golden.py::test_logits_match_hf[deepseek4-scan]",)),
    Mutation("hash-routing-ignored", "layers/moe.py", "forced = jnp.take(self.tid2eid[...], tokens.reshape(-1), axis=0)",
             "forced = None", ("tests/parity/test_hf_golden.py::test_logits_match_hf[deepseek4-scan]",)),
    Mutation("csa-overlap-dropped", "models/deepseek4/compressed.py", "kv = jnp.concatenate([prev[0][..., :d], kv[..., d:]], axis=2)",
             "kv = jnp.concatenate([prev[0][..., :d] * 0, kv[..., d:]], axis=2)", ("tests/parity/test_hf_golden.py::test_logits_match_hf[deepseek4-scan]",)),
    Mutation("swiglu-clamp-dropped", "layers/mlp.py", "    if limit <= 0:", "    if True:", ("tests/parity/test_hf_golden.py::test_logits_match_hf[deepseek4-scan]",)),
    # pipeline parallelism
    Mutation("pipeline-cut-stage-shift", "parallel/pipeline.py", "shift = place(jnp.roll(sent, 1, axis=0))", "shift = place(jnp.roll(sent, 0, axis=0))",
             ("tests/unit/test_pipeline.py::test_non_trainable_state_mutated_in_a_stage_survives",
              "tests/parity/test_pipeline.py::test_pipeline_equals_the_sequential_model[gpipe_4_stages]")),
    Mutation("pipeline-drops-carried-state", "parallel/pipeline.py", "state = _write_back(state, repeat_ids, new_state, valid)", "state = state",
             ("tests/unit/test_pipeline.py::test_non_trainable_state_mutated_in_a_stage_survives",
              "tests/parity/test_pipeline.py::test_pipeline_equals_the_sequential_model[deepseek3_mtp_dense_prefix_outside]")),
    Mutation("pipeline-bubbles-mutate-state", "parallel/pipeline.py", "jnp.where(v, n.astype(ws.dtype), ws[r])", "n.astype(ws.dtype)",
             ("tests/unit/test_pipeline.py::test_non_trainable_state_mutated_in_a_stage_survives",)),
    Mutation("pipeline-no-per-stage-remat", "parallel/pipeline.py", 'layer_remat = remat if spec.remat_layers else RematSpec("none")',
             'layer_remat = RematSpec("none")', ("tests/unit/test_pipeline.py::test_per_stage_remat_is_in_the_program_only_when_enabled",)),
    Mutation("pipeline-reverse-circular-order", "parallel/pipeline.py",
             "staged = value.reshape(spec.repeats, spec.stages, spec.layers_per_stage, *value.shape[1:])",
             "staged = value.reshape(spec.stages, spec.repeats, spec.layers_per_stage, *value.shape[1:]).swapaxes(0, 1)",
             ("tests/parity/test_pipeline.py::test_pipeline_equals_the_sequential_model[circular_2_repeats]",)),
    Mutation("pipeline-aux-not-averaged", "parallel/pipeline.py", "aux = {name: value / micro for name, value in aux_sum.items()}",
             "aux = dict(aux_sum)", ("tests/parity/test_pipeline.py::test_pipeline_equals_the_sequential_model[moe_load_balance_loss]",)),
    Mutation("pipeline-ignores-iteration-remat-flag", "parallel/pipeline.py", "policy = jax_policy(remat) if spec.remat_iterations else None",
             "policy = jax_policy(remat)", ("tests/unit/test_pipeline.py::test_per_stage_remat_is_in_the_program_only_when_enabled",)),
    Mutation("pipeline-ignores-delay", "parallel/pipeline.py", "sent = y if delay == 1 else previous", "sent = y",
             ("tests/unit/test_pipeline.py::test_non_trainable_state_mutated_in_a_stage_survives",)),
    # quantized training
    Mutation("quantize-nothing", "models/build.py", "if not model.config.use_qwix_quantization:", "if True:",
             ("tests/unit/test_quant.py::test_quantized_matmuls_are_visible_in_the_gradient_jaxpr",
              "tests/parity/test_quantization.py::test_mode_against_float32")),
    Mutation("drop-backward-qtype", "models/quant.py", "bwd_qtype=backward,", "bwd_qtype=None,",
             ("tests/unit/test_quant.py::test_quantized_matmuls_are_visible_in_the_gradient_jaxpr",)),
    Mutation("quantize-activation-products", "models/quant.py",
             "return (flax_util.find_param(lhs) is not None) != (flax_util.find_param(rhs) is not None)", "return True",
             ("tests/unit/test_quant.py::test_quantized_matmuls_are_visible_in_the_gradient_jaxpr",)),
    Mutation("quantize-the-router", "models/quant.py", "return [qwix.QtRule(module_path=cfg.qwix_exclude_module_path), quantized]",
             "return [quantized]",
             ("tests/unit/test_quant.py::test_deepseek3_quantizes_mla_experts_and_mtp_but_not_router_embedding_or_head",)),
    Mutation("quantization-pass-mutates-state", "models/quant.py", "return nnx.merge(quantized_structure(model.config).graphdef, nnx.state(model))",
             "return qwix.quantize_model(model, WeightMatmulProvider(rules(model.config)), *_example_call(model.config)[0], "
             "methods=(QUANTIZED_METHOD,), **_example_call(model.config)[1])",
             ("tests/unit/test_quant.py::test_quantization_leaves_state_and_values_untouched",)),
    Mutation("quantized-traces-shared-across-configs", "models/quant.py", "module.quantization_pass = pass_id", "pass",
             ("tests/unit/test_quant.py::test_configs_in_one_process_never_share_a_quantized_trace",)),
    # KV-cached decoding
    Mutation("cache-position-off-by-one", "layers/kv_cache.py", "self.positions[...] = self.positions[...].at[rows, slots].set(positions,",
             "self.positions[...] = self.positions[...].at[rows, slots].set(positions - 1,",
             ("tests/parity/test_kv_cache.py::test_cached_logits_equal_the_full_forward[llama3.1-tiny]",)),
    Mutation("cache-ring-does-not-wrap", "layers/kv_cache.py", "slots = jnp.where(keep, positions % self.size, self.size)",
             "slots = jnp.where(keep, jnp.minimum(positions, self.size - 1), self.size)",
             ("tests/parity/test_kv_cache.py::test_cached_logits_equal_the_full_forward[mistral-tiny]",)),
    Mutation("cache-mask-ignores-window", "layers/kv_cache.py", "    if sliding_window > 0:\n        visible = visible & (pq - pk",
             "    if False:\n        visible = visible & (pq - pk",
             ("tests/parity/test_kv_cache.py::test_cached_logits_equal_the_full_forward[gemma3-tiny]",)),
    Mutation("cache-keeps-padding", "layers/kv_cache.py", "keep = valid & (positions > latest - self.size)", "keep = positions > latest - self.size",
             ("tests/parity/test_kv_cache.py::test_cached_logits_equal_the_full_forward[llama3.1-tiny]",)),
    Mutation("decode-position-off-by-one", "infer/decode.py", "positions = (lengths + i)[:, None]", "positions = (lengths + i + 1)[:, None]",
             ("tests/parity/test_kv_cache.py::test_decoding_loop_logits_equal_the_full_forward",)),
    Mutation("compressor-misses-window-completed-by-first-new-token", "models/deepseek4/compressed.py",
             "(window_end >= first[:, None])", "(window_end > first[:, None])",
             ("tests/parity/test_kv_cache.py::test_cached_logits_equal_the_full_forward[deepseek4-test]",)),
    Mutation("csa-buffer-forgets-previous-window", "models/deepseek4/compressed.py",
             "slots = (2 if self.overlap else 1) * self.ratio", "slots = self.ratio",
             ("tests/parity/test_kv_cache.py::test_cached_logits_equal_the_full_forward[deepseek4-test]",)),
    Mutation("stale-compressor-buffer", "models/deepseek4/compressed.py",
             'tokens, token_positions = buffer.extend({"kv": kv.astype(jnp.float32), "gate": gate}, positions, valid)',
             'tokens, token_positions = buffer.extend({"kv": kv.astype(jnp.float32), "gate": gate}, positions, valid)\n'
             '        buffer.positions[...] = jnp.full_like(buffer.positions[...], -1)',
             ("tests/parity/test_kv_cache.py::test_cached_logits_equal_the_full_forward[deepseek4-test]",)),
    Mutation("indexer-ties-in-reverse-window-order", "models/deepseek4/compressed.py",
             "window = ((last + 1) // m - count)[:, None] + jnp.arange(count)[None, :]",
             "window = ((last + 1) // m - 1)[:, None] - jnp.arange(count)[None, :]",
             ("tests/parity/test_kv_cache.py::test_cached_logits_equal_the_full_forward[deepseek4-test]",)),
    # performance (issue 12): attention implementations and the persistent compilation cache
    Mutation("dot-product-attention-ignores-segments", "layers/attention.py",
             "mask = attention_mask(segment_ids, sliding_window, chunk_size)[:, None]",
             "mask = attention_mask(jnp.ones_like(segment_ids), sliding_window, chunk_size)[:, None]",
             ("tests/unit/test_attention_impl.py",)),
    Mutation("auto-attention-never-picks-cudnn", "layers/attention.py",
             'return "cudnn" if backend == "gpu" and fits is None else "xla"', 'return "xla"',
             ("tests/unit/test_attention_impl.py",)),
    Mutation("attention-option-not-passed-to-layers", "layers/attention.py",
             'implementation=configured_attention(cfg, chunked=kind.attention == "chunked"),', 'implementation="xla",',
             ("tests/unit/test_attention_impl.py",)),
    Mutation("trainer-without-compilation-cache", "train/loop.py",
             "self.compilation_cache = enable_compilation_cache(cfg)", "self.compilation_cache = None",
             ("tests/integration/test_compile_cache.py",)),
    Mutation("cache-directory-never-moves", "runtime/compile_cache.py", "    compilation_cache.reset_cache()", "    pass",
             ("tests/integration/test_compile_cache.py",)),
    # run integrity (issue 22): finite state, verified checkpoints, the run lock, the fingerprint
    Mutation("guard-ignores-the-updated-state", "train/step.py", "finite = gradients_finite & state_finite", "finite = gradients_finite",
             ("tests/integration/test_reliability.py::test_an_update_that_makes_the_state_non_finite_is_caught",)),
    Mutation("restore-not-verified", "train/checkpoint.py", "        self._verify(step, meta, arrays)", "        pass",
             ("tests/integration/test_reliability.py::test_a_damaged_checkpoint_is_detected_and_the_run_stays_exact",)),
    Mutation("second-writer-not-refused", "train/run_dir.py", "fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)", "pass",
             ("tests/integration/test_run_integrity.py::test_a_run_held_by_another_writer_is_refused_and_untouched",)),
    Mutation("fingerprint-misses-a-key", "config/fingerprint.py", "if MODEL_KEY in field.metadata)",
             'if MODEL_KEY in field.metadata and name != "rope_max_timescale")',
             ("tests/integration/test_run_integrity.py::test_resume_with_another_model_is_refused",)),
    # real models end to end (issue 23): the tokenizer travels, text streams right, schedules and mixtures
    Mutation("hf-directory-tokenizer-ignored", "convert/hf.py", "**tokenizer_values(root, overrides), **overrides}",
             "**overrides}",
             ("tests/integration/test_finetune.py::test_generate_on_an_hf_directory_uses_its_sentencepiece_model",)),
    Mutation("run-ignores-its-tokenizer-copy", "config/loader.py", 'values["tokenizer_path"] = str(run_dir / RUN_TOKENIZER_DIR)',
             "pass", ("tests/integration/test_finetune.py::test_convert_carries_the_tokenizer_into_the_run",)),
    Mutation("stream-emits-unsettled-space", "data/detokenize.py", "settled = text.rstrip()", "settled = text",
             ("tests/unit/test_tokenizer_travel.py",)),
    Mutation("failed-start-leaves-its-directory", "train/loop.py", "remove_unused_run_dir(self.run_dir)", "pass",
             ("tests/integration/test_finetune.py::test_fine_tune_an_hf_model_in_one_command",)),
    Mutation("schedule-change-not-said", "train/schedules.py", "if shape(old_cfg, old_derived) == shape(cfg, derived):",
             "if True:", ("tests/integration/test_schedule_resume.py",)),
    Mutation("mixture-ignores-weights", "data/mixture.py", "self.weights = tuple(w / total for w in weights)",
             "self.weights = tuple(1 / len(weights) for w in weights)", ("tests/unit/test_data_mixture.py",)),
    Mutation("mixture-position-not-restored", "data/mixture.py", "        self.done = done", "        self.done = 0",
             ("tests/unit/test_data_mixture.py",)),
    Mutation("wandb-new-run-on-resume", "train/wandb_logger.py", "id=run_id(run_dir),", "id=None,",
             ("tests/integration/test_wandb.py::test_wandb_logs_the_metrics_and_a_resumed_run_continues_it",)),
    # dropout (issue 24): masks are a function of (seed, step, row, layer, site), the same under every strategy
    Mutation("dropout-same-mask-every-layer", "parallel/scan.py", "keys = None if block_id is None else fold(dropout_keys, block_id)",
             "keys = None if block_id is None else dropout_keys", ("tests/parity/test_dropout.py::test_each_layer_and_row_draws_its_own_mask",)),
    Mutation("dropout-same-mask-every-step", "parallel/row_keys.py", "jax.random.key(seed), STREAM), step)", "jax.random.key(seed), STREAM), 0)",
             ("tests/parity/test_dropout.py::test_dropout_changes_the_step_and_each_step_draws_new_masks",)),
    Mutation("dropout-same-mask-every-row", "parallel/row_keys.py", "jax.random.fold_in(step_key, row)", "jax.random.fold_in(step_key, 0 * row)",
             ("tests/parity/test_dropout.py::test_each_layer_and_row_draws_its_own_mask",)),
    Mutation("dropout-pipeline-ignores-the-repeat", "parallel/pipeline.py", "((repeat_ids * stages + stage_ids) * lps)", "(stage_ids * lps)",
             ("tests/parity/test_dropout.py::test_pipeline_equals_the_sequential_model",)),
    Mutation("dropout-tail-stack-restarts-the-blocks", "parallel/scan.py", "return self.first_block + jnp.arange(", "return 0 * self.first_block + jnp.arange(",
             ("tests/parity/test_dropout.py::test_partial_pipeline_tail_stack_continues_the_block_indices",)),
    Mutation("dropout-not-in-mtp", "models/mtp.py", "keys = fold(dropout_keys, k)", "keys = None",
             ("tests/parity/test_dropout.py::test_the_mtp_depths_drop_with_their_own_masks",)),
    Mutation("dropout-not-on-mlp-activations", "models/prenorm.py", "intermediate = dropout.site_dropout(",
             "intermediate = None and dropout.site_dropout(", ("tests/parity/test_dropout.py::test_each_family_block_drops_its_output_and_its_mlp_activations",)),
    Mutation("dropout-not-on-layer-output", "models/prenorm.py", "return dropout.dropout(y, dropout_keys, self.dropout_rate, dropout.LAYER_OUTPUT)",
             "return y", ("tests/parity/test_dropout.py::test_each_family_block_drops_its_output_and_its_mlp_activations",)),
    Mutation("dropout-not-on-embeddings", "models/decoder.py", "x = dropout.dropout(x, dropout_keys, self.config.dropout_rate, dropout.EMBED)",
             "pass", ("tests/parity/test_dropout.py::test_the_embeddings_and_the_final_hidden_states_are_dropped",)),
    Mutation("dropout-not-before-the-head", "models/decoder.py", "x = dropout.dropout(self.final_norm(x), dropout_keys, self.config.dropout_rate, dropout.HEAD)",
             "x = self.final_norm(x)", ("tests/parity/test_dropout.py::test_the_embeddings_and_the_final_hidden_states_are_dropped",)),
    Mutation("dropout-in-eval", "train/step.py", 'keys = batch.get("dropout_keys")  #', 'keys = batch.get("dropout_keys", row_keys(0, 0, batch["inputs"].shape[0]))  #',
             ("tests/parity/test_dropout.py::test_eval_and_generation_do_not_drop",)),
    # MaxText step for step (issue 24): a MaxText config makes nnxtron follow MaxText's optimizer and model
    Mutation("maxtext-decay-on-matrices-only", "config/maxtext.py", '"weight_decay_mask": "all",', '"weight_decay_mask": "matrices",',
             ("tests/parity/test_maxtext_reproduction.py::test_the_final_parameters_are_maxtexts",)),
    Mutation("maxtext-optax-schedule", "config/maxtext.py", '"lr_schedule_convention": "maxtext",', '"lr_schedule_convention": "nnxtron",',
             ("tests/parity/test_maxtext_reproduction.py::test_the_loss_curve_reproduces_maxtexts",)),
    Mutation("maxtext-load-balance-nnxtrons", "config/maxtext.py", '"load_balance_convention": "maxtext",',
             '"load_balance_convention": "nnxtron",', ("tests/parity/test_maxtext_reproduction.py::test_the_loss_curve_reproduces_maxtexts",)),
    Mutation("maxtext-load-balance-sums-layers", "layers/router.py", "return 0.0 if hash_routed else weight / load_balance_layers(cfg)",
             "return 0.0 if hash_routed else weight", ("tests/unit/test_load_balance.py",)),
    Mutation("maxtext-load-balance-pooled", "layers/router.py", "return sequence_load_balance_loss(indices, probs, dtype)",
             "return call_load_balance_loss(indices, probs)", ("tests/unit/test_load_balance.py",)),
    Mutation("maxtext-query-scaled", "config/maxtext_keys.py", '{"query_pre_attn_scalar": 1.0} if unscaled else {}', "{}",
             ("tests/parity/test_maxtext_reproduction.py::test_the_final_parameters_are_maxtexts",)),
    Mutation("mtp-skips-its-final-norm", "models/mtp.py", "head(dropout.dropout(depth.final_norm(h), keys,", "head(dropout.dropout(h, keys,",
             ("tests/parity/test_maxtext_reproduction.py::test_the_final_parameters_are_maxtexts",)),
    # MaxText checkpoints in and out (issue 24): the scan axis and the value conventions
    Mutation("maxtext-scan-axis-0", "convert/maxtext_tree.py", "PARAM_SCAN_AXIS = 1", "PARAM_SCAN_AXIS = 0",
             ("tests/unit/test_maxtext_checkpoint.py::test_reference_checkpoints_give_maxtexts_logits_and_round_trip",)),
    Mutation("maxtext-query-not-rescaled", "convert/maxtext_tree.py",
             "out = x * np.float32(factor) if forward else x / np.float32(factor)", "out = x if forward else x / np.float32(factor)",
             ("tests/unit/test_maxtext_checkpoint.py::test_hf_meaning_query_kernels_give_the_same_logits",)),
    Mutation("maxtext-gemma-norm-not-recentred", "convert/maxtext_tree.py",
             "out = x - np.float32(1.0) if forward else x + np.float32(1.0)", "out = x if forward else x + np.float32(1.0)",
             ("tests/unit/test_maxtext_checkpoint.py::test_gemma3_logits_are_close_to_maxtexts",)),
]  # fmt: skip


def run(mutation: Mutation) -> bool:
    """True if the tests caught the mutation."""
    path = SRC / mutation.file
    original = path.read_text()
    if original.count(mutation.old) != 1:
        raise SystemExit(f"{mutation.name}: snippet not found exactly once in {mutation.file}")
    path.write_text(original.replace(mutation.old, mutation.new))
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *mutation.tests],
            cwd=ROOT, capture_output=True, text=True,
        )  # fmt: skip
    finally:
        path.write_text(original)
    return proc.returncode != 0


def main(names: list[str]) -> int:
    chosen = [m for m in MUTATIONS if not names or m.name in names]
    survived = []
    for mutation in chosen:
        caught = run(mutation)
        print(f"{'caught  ' if caught else 'SURVIVED'} {mutation.name}", flush=True)
        if not caught:
            survived.append(mutation.name)
    killed = len(chosen) - len(survived)
    print(f"mutation score: {killed}/{len(chosen)} killed" + (f"; survived: {', '.join(survived)}" if survived else ""))
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
