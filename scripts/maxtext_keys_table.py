"""Write docs/maxtext.md from the MaxText key table (src/nnxtron/config/maxtext_keys.py).

    python scripts/maxtext_keys_table.py          # rewrite docs/maxtext.md
    python scripts/maxtext_keys_table.py --check  # exit 1 when docs/maxtext.md is out of date

tests/unit/test_maxtext_config.py runs the check, so the page and the table cannot drift.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

from nnxtron.config.maxtext_keys import HONOURED, IGNORED, KEYS, KINDS, MAXTEXT_VERSION, NOT_IN_BASE, REFUSED, TRANSLATED

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "maxtext.md"

INTRO = f"""# MaxText configs in nnxtron

nnxtron reads MaxText {MAXTEXT_VERSION}'s config files and `key=value` arguments:

```
nnxtron train path/to/maxtext/configs/base.yml model_name=deepseek3-tiny steps=20 ...
nnxtron config show path/to/maxtext/configs/base.yml ...   # the resolved config, ignored keys in a comment block
```

**What is a MaxText config.** A YAML file with a `base_config:` key, or one that holds a key of
the table below that nnxtron's schema does not have. `base_config:` is followed as MaxText's
pyconfig does (a relative path is relative to the file's directory; the child's keys win).

**Which values apply.** A MaxText config means MaxText's values: every key of MaxText's
`base.yml` starts at MaxText's default (so `dtype=bfloat16`, `remat_policy=full`,
`per_device_batch_size=12` ... where nnxtron's own base.yml says otherwise), then the files,
then the command line. `model_name` selects nnxtron's preset of that name (the presets carry
MaxText's model names), which overrides the files as MaxText's model configs do — except
`dtype`, which MaxText's model configs leave to the config file. A command-line key that the
preset sets to another value is an error unless `override_model_config=true` (MaxText's rule;
in nnxtron the preset's keys stand for MaxText's model config). nnxtron-only keys keep
nnxtron's defaults, except `sample_after_training=0` (MaxText's trainer samples nothing), and
may be set in the file or on the command line. Without a MaxText config file, MaxText-only keys
on the command line are handled by the same table; keys both have keep nnxtron's meaning.

**The four classes.**

- **honoured** — the same name and meaning in nnxtron; the value is passed on.
- **translated** — the value becomes nnxtron key(s): another name, or MaxText's sentinel for
  "unset" (`-1`, `None`, `""`) mapped to nnxtron's; some values are refused (said in the row).
- **ignored** — MaxText infrastructure nnxtron does not have (cloud storage, profilers, metrics
  upload, serving), or a kernel / sharding / remat choice that computes the same function.
  Accepted with any value, never silently: `nnxtron train` lists them at start-up by name,
  grouped by the reason they are ignored (the first clause of the reason in the table below),
  with the values set otherwise than MaxText's default, in lines of at most 80 columns;
  `nnxtron config show` lists them with their values and whole reasons in a comment block.
  On MoE models the start-up also says which
  path runs: `sparse_matmul` is translated to nnxtron's `moe_compute` — `true` (MaxText's default)
  runs a dropless `jax.lax.ragged_dot` grouped matmul, `false` every expert on every token with
  einsums (MaxText's `dense_matmul`, the only path that reads `capacity_factor`) — on every backend,
  CPU included; `megablox` is ignored (no Pallas kernel: on CPU the path that runs is the one
  `sparse_matmul` selects). Both compute the same function; dense is `E / k` times the FLOPs but
  plain batched matmuls, several times faster on CPU, where `ragged_dot` has no grouped kernel.
  Quantized (`use_qwix_quantization`), each path is quantized as MaxText's path of the same name:
  qwix's `ragged_dot` scales each expert weight per output channel shared by all experts, its
  `einsum` per expert and output channel.
- **refused** — a value whose computation nnxtron does not implement is one `error:` line (exit
  2) naming the key, why, and what to use. MaxText's default is accepted (the feature is off),
  as are the values listed under "accepted", and any value while the key that reads it is off.

The data pipelines are nnxtron's own: with real data the documents come in another order than
MaxText's Grain pipeline gives them; with the same batches and weights nnxtron reproduces
MaxText's training step for step (next section).
"""

SEMANTICS = """## MaxText vs HF semantics

nnxtron's models follow HuggingFace's semantics (parameters keep HF meaning). Where MaxText 0.2.5
computes another function, a MaxText config makes nnxtron compute MaxText's, through config
values `nnxtron config show` prints; with MaxText's checkpoint and batches nnxtron then gives
MaxText's logits, loss curve (MTP loss included) and final parameters after 20 steps
(`tests/parity/test_maxtext_reproduction.py`; MaxText's runs and the measured differences:
`tests/assets/maxtext/reference/README.md`).

| what | MaxText 0.2.5 | HF / nnxtron otherwise | under a MaxText config |
|---|---|---|---|
| attention logits (`decoder_block` llama2, mistral, mixtral, no qk-norm) | `softmax(q.k)`: `1/sqrt(head_dim)` is folded into the query kernel's initialiser | `softmax(q.k / sqrt(head_dim))` | `query_pre_attn_scalar=1` (with `decoder_block`); a MaxText query kernel is used as it is |
| RoPE pairs | the default RoPE rotates halves whatever `rope_interleave` says (only YaRN reads it); llama3.1 RoPE rotates adjacent pairs | per family (`rope_interleave`) | `rope_interleave` translated so |
| MoE top-k weights | softmax over the top-k logits (renormalised) whatever `norm_topk_prob` says; DeepSeek renormalises sigmoid scores | `norm_topk_prob` | `norm_topk_prob` translated so |
| weight decay | every parameter (`adamw_mask=[]`), norm scales included | matrices only | `weight_decay_mask=all` |
| learning-rate schedule | warm-up `int(fraction * steps)`; the cosine (and WSD decay) reaches its final value at the schedule's last step; 0 after `learning_rate_schedule_steps` | optax's: the final value one step later, kept after the schedule | `lr_schedule_convention=maxtext` |
| MTP logits | each depth has its own output norm (`mtp_k_final_norm`, DeepSeek-V3's `shared_head.norm`) before the shared LM head | (HF has no MTP) | the same in nnxtron (`mtp/depths/k/final_norm`) |
| tied output head (`logits_via_embedding`) | `x @ bf16(E)^T` (`attend_on_embedding` casts the table to bfloat16 whatever `dtype` is), then `/ sqrt(emb_dim)` in `dtype` with `normalize_embedding_logits` (base.yml: `true`); the table starts standard normal | HF: `x @ E^T`; nnxtron: `x @ E^T / sqrt(emb_dim)` with `normalize_embedding_logits=true`, its default `false` (HF's head; the table then starts at std `1 / sqrt(emb_dim)`, docs/init.md) | `tied_head_bf16=true` (the table, times Gemma's `sqrt(emb_dim)`, rounded to bfloat16), `normalize_embedding_logits` as the config says (base.yml's `true`; `false` for `gpt3-*`, `qwen2.5-*` and `qwen3-0.6b` / `qwen3-8b`, whose MaxText model configs set it): MaxText's logits and initialiser (`tests/assets/maxtext/reference/llama2_tied`) |
| Gemma / Gemma 2 / Gemma 3 embedding scale | `sqrt(emb_dim)` is folded into the table (no input scale); the tied logits divide by it (`normalize_embedding_logits=true`) | the input is scaled by `sqrt(emb_dim)`, the head is `x @ E^T` | the checkpoint table is converted (nnxtron's = MaxText's / `sqrt(emb_dim)`); `normalize_embedding_logits=true` (the Gemma, Gemma 2 and Gemma 3 presets') is then HF's head, `false` MaxText's logits times `sqrt(emb_dim)` |
| Gemma 3 query scale | derived from the sizes: `head_dim ** -0.5` (gemma3-4b, 12b), `(emb_dim // query heads) ** -0.5` (27b) | `query_pre_attn_scalar` as stated (the presets: 256, 256, 168) | with `override_model_config=true` or an overridden `head_dim` / `base_emb_dim` / `base_num_query_heads`, `query_pre_attn_scalar` is derived so (a stated `query_pre_attn_scalar` wins) |
| Gemma 2 layers | one MaxText layer is a (sliding, global) pair: `base_num_decoder_layers` counts pairs (gemma2-2b: 13), the checkpoint names `layers_{p}/..._local` / `..._global`; the query kernel folds `head_dim ** -0.5`, also for gemma2-27b | 26 layers, `layer_types` alternating; 27b's `query_pre_attn_scalar` is 144 (`emb_dim / query heads`), not `head_dim` 128 | a MaxText config's `base_num_decoder_layers` is doubled (`decoder_block=gemma2`) and `sliding_window_pattern=2` set; `from-maxtext` runs `query_pre_attn_scalar=1` on the kernels as stored; an nnxtron model with HF's 144 writes MaxText kernels x `144 ** -0.5` (MaxText then computes HF's function) |
| OLMo 3 RoPE and qk-norm | `rope_type` (YaRN in olmo3-7b / 32b) on every layer, sliding ones too; the whole-projection qk-norm (`GlobalRMSNorm`) only when `model_name` starts with `olmo3`, else per head | YaRN on the global layers only, the sliding ones plain RoPE of the same theta (transformers 5's per-layer-type `rope_parameters`); `q_norm` / `k_norm` over the whole projection | the `olmo3-*` presets are HF's (`local_rope_max_timescale` = the theta: unscaled sliding layers; olmo3-7b-pt's default RoPE is the same in all three); `local_rope_max_timescale=0` is MaxText's RoPE; `decoder_block=olmo3` always normalises the whole projection and needs `sliding_window_pattern=4` (MaxText's fixed 3 sliding : 1 global; refused otherwise) |
| MoE load-balance loss | per sequence (each row's token fractions / k and mean `softmax` of the router output before the bias, every position counted), `E^2 ×` mean over rows and experts, averaged over the MoE layers (decoder and MTP; hash-routed layers have none) | over all tokens of the call, summed over layers (HF pools the counts and probabilities of all layers and tokens, fractions not divided by k) | `load_balance_convention=maxtext` (the Mixtral reference run trains with `load_balance_loss_weight=0.01`) |

The same in both (the reproduction checks them): loss = token mean over targets with
`targets_segmentation != 0`, z-loss off; gradient clipping by global norm before AdamW (eps outside
the square root, `eps_root=0`, bias correction); RMSNorm epsilon; MLA's softmax scale with YaRN's
mscale; MTP targets shifted within a packed segment and masked at its end, the MTP loss token-
weighted over depths and scaled by `mtp_loss_scaling_factor`.

Not covered by the reproduction: a run from scratch draws other initial values than MaxText
(another RNG), and under `query_pre_attn_scalar=1` nnxtron does not shrink the query kernel's
initialiser by `sqrt(head_dim)` as MaxText's does; dropout masks (another RNG).

## Checkpoints

```
nnxtron convert from-maxtext CKPT_DIR OUT_DIR [config.yml] [k=v ...]   # -> an nnxtron run directory
nnxtron convert to-maxtext RUN_DIR OUT_DIR [--scanned|--unscanned]     # -> OUT_DIR/0/items
nnxtron train ... load_parameters_path=CKPT_DIR                        # a MaxText checkpoint converts on load
```

A MaxText checkpoint does not say which model it holds: give its model's keys (`model_name=...`,
the sizes, `scan_layers`, or a MaxText config file), as for MaxText's own `load_parameters_path`.
Read on CPU without MaxText: a training checkpoint (`<step>/items`, `params/params/<tree>` next to
`opt_state`; the newest step of a checkpoint root), a param-only one (`save_params_to_path`) and an
NNX decode one. MaxText 0.2.5 (NNX) writes the tree of its former Linen decoders
(`to_checkpoint_dict`: "so NNX and Linen checkpoints stay interchangeable"; Linen's
`nn.scan(variable_axes={"params": param_scan_axis})` and `layers_{i}` gave the same names), so one
reader covers both. Scanned layers are stacked on axis 1 (`param_scan_axis`) — DeepSeek's router
bias (collection `MoEBiasVar`) on axis 0 —, unscanned ones are `layers_{i}`; Gemma 3 scans blocks
of six layers, Llama 4 blocks of its layer cycle (`Llama4ScannableBlock`, named `layers_{j}` even for
a cycle of one; a layer count that is not a multiple of the cycle is refused scanned, as MaxText
would drop the leftover layers), Qwen3.5 its cycle the same way (`Qwen3_5ScannableBlock`, named
`layers/layer_{j}`), Qwen3-Next its cycle nested (`layers/{local_layers, global_layer}`, a remainder in
`layers_remainder/local_layers`), DeepSeek-V4 its (HCA, CSA) layer pairs after the hash-routed
layers (`scanned_blocks`; other compress ratios, or an odd count of them, are refused scanned).
Kernels already have nnxtron's layout; the value conventions are converted:
Llama 2 / Mistral / Mixtral / Gemma / Gemma 2 keep MaxText's query kernels (with `1/sqrt(head_dim)` folded in;
`from-maxtext` then defaults to `query_pre_attn_scalar=1`; `query_pre_attn_scalar=0` rescales them
to HF meaning, needed for `convert to-hf`), Gemma 2's layer pairs are split into nnxtron's layers `2p`
(`..._local`) and `2p + 1` (`..._global`), Gemma's norm scales are MaxText's minus 1 and its table
MaxText's / `sqrt(emb_dim)` (a tied head defaults to `tied_head_bf16=true`, MaxText's head, and to
`normalize_embedding_logits=true`, base.yml's, unless MaxText's own model config sets it: GPT-3,
Qwen2.5 and Qwen3 0.6B/8B, false), GPT-3's LayerNorm scales are MaxText's + 1 (MaxText multiplies by `1 + s`),
and a llama3 RoPE (MaxText's `llama3.1`) defaults to MaxText's fixed scaling, factor 8, low 1,
high 4 over 8192 positions — for Llama 4 too, whose HF config says 16 / 1 / 1 (`nnxtron train` with
a MaxText config resolves it the same way). Qwen2 (`attention_bias`: `self_attention/{query,key,value}/bias`,
no output bias), Qwen3 (query/key norms), OLMo 3 (`attention/...`, not `self_attention/`; flat `[heads * head_dim]` query/key
norms; blocks of 4 layers scanned), Qwen3-MoE and Llama 4 (routed
and shared experts, NoPE and chunked layers) are plain renames. Qwen3-Next's flat DeltaNet and attention-output
kernels are split into heads and its conv kernel transposed to HF's `[C, 1, K]`; Qwen3.5's DeltaNet input
projections, which MaxText fuses per key head as Qwen3-Next's (`in_proj_qkvz`, `in_proj_ba`), are cut into HF's
split `in_proj_qkv` / `_z` / `_b` / `_a` (and joined back). DeepSeek-V4's hyper-connections are
regrouped (MaxText's `pre`/`post`/`res` alphas, betas and scales are nnxtron's — HF's — `fn`,
`base`, `scale`, with MaxText's `mhc_norm` scale folded into `fn` and written back as ones), its
output LoRA's kernel has the last two axes swapped, its hash table is model state (int32; MaxText
stores float32).
Covered: every family — Llama 2, Mistral, Mixtral, DeepSeek-V3 with MTP, Gemma, Gemma 2, Gemma 3, Qwen2, Qwen3, Qwen3-MoE,
Qwen3-Next, Qwen3.5 (its text decoder), OLMo 3, GPT-3, GPT-OSS, Llama 4 and DeepSeek-V4 — and MaxText's toy blocks `simple` / `simple_mlp` (`models/simple.py`: one or two matmuls a
layer, no HF counterpart; MaxText 0.2.5 runs them unscanned only with its layers' `(y, None)` return fixed,
`tests/assets/maxtext/checkpoints/maxtext_simple_unscanned.py`), scanned and unscanned
(`tests/assets/maxtext/checkpoints/`, written by MaxText 0.2.5); MaxText -> nnxtron -> MaxText is byte-exact, and nnxtron's logits from each checkpoint equal
MaxText's (float32, <= 6e-6; the Gated DeltaNet families, whose recurrence amplifies float32 reordering, within 1e-5
(Qwen3-Next) and 1e-4 (Qwen3.5: 2.2e-5 at one ill-conditioned token, docs/families.md)) — except two parametrisations nnxtron (like HF) does not keep: GPT-3's
LayerNorm scale, held as the float32 `1 + s` (`s` comes back within 2e-8, the multiplier `1 + s`
bit-exact), and DeepSeek-V4's `mhc_norm` scale, folded into `fn` (the same function; the asset's
scales are MaxText's initial ones, so its round trip is byte-exact).
Weights and model state are converted, not the optimizer state. Every MaxText array must be used and
every nnxtron parameter filled with the config's shape; a checkpoint of another model, a damaged
one, a directory that is no checkpoint or an nnxtron checkpoint is one `error:` line (exit 2).
"""


PIPE = "\\|"  # a | inside a Markdown table cell


def _value(value) -> str:
    return "—" if value is NOT_IN_BASE else f"`{value!r}`".replace("|", PIPE)


def _row(key: str) -> str:
    rule = KEYS[key]
    if rule.kind == HONOURED:
        what = ""
    elif rule.kind == REFUSED:
        extra = []
        if rule.accept:
            extra.append("also " + ", ".join(f"`{a!r}`" for a in rule.accept))
        if rule.gate:
            values = rule.gate[1] if len(rule.gate[1]) <= 4 else ("one of nnxtron's",)
            extra.append(f"any value while `{rule.gate[0]}` is {' or '.join(f'`{v!r}`' for v in values)}")
        if rule.check is not None:
            extra.append("see why")
        what = f"{rule.note}; {rule.use}" + (f" (accepted: default, {'; '.join(extra)})" if extra else "")
    else:
        what = rule.note
    what = what.replace("|", PIPE)
    return f"| `{key}` | {_value(rule.default)} | {rule.kind} | {what} |"


def render() -> str:
    in_base = [k for k, r in KEYS.items() if r.default is not NOT_IN_BASE]
    extra = [k for k, r in KEYS.items() if r.default is NOT_IN_BASE]
    counts = Counter(KEYS[k].kind for k in in_base)
    lines = [INTRO, SEMANTICS, f"## Counts ({len(in_base)} keys of MaxText {MAXTEXT_VERSION}'s base.yml)", ""]
    lines += ["| class | keys |", "|---|---|"] + [f"| {kind} | {counts[kind]} |" for kind in KINDS] + [""]
    for kind in (HONOURED, TRANSLATED, REFUSED, IGNORED):
        keys = sorted(k for k in in_base if KEYS[k].kind == kind)
        lines += [
            f"## {kind.capitalize()} ({len(keys)})",
            "",
            "| key | MaxText default | class | what nnxtron does |",
            "|---|---|---|---|",
        ]
        lines += [_row(k) for k in keys] + [""]
    lines += [
        f"## Keys not in MaxText {MAXTEXT_VERSION}'s base.yml ({len(extra)})",
        "",
        "MaxText's Linen switches, unknown to MaxText 0.2.5 as well (its Linen path is gone).",
        "",
        "| key | MaxText default | class | what nnxtron does |",
        "|---|---|---|---|",
    ]
    lines += [_row(k) for k in extra] + [""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when docs/maxtext.md is out of date")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not DOC.is_file() or DOC.read_text() != text:
            print(f"{DOC} is out of date: run python scripts/maxtext_keys_table.py", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(text)
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
