import pytest

PARAGRAPH = (
    "The quick brown fox jumps over the lazy dog. A stitch in time saves nine. "
    "All that glitters is not gold. Where there is a will there is a way.\n"
)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """A tiny fixed corpus of repetitive English text (three files)."""
    root = tmp_path_factory.mktemp("corpus")
    for i in range(3):
        (root / f"doc{i}.txt").write_text(PARAGRAPH * (20 + 5 * i))
    return str(root)


def train_overrides(corpus: str, base: str, run: str, **extra) -> list[str]:
    values = {
        "model_name": "llama2-tiny",
        "vocab_size": 320,
        "base_num_decoder_layers": 2,
        "dataset_path": f"{corpus}/*.txt",
        "eval_split_fraction": 0.3,
        "per_device_batch_size": 1,
        "max_target_length": 32,
        "steps": 6,
        "eval_interval": 3,
        "eval_steps": 1,
        "checkpoint_period": 3,
        "learning_rate": 0.01,
        "warmup_steps_fraction": 0.0,
        "base_output_directory": base,
        "run_name": run,
        "sample_after_training": 0,
        "enable_tensorboard": True,
    }
    values.update(extra)
    return [f"{k}={v}" for k, v in values.items()]
