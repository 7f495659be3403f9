"""Generate the HF PEFT golden for nnxtron's LoRA adapter layout (tests/unit/test_lora_peft.py).

A LoRA adapter is made with PEFT on the golden ``llama2`` base (``tests/assets/golden/llama2``)
over the seven dense layers of every decoder layer (q/k/v/o and gate/up/down projections),
rank 4, alpha 8, with random A and B (B scaled so that the adapters move the logits), and
saved with ``save_pretrained``. ``<out>/llama2_lora/`` receives

* ``adapter_config.json`` and ``adapter_model.safetensors`` -- as PEFT writes them
* ``golden.safetensors`` -- ``input_ids`` (the llama2 golden's) and ``logits`` (float32,
  [2, 48, 256]) of the PEFT model in eval mode, eager attention.

Needs ``pip install 'nnxtron[golden]' peft`` (torch, transformers, peft); never needed by tests.
Usage: ``python scripts/make_peft_golden.py [tests/assets/golden]``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import peft
import torch
import transformers
from safetensors.torch import load_file, save_file

RANK, ALPHA = 4, 8
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def main(root: Path) -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    base_dir, out = root / "llama2", root / "llama2_lora"
    model = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32, attn_implementation="eager")
    config = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS, lora_dropout=0.0, init_lora_weights=False)
    model = peft.get_peft_model(model, config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(0.2 * torch.randn_like(parameter))
    model.eval()
    ids = load_file(str(base_dir / "golden.safetensors"))["input_ids"].long()
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    model.save_pretrained(out)
    save_file({"input_ids": ids.int(), "logits": logits.contiguous()}, str(out / "golden.safetensors"))
    versions = {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__}
    (out / "versions.json").write_text(json.dumps(versions, indent=2) + "\n")
    print(f"wrote {out}: logits {tuple(logits.shape)}, {versions}")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "tests/assets/golden"))
