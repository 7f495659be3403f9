"""The objects built from a config whose attributes carry config keys (``tools/read_sites.py``).

``spec.scan_repeats`` reads ``scan_pipeline_repeats`` as surely as ``cfg.scan_pipeline_repeats``
does: :data:`CARRIERS` maps each such class's attributes to the keys (or ``Config``
properties, expanded to their keys) its builders assign them from. ``tests/unit/test_read_sites.py``
checks the table against every construction of these classes in the package, by AST: a mapped
attribute must be assigned from exactly its keys (following the builder's local names), and
an attribute assigned from a key must be mapped or listed in ``unmapped`` with its reason.
"""

from __future__ import annotations

import ast
from collections.abc import Mapping
from dataclasses import dataclass, field

from nnxtron.config.schema import Config

KEYS = frozenset(Config.model_fields)


@dataclass(frozen=True)
class Carrier:
    carries: dict[str, tuple[str, ...]]  # attribute -> keys or Config properties it is assigned from
    unmapped: dict[str, str] = field(default_factory=dict)  # attribute assigned from keys, not mapped -> why


_STAGES = "pipeline_stages"  # Config property: ici_pipeline_parallelism x dcn_pipeline_parallelism

CARRIERS: dict[str, Carrier] = {
    # config/pipeline.py: pipeline_spec(cfg)
    "PipelineSpec": Carrier(
        {
            "stages": (_STAGES,),
            "microbatches": ("num_pipeline_microbatches", _STAGES),  # -1: one per stage
            "delay": ("pipeline_delay_activation_forwarding",),
            "scan_iterations": ("scan_pipeline_iterations",),
            "scan_repeats": ("scan_pipeline_repeats",),
            "scan_stage_layers": ("scan_layers_per_stage",),
            "remat_iterations": ("set_remat_policy_on_pipeline_iterations",),
            "remat_layers": ("set_remat_policy_on_layers_per_stage",),
            "fsdp_ag_once": ("pipeline_fsdp_ag_once",),
            "host_weights": ("parameter_memory_host_offload",),
        },
        unmapped={
            # the layout (config/pipeline_layout.py: choose_layout, given the stage count) reads the layer keys;
            # mapping these would list the pipeline parallelism keys again at every use of the layout
            "repeats": "the layout's blocks / (stages x blocks per stage)",
            "layers_per_stage": "the layout's blocks per stage visit",
            "auto_note": "the text that says how the layout was chosen (nnxtron plan)",
        },
    ),
    # config/derived.py: derive(cfg, devices)
    "Derived": Carrier(
        {
            "head_dim": ("resolved_head_dim",),
            "num_kv_groups": ("base_num_query_heads", "base_num_kv_heads"),
            "global_batch_size": ("per_device_batch_size",),
            "microbatch_size": ("per_device_batch_size", "gradient_accumulation_steps"),
            "schedule_steps": ("steps", "learning_rate_schedule_steps"),
            "warmup_steps": ("warmup_steps_fraction", "steps", "learning_rate_schedule_steps"),
            "tokens_per_step": ("per_device_batch_size", "max_target_length"),
        }
    ),
    # parallel/remat.py: RematSpec.from_config(cfg); the custom choices are getattr(cfg, name) reads
    "RematSpec": Carrier({"policy": ("remat_policy",)}),
    # parallel/ring_attention.py: ContextParallel.from_config(cfg)
    "ContextParallel": Carrier(
        {
            "strategy": ("context_parallel_strategy",),
            "load_balance": ("context_parallel_load_balance",),
            "query_block": ("attention_query_block",),
        }
    ),
    # layers/router.py: RouterSpec.from_config(cfg)
    "RouterSpec": Carrier(
        {
            "num_experts": ("num_experts",),
            "k": ("num_experts_per_tok",),
            "score_func": ("routed_score_func",),
            "norm_topk_prob": ("norm_topk_prob",),
            "scaling_factor": ("routed_scaling_factor",),
            "n_groups": ("n_routing_groups",),
            "topk_groups": ("topk_routing_group",),
            "scales_input": ("router_scales_expert_input",),
            "balance": ("load_balance_convention",),
        }
    ),
    # layers/rope.py: RopeSpec.from_config(cfg, head_dim, sliding); layers/attention.py: the local (sliding-window) RoPE;
    # models/deepseek4/compressed.py: rope_specs
    "RopeSpec": Carrier(
        {
            "head_dim": ("resolved_head_dim", "qk_rope_head_dim"),  # the rotated dims (MLA, DeepSeek-V4: the rope part)
            "proportion": ("global_rope_proportion", "local_rope_proportion"),  # Gemma 4's rotated share, per layer kind
            "theta": ("rope_max_timescale", "local_rope_max_timescale", "compressed_rope_max_timescale"),
            "interleave": ("rope_interleave",),
            "scaling": ("rope_type",),
            "factor": ("rope_scaling_factor",),
            "low_freq_factor": ("rope_low_freq_factor",),
            "high_freq_factor": ("rope_high_freq_factor",),
            "original_max_position": ("rope_original_max_position_embeddings",),
            "max_position": ("max_position_embeddings",),
            "beta_fast": ("beta_fast",),
            "beta_slow": ("beta_slow",),
            "mscale": ("mscale",),
            "mscale_all_dim": ("mscale_all_dim",),
            "truncate": ("rope_truncate",),
        }
    ),
}

# Config keys that no read site names, each with the read of any key (`nnxtron config readers`
# lists those under key *) that reads it; tests/unit/test_read_sites.py: exactly these keys. Empty
# today: every key is named by an attribute read or by a getattr whose names the scan resolves
# (the remat activations of RematSpec.from_config, the option tables of config/checks.py).
GENERIC_ONLY: dict[str, str] = {}


def config_properties(schema: ast.Module) -> dict[str, frozenset[str]]:
    """``Config``'s properties -> the keys their bodies read through ``self`` (properties of properties followed)."""
    config = next(n for n in schema.body if isinstance(n, ast.ClassDef) and n.name == "Config")
    direct: dict[str, set[str]] = {}
    for fn in config.body:
        if isinstance(fn, ast.FunctionDef) and any(ast.unparse(d) == "property" for d in fn.decorator_list):
            direct[fn.name] = {n.attr for n in ast.walk(fn) if isinstance(n, ast.Attribute) and ast.unparse(n.value) == "self"}
    resolved = {}
    for name in direct:
        seen, todo, keys = {name}, [name], set()
        while todo:
            for attr in direct[todo.pop()]:
                if attr in KEYS:
                    keys.add(attr)
                elif attr in direct and attr not in seen:
                    seen.add(attr)
                    todo.append(attr)
        resolved[name] = frozenset(keys)
    return resolved


def carried_keys(carrier: str, attr: str, properties: Mapping[str, frozenset[str]]) -> tuple[str, ...]:
    """The keys a carrier attribute carries: the table's keys, Config properties expanded."""
    out: set[str] = set()
    for name in CARRIERS[carrier].carries.get(attr, ()):
        out |= properties.get(name, {name})
    return tuple(sorted(out))
