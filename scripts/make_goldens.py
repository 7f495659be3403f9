"""Generate the HuggingFace golden logits used by nnxtron's conversion tests.

Three tiny, randomly initialised HF models (no download needed) are built,
saved with ``save_pretrained`` and run once in float32 / eager attention on a
fixed batch of token ids. For every case ``<out>/<case>/`` receives:

* ``config.json``        -- written by ``model.save_pretrained``
* ``model.safetensors``  -- float32 weights written by ``model.save_pretrained``
* ``golden.safetensors`` -- ``input_ids`` (int32, [2, S]) and ``logits``
                            (float32, [2, S, V]) of the HF forward pass

plus ``<out>/versions.json`` recording the torch / transformers versions.

Cases:

* ``llama2``  -- LlamaForCausalLM, MHA, plain RoPE (theta 1e4), untied head.
* ``llama31`` -- LlamaForCausalLM, GQA (4q/2kv), llama3 RoPE scaling
                 (theta 5e5, factor 8, original_max_position_embeddings 64),
                 tied embeddings / lm_head.
* ``mistral`` -- MistralForCausalLM, GQA, theta 1e6, sliding_window=8.

Regenerate (CPU only, takes well under a minute)::

    pip install -e '.[golden]'          # torch==2.13.0, transformers 5.x
    OMP_NUM_THREADS=1 python scripts/make_goldens.py --out tests/assets/golden

The script is deterministic (fixed seeds, one thread). After writing, each
directory is reloaded with ``from_pretrained`` and its logits are asserted to
be bit-identical to the stored ones.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import torch  # noqa: E402
import transformers  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import (  # noqa: E402
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
)

SEQ_LEN = 48
BATCH = 2
VOCAB = 256
MODEL_SEED = 0
INPUT_SEED = 1234

_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=176,
    num_hidden_layers=3,
    num_attention_heads=4,
    head_dim=16,
    rms_norm_eps=1e-5,
    max_position_embeddings=256,
    attention_bias=False,
    mlp_bias=False,
)


def _cases() -> dict[str, tuple[type, type, dict]]:
    # transformers 5.x: RoPE settings live in `rope_parameters` (with `rope_theta` inside).
    return {
        "llama2": (
            LlamaConfig,
            LlamaForCausalLM,
            dict(
                _COMMON,
                num_key_value_heads=4,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                tie_word_embeddings=False,
            ),
        ),
        "llama31": (
            LlamaConfig,
            LlamaForCausalLM,
            dict(
                _COMMON,
                num_key_value_heads=2,
                rope_parameters={
                    "rope_type": "llama3",
                    "rope_theta": 500000.0,
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64,
                },
                tie_word_embeddings=True,
            ),
        ),
        "mistral": (
            MistralConfig,
            MistralForCausalLM,
            dict(
                {k: v for k, v in _COMMON.items() if k not in ("attention_bias", "mlp_bias")},
                num_key_value_heads=2,
                rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                sliding_window=8,
                tie_word_embeddings=False,
            ),
        ),
    }


def _build(config_cls, model_cls, kwargs) -> torch.nn.Module:
    config = config_cls(**kwargs, attn_implementation="eager", dtype="float32")
    torch.manual_seed(MODEL_SEED)
    model = model_cls(config)  # default HF init (normal(0, initializer_range))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # RMSNorm weights: make them non-trivial
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    model.to(torch.float32).eval()
    return model


@torch.no_grad()
def _logits(model, input_ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=input_ids.long(), use_cache=False).logits.float()


def _rope_check(model) -> None:
    rope = model.config.rope_parameters
    inv_scaled = model.model.rotary_emb.inv_freq.float()
    dim = model.config.head_dim
    inv_plain = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    changed = ~torch.isclose(inv_scaled, inv_plain, rtol=1e-6, atol=0)
    wavelen = 2 * torch.pi / inv_plain
    print("  rope llama3 check (dim: wavelen, unscaled -> scaled inv_freq):")
    for i, (w, a, b) in enumerate(zip(wavelen.tolist(), inv_plain.tolist(), inv_scaled.tolist())):
        print(f"    {i}: {w:10.2f}  {a:.6e} -> {b:.6e}{'  *' if changed[i] else ''}")
    print(f"  rope: {int(changed.sum())}/{changed.numel()} inv_freq entries changed by llama3 scaling")
    assert int(changed.sum()) >= 3, "llama3 scaling does not change enough frequencies"


def _sliding_check(model, config_cls, model_cls, kwargs, input_ids, logits) -> None:
    full_kwargs = dict(kwargs, sliding_window=None)
    full = model_cls(config_cls(**full_kwargs, attn_implementation="eager", dtype="float32"))
    full.load_state_dict(model.state_dict())
    full.to(torch.float32).eval()
    ref = _logits(full, input_ids)
    w = kwargs["sliding_window"]
    diff = (logits - ref).abs().amax(dim=(0, 2))  # per position
    inside, beyond = float(diff[:w].max()), float(diff[w:].max())
    print(
        f"  sliding_window={w}: max|logits - logits(no window)| positions <{w}: {inside:.3e}, "
        f">={w}: {beyond:.3e}  (first differing position: {int((diff > 1e-6).nonzero()[0])})"
    )
    assert inside <= 1e-6, "sliding window changed positions inside the window"
    assert beyond > 1e-4, "sliding window not applied by HF"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("tests/assets/golden"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    args.out.mkdir(parents=True, exist_ok=True)

    gen = torch.Generator().manual_seed(INPUT_SEED)
    input_ids = torch.randint(0, VOCAB, (BATCH, SEQ_LEN), generator=gen).to(torch.int32)

    versions = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "seq_len": SEQ_LEN,
        "batch": BATCH,
        "model_seed": MODEL_SEED,
        "input_seed": INPUT_SEED,
    }
    (args.out / "versions.json").write_text(json.dumps(versions, indent=2) + "\n")
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")

    for case, (config_cls, model_cls, kwargs) in _cases().items():
        print(f"[{case}]")
        d = args.out / case
        d.mkdir(parents=True, exist_ok=True)
        model = _build(config_cls, model_cls, kwargs)
        logits = _logits(model, input_ids)
        assert logits.shape == (BATCH, SEQ_LEN, VOCAB) and logits.dtype == torch.float32

        model.save_pretrained(d, safe_serialization=True)
        # Not needed by anything (no generation defaults for random models); keep assets minimal.
        (d / "generation_config.json").unlink(missing_ok=True)
        save_file(
            {"input_ids": input_ids.contiguous(), "logits": logits.contiguous()},
            str(d / "golden.safetensors"),
        )

        if case == "llama31":
            _rope_check(model)
        if case == "mistral":
            _sliding_check(model, config_cls, model_cls, kwargs, input_ids, logits)

        # Round trip: reload the saved directory and compare bit-exactly.
        reloaded = model_cls.from_pretrained(d, attn_implementation="eager", dtype=torch.float32).eval()
        stored = load_file(str(d / "golden.safetensors"))
        assert set(stored) == {"input_ids", "logits"}
        assert torch.equal(stored["input_ids"], input_ids)
        relogits = _logits(reloaded, stored["input_ids"])
        assert torch.equal(relogits, stored["logits"]), (
            f"{case}: reloaded logits differ (max {float((relogits - stored['logits']).abs().max()):.3e})"
        )
        weights = load_file(str(d / "model.safetensors"))
        assert all(t.dtype == torch.float32 for t in weights.values())

        for f in sorted(d.iterdir()):
            print(f"  {f.name:20s} {f.stat().st_size:>9d} bytes")
        print(
            f"  max|logit| = {float(logits.abs().max()):.4f}, "
            f"tensors in model.safetensors: {len(weights)}, "
            f"lm_head.weight stored: {'lm_head.weight' in weights}"
        )
        print("  reload check: logits bit-identical")
    return 0


if __name__ == "__main__":
    sys.exit(main())
