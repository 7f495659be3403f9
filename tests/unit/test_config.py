"""Config: presets, precedence, derived values and every error class."""

import pytest

from nnxtron.config import Config, derive, load_config, preset_names
from nnxtron.config.derived import mesh_shape
from nnxtron.errors import ConfigError

ISSUE_PRESETS = [
    "llama2-7b", "llama2-13b", "llama2-70b", "llama3-8b", "llama3-70b",
    "llama3.1-8b", "llama3.1-70b", "llama3.1-405b", "mistral-7b",
    "llama2-tiny", "llama3.1-tiny", "mistral-tiny",
]  # fmt: skip


@pytest.mark.parametrize("name", ISSUE_PRESETS)
def test_every_preset_loads(name):
    assert name in preset_names()
    cfg = load_config(overrides=[f"model_name={name}"])
    assert cfg.model_name == name


def test_preset_values_match_published_sizes():
    cfg = load_config(overrides=["model_name=llama3.1-405b"])
    assert (cfg.base_emb_dim, cfg.base_num_query_heads, cfg.base_num_kv_heads) == (16384, 128, 8)
    assert (cfg.base_mlp_dim, cfg.base_num_decoder_layers, cfg.vocab_size) == (53248, 126, 128256)
    assert cfg.rope_type == "llama3" and cfg.rope_max_timescale == 500000.0
    m = load_config(overrides=["model_name=mistral-7b"])
    assert (m.base_num_kv_heads, m.rope_max_timescale, m.decoder_block) == (8, 1e6, "mistral")


def test_base_yml_names_every_schema_field():
    # The schema has no defaults of its own: base.yml is the single source of defaults.
    assert all(field.is_required() for field in Config.model_fields.values())
    load_config()  # would fail if base.yml missed a field


def test_precedence_base_preset_file_overrides(tmp_path):
    f = tmp_path / "c.yml"
    f.write_text("model_name: llama2-tiny\nsteps: 7\nlearning_rate: 0.5\n")
    cfg = load_config(f, ["learning_rate=0.25"])
    assert cfg.base_emb_dim == 64  # preset chosen by the file
    assert cfg.steps == 7  # file over base
    assert cfg.learning_rate == 0.25  # command line over file
    assert load_config(f, ["base_emb_dim=128"]).base_emb_dim == 128  # overrides beat the preset


def test_override_value_types():
    cfg = load_config(overrides=["scan_layers=false", "learning_rate=1e-3", "dataset_path=[a.txt, b.txt]", "run_name=007"])
    assert cfg.scan_layers is False and cfg.learning_rate == 1e-3
    assert cfg.dataset_path == ("a.txt", "b.txt") and cfg.run_name == "007"


def test_derived_values():
    cfg = load_config(
        overrides=[
            "model_name=llama3-8b",
            "per_device_batch_size=2",
            "ici_tensor_parallelism=2",
            "steps=100",
            "warmup_steps_fraction=0.1",
        ]
    )
    d = derive(cfg, 8)
    assert d.mesh_shape == {"stage": 1, "data": 1, "fsdp": 4, "context": 1, "expert": 1, "tensor": 2}
    assert (d.head_dim, d.num_kv_groups, d.global_batch_size) == (128, 4, 16)
    assert (d.schedule_steps, d.warmup_steps, d.tokens_per_step) == (100, 10, 16 * cfg.max_target_length)
    assert derive(load_config(overrides=["head_dim=-1"]), 1).head_dim == 256 // 4


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (["stpes=3"], "did you mean 'steps'"),
        (["learning_rat=1"], "did you mean 'learning_rate'"),
        (["steps=abc"], "config key 'steps'"),
        (["steps=-1"], "greater than 0"),
        (["dtype=float16"], "config key 'dtype'"),
        (["base_num_kv_heads=3"], "base_num_query_heads (4) must be a multiple of base_num_kv_heads (3)"),
        (["eval_split_fraction=0", "eval_interval=5"], "eval_interval > 0 with dataset_type=text needs eval_split_fraction"),
        (["model_name=llama3-7b"], "did you mean 'llama3-70b'"),
        (["mlp_activations=[relu, linear]"], "mlp_activations"),
        (["logical_axis_rules=3"], "logical_axis_rules"),
        (["novalue"], "key=value"),
    ],
)
def test_config_errors_name_the_key(overrides, fragment):
    with pytest.raises(ConfigError) as err:
        load_config(overrides=overrides)
    message = str(err.value)
    assert fragment in message and "\n" not in message


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yml")
    bad = tmp_path / "bad.yml"
    bad.write_text("steps: [1,\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    listy = tmp_path / "list.yml"
    listy.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(listy)
    typo = tmp_path / "typo.yml"
    typo.write_text("scan_layer: true\n")
    with pytest.raises(ConfigError, match="did you mean 'scan_layers'"):
        load_config(typo)


def test_mesh_errors():
    cfg = load_config(overrides=["ici_fsdp_parallelism=4", "ici_tensor_parallelism=1"])
    with pytest.raises(ConfigError, match="has 4 devices but 8 are available"):
        mesh_shape(cfg, 8)
    cfg = load_config(overrides=["ici_fsdp_parallelism=-1", "ici_tensor_parallelism=3"])
    with pytest.raises(ConfigError, match="not a multiple of 3"):
        mesh_shape(cfg, 8)
    cfg = load_config(overrides=["ici_fsdp_parallelism=-1", "ici_data_parallelism=-1"])
    with pytest.raises(ConfigError, match="only one of"):
        mesh_shape(cfg, 8)


def test_batch_must_divide_over_the_mesh():
    cfg = load_config(overrides=["per_device_batch_size=0.25", "ici_fsdp_parallelism=8"])
    with pytest.raises(ConfigError, match="does not divide over the stage x data x fsdp x expert"):
        derive(cfg, 8)
    with pytest.raises(ConfigError, match="not a whole batch"):
        derive(load_config(overrides=["per_device_batch_size=0.3"]), 8)
