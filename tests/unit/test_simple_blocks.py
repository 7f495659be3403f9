"""MaxText's toy blocks ``simple`` / ``simple_mlp`` (``models/simple.py``): what their other tests do not show.

They have no HF counterpart, so no HF golden: their reference is MaxText's own forward
(``tests/unit/test_maxtext_checkpoint.py``: ``simple*_{scanned,unscanned}``, MaxText's logits and
byte-exact round trips), their strategies the matrix rows and pipeline cases. Here: HF import and
export refuse them with one error naming ``decoder_block``, through the API and ``nnxtron convert``,
and what they do not have (experts, another attention kind) is refused at load time.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from nnxtron.cli import main
from nnxtron.convert.hf import load_hf_weights, to_hf
from nnxtron.errors import ConfigError
from nnxtron.models.build import build_model
from tests.conftest import tiny_config
from tests.integration.conftest import run_cli
from tests.unit.test_maxtext_checkpoint import ASSETS, keys

GOLDEN = Path(__file__).resolve().parents[1] / "assets" / "golden"


@pytest.mark.parametrize("model", ["simple-tiny", "simple_mlp-tiny"])
def test_hf_export_and_import_are_refused_naming_decoder_block(model, tmp_path):
    cfg = tiny_config(model)
    named = f"decoder_block={cfg.decoder_block} is MaxText's toy block and has no HuggingFace architecture"
    with pytest.raises(ConfigError, match=named):
        to_hf(build_model(cfg), tmp_path / "hf")
    assert not (tmp_path / "hf" / "model.safetensors").exists() and not (tmp_path / "hf" / "config.json").exists()
    with pytest.raises(ConfigError, match=named):  # an HF directory's weights into such a model
        load_hf_weights(GOLDEN / "llama2", cfg)


def test_convert_to_hf_and_from_hf_say_the_same(tmp_path, capsys):
    """``convert from-maxtext`` takes MaxText's checkpoint; ``convert to-hf`` of that run is one error line, and so
    is ``convert from-hf`` into such a block."""
    name = "simple_mlp_scanned"
    run = tmp_path / "run"
    assert main(["convert", "from-maxtext", str(ASSETS / name), str(run), *keys(name)]) == 0
    capsys.readouterr()
    assert main(["convert", "to-hf", str(run), str(tmp_path / "hf")]) != 0
    err = capsys.readouterr().err
    assert "decoder_block=simple_mlp is MaxText's toy block and has no HuggingFace architecture" in err
    assert "Traceback" not in err and not (tmp_path / "hf" / "model.safetensors").exists()
    assert main(["convert", "from-hf", str(GOLDEN / "llama2"), str(tmp_path / "in"), "decoder_block=simple"]) != 0
    err = capsys.readouterr().err
    assert "decoder_block=simple is MaxText's toy block and has no HuggingFace architecture" in err
    assert "Traceback" not in err and not (tmp_path / "in" / "config.yml").exists()


@pytest.mark.parametrize("model", ["simple-tiny", "simple_mlp-tiny"])
@pytest.mark.parametrize("key, value", [("num_experts", 4), ("attention_type", "mla")])
def test_what_the_toy_blocks_lack_is_refused_naming_the_key(model, key, value):
    with pytest.raises(ConfigError, match=f"{key}={value} cannot apply"):
        tiny_config(model, **{key: value})


def test_decoding_is_refused_naming_decoder_block():
    """No attention layer, nothing to cache: ``generate`` (and ``serve``) stop with one error naming the block."""
    from nnxtron.infer.generate import generate

    cfg = tiny_config("simple_mlp-tiny")
    with pytest.raises(ConfigError, match="decoder_block=simple_mlp has no attention layer"):
        next(generate(build_model(cfg), [[3, 4, 5]], cfg, 2))


def test_training_says_before_it_starts_that_there_is_no_sample(tmp_path, capsys):
    """The default ``sample_after_training`` on a block that cannot decode: one start-up note (the
    tokenizer-mismatch note's mechanism), then the run trains and ends with exit status 0 — not an
    error after a finished run."""
    code, out, err = run_cli(
        capsys, "train", "model_name=simple_mlp-tiny", "vocab_size=320", "steps=1", "eval_interval=-1",
        f"base_output_directory={tmp_path}", "run_name=toy",
    )  # fmt: skip
    assert code == 0, err
    note = "no sample after training: decoder_block=simple_mlp has no attention layer"
    assert note in out + err and "sample_after_training=0 drops this note" in out + err
    assert (tmp_path / "toy" / "config.yml").exists()
