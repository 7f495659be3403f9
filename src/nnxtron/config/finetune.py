"""Fine-tuning defaults: the learning rate and schedule a run that starts from ``init_from``
takes for the keys neither its config file nor its command line sets.

base.yml's optimisation values are pre-training ones (``learning_rate`` 3e-3, cosine to 10%):
applied to a pretrained model they wreck it within a few steps. A fine-tuning run takes what
HF TRL (its trainers' configs, over transformers' ``TrainingArguments``) and MaxText's
``sft.yml`` take instead, and its start-up lines say each value and where it comes from
(docs/finetune.md has the table). A resumed run keeps the values its ``config.yml`` recorded.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from nnxtron.config import options
from nnxtron.config.loader import base_values
from nnxtron.config.schema import Config

# a learning rate above this with init_from is said at start-up (a pre-training rate)
FINETUNE_LR_WARNING = 1e-3
RECORDED = "the run's config.yml: a resumed run keeps its values"

# (use_dpo, lora) -> (learning rate, where it comes from)
LEARNING_RATES: dict[tuple[bool, bool], tuple[float, str]] = {
    (False, False): (2e-5, "TRL SFTConfig, MaxText sft.yml"),
    (True, False): (1e-6, "TRL DPOConfig"),
    (False, True): (1e-4, "TRL SFTTrainer docs for LoRA adapters"),
    (True, True): (1e-5, "TRL DPOTrainer docs for LoRA adapters"),
}
SCHEDULE = "linear"
SCHEDULE_SOURCE = "transformers TrainingArguments.lr_scheduler_type, kept by TRL"
WARMUP_SOURCE = "transformers TrainingArguments.warmup_steps / warmup_ratio"
FINAL_SOURCE = "transformers' schedules decay to 0"
FINAL_FRACTION_KEYS = ("cosine_learning_rate_final_fraction", "learning_rate_final_fraction")
# keys that only schedules other than SCHEDULE read: a user who sets one chose a schedule
_OTHER_SCHEDULE_KEYS = {k for keys in options.SCHEDULE_KEYS.values() for k in keys} - set(options.SCHEDULE_KEYS[SCHEDULE])


@dataclass(frozen=True)
class Default:
    key: str
    value: Any
    source: str

    def line(self) -> str:
        shown = f"{self.value:g}" if isinstance(self.value, float) else str(self.value)
        return f"fine-tuning default (init_from): {self.key}={shown} ({self.source})"


def finetune_defaults(
    given: Mapping[str, Any], recorded: Mapping[str, Any] | None = None, maxtext_file: bool = False
) -> list[Default]:
    """The fine-tuning defaults of the keys ``given`` (the config file's and the command line's
    values) does not set. ``recorded``: the ``config.yml`` of the run being resumed (its values
    replace the defaults, so a resume keeps its schedule). A MaxText config (``maxtext_file``)
    keeps MaxText's schedule arithmetic and takes only the learning rate (MaxText's
    ``sft.yml`` sets only that over its ``base.yml``)."""
    lora = _positive(given.get("lora_rank"))
    chosen = [Default("learning_rate", *LEARNING_RATES[(bool(given.get("use_dpo")), lora)])]
    if not maxtext_file and given.get("lr_schedule_convention", "nnxtron") != "maxtext":
        schedule = base_values()["lr_schedule_type"]
        if not _OTHER_SCHEDULE_KEYS & set(given):
            chosen.append(Default("lr_schedule_type", SCHEDULE, SCHEDULE_SOURCE))
            schedule = SCHEDULE
        chosen.append(Default("warmup_steps_fraction", 0.0, WARMUP_SOURCE))
        if recorded is not None:
            schedule = recorded.get("lr_schedule_type", base_values()["lr_schedule_type"])
        schedule = given.get("lr_schedule_type", schedule)  # the schedule the run will have: its final fraction
        final = [k for k in FINAL_FRACTION_KEYS if k in options.SCHEDULE_KEYS.get(str(schedule), ())]
        if final and not set(FINAL_FRACTION_KEYS) & set(given):
            chosen.append(Default(final[0], 0.0, FINAL_SOURCE))
    chosen = [d for d in chosen if d.key not in given]
    if recorded is None:
        return chosen
    return [Default(d.key, recorded[d.key], RECORDED) for d in chosen if d.key in recorded]


def startup_lines(defaults: list[Default], cfg: Config) -> list[str]:
    """One line per default applied, and a warning for a pre-training learning rate."""
    lines = [d.line() for d in defaults]
    if cfg.learning_rate > FINETUNE_LR_WARNING:
        fine = LEARNING_RATES[(cfg.use_dpo, cfg.lora_rank > 0)][0]
        lines.append(
            f"warning: learning_rate={cfg.learning_rate:g} is a pre-training rate: fine-tuning a pretrained model "
            f"(init_from) above {FINETUNE_LR_WARNING:g} can wreck it within a few steps (text such as 'the the the'); "
            f"the fine-tuning default is {fine:g} (docs/finetune.md)"
        )
    return lines


def _positive(value: Any) -> bool:
    try:
        return int(value or 0) > 0
    except (TypeError, ValueError):
        return False  # the schema says what is wrong with it
