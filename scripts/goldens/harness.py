"""Shared harness for the HF golden files: constants, the ``Case`` record, model building, logits,
file writing, the reload round trip, the fused-layout writer and checks used by several families."""

from __future__ import annotations

import platform
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors.torch import load_file, save_file

SEQ_LEN = 48
BATCH = 2
VOCAB = 256
MODEL_SEED = 0
INPUT_SEED = 1234
# Correction-bias buffers (`e_score_correction_bias`, DeepSeek routers; HF inits them to zeros) are redrawn as
# BIAS_SCALE * randn from this seed, layer by layer.
BIAS_SEED = 4321
BIAS_SCALE = 0.05
# MoE routers: HF's init (std 0.02) leaves near-ties between the k-th and (k+1)-th expert
# (gaps ~1e-6 on these inputs), which a float32 reimplementation could flip. The router
# weights (`mlp.gate.weight`) are therefore redrawn with this larger std.
ROUTER_STD = 0.1
ROUTER_WEIGHT = "mlp.gate.weight"
MIN_ROUTING_GAP = 2e-5
# MoE cases run (and are reloaded) with the reference per-expert loop, not grouped_mm.
EXPERTS_IMPL = "eager"
# Gemma-style `x * (1 + w)` RMSNorms (HF inits w to 0): their weights are drawn as NORM_STD * randn.
NORM_STD = 0.1
MAX_FILE_BYTES = 1_500_000

Check = Callable[["Run"], None]


def _same_name(key: str) -> str:
    return key


@dataclass(frozen=True)
class Case:
    """One golden directory: HF classes and config kwargs, how the weights are initialised, and its checks."""

    name: str
    config_cls: type
    model_cls: type
    kwargs: dict[str, Any]
    checks: tuple[Check, ...] = ()  # run in order after config / model / golden files are written
    moe: bool = False  # eager experts, router redrawn, grouped_mm note on reload
    router: str | None = None  # suffix of the router weight redrawn with ROUTER_STD (MoE default: ROUTER_WEIGHT)
    seed: int = MODEL_SEED
    seq_len: int = SEQ_LEN
    zero_centered_norms: bool = False  # `x * (1 + w)` norms: w = NORM_STD * randn instead of 1 + 0.1 * randn
    randomize: Callable[[torch.nn.Module], None] | None = None  # extra init after norms / routers
    perturb: Callable[[torch.nn.Module], None] | None = None  # last init step, after the correction biases
    hub_name: Callable[[str], str] = _same_name  # state_dict key -> key written by save_pretrained
    hub_experts: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # per-expert hub names
    versions: dict[str, Any] = field(default_factory=dict)  # extra entries for versions.json
    # the adversarial variant (goldens/adversarial.py): its near-tie refusals (every case with routed experts has
    # one), and a sequence length / window of its own (0: the shared SEQ_LEN / WINDOWS)
    tie_checks: tuple[Check, ...] = ()
    adversarial_seq_len: int = 0
    adversarial_window: int = 0

    @property
    def router_weight(self) -> str | None:
        return self.router or (ROUTER_WEIGHT if self.moe else None)

    @property
    def routed(self) -> bool:
        """The model has routed experts (a router): generated and reloaded with transformers' eager expert loop."""
        return self.router_weight is not None

    def impl(self) -> dict[str, str]:
        """Kernel choices passed to the config / from_pretrained (not saved in config.json)."""
        impl = dict(attn_implementation="eager")
        if self.moe:
            # transformers 5.24 defaults to "grouped_mm" (sorted tokens, grouped matmul); the eager
            # per-expert loop is the reference formulation. They agree to float32 rounding.
            impl["experts_implementation"] = EXPERTS_IMPL
        return impl

    def config(self, **overrides: Any) -> Any:
        return self.config_cls(**dict(self.kwargs, **overrides), **self.impl(), dtype="float32")

    def input_ids(self) -> torch.Tensor:
        # Same seed for every case: all S=48 cases share input_ids (other lengths are other draws).
        gen = torch.Generator().manual_seed(INPUT_SEED)
        return torch.randint(0, VOCAB, (BATCH, self.seq_len), generator=gen).to(torch.int32)


@dataclass
class Run:
    """A built golden model with its input_ids, logits and output directory, as the checks see it."""

    case: Case
    model: torch.nn.Module
    input_ids: torch.Tensor
    logits: torch.Tensor
    dir: Path


def redraw_hash_table(table: torch.Tensor, experts: int, gen: torch.Generator) -> None:
    """Fill a DeepSeek-V4 ``tid2eid`` table [V, k] with k distinct random experts per token."""
    rows = [torch.randperm(experts, generator=gen)[: table.shape[1]] for _ in range(table.shape[0])]
    table.copy_(torch.stack(rows).to(table.dtype))


def build(case: Case) -> torch.nn.Module:
    """Default HF init from the case seed, then non-trivial norms, routers, extras and correction biases."""
    config = case.config()
    torch.manual_seed(case.seed)
    model = case.model_cls(config)  # default HF init (normal(0, initializer_range))
    router = case.router_weight
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and case.zero_centered_norms:  # (1 + w) norms: w = 0 at init
                p.copy_(NORM_STD * torch.randn_like(p))
            elif "norm" in name:  # RMSNorm weights: make them non-trivial
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif router is not None and name.endswith(router):
                p.copy_(ROUTER_STD * torch.randn_like(p))
        if case.randomize is not None:
            case.randomize(model)
        gen = torch.Generator().manual_seed(BIAS_SEED)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(BIAS_SCALE * torch.randn(b.shape, generator=gen, dtype=torch.float32))
        if case.perturb is not None:
            case.perturb(model)
    model.to(torch.float32).eval()
    if case.moe:
        assert model.config._experts_implementation == EXPERTS_IMPL
    return model


@torch.no_grad()
def logits(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=input_ids.long(), use_cache=False).logits.float()


def variant(run: Run, state_dict: dict[str, torch.Tensor] | None = None, **overrides: Any) -> torch.nn.Module:
    """A fresh model under a modified config, loaded with the golden weights (or ``state_dict``)."""
    other = run.case.model_cls(run.case.config(**overrides))
    other.load_state_dict(run.model.state_dict() if state_dict is None else state_dict, strict=True)
    return other.to(torch.float32).eval()


def variant_logits(run: Run, **overrides: Any) -> torch.Tensor:
    """Logits of the same weights under a modified config."""
    return logits(variant(run, **overrides), run.input_ids)


def diff_by_position(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a - b).abs().amax(dim=(0, 2))  # [S]


def first_diff(diff: torch.Tensor, tol: float = 1e-6) -> int:
    nz = (diff > tol).nonzero()
    return int(nz[0]) if len(nz) else -1


def position_split(run: Run, first: int, **overrides: Any) -> tuple[float, float, int]:
    """Max logit diff vs a config variant at positions < ``first`` and >= ``first``, and the first differing
    position; asserts that the variant changes nothing before ``first`` and something from it on."""
    diff = diff_by_position(run.logits, variant_logits(run, **overrides))
    inside, beyond = float(diff[:first].max()), float(diff[first:].max())
    assert inside <= 1e-6, f"{overrides} changed positions < {first}"
    assert beyond > 1e-4, f"{overrides} has no effect from position {first} on"
    return inside, beyond, first_diff(diff)


def llama3_rope_check(run: Run) -> None:
    """llama3 RoPE scaling changes at least 3 of the inv_freq entries."""
    model = run.model
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


def capture(model: torch.nn.Module, input_ids: torch.Tensor, modules: Iterable[tuple[int, torch.nn.Module]]) -> dict[int, tuple]:
    """Run the model once; ``(positional args, output)`` of each module, by its key."""
    seen: dict[int, tuple] = {}
    hooks = [m.register_forward_hook(lambda mod, args, out, k=k: seen.__setitem__(k, (args, out))) for k, m in modules]
    try:
        logits(model, input_ids)
    finally:
        for h in hooks:
            h.remove()
    return seen


def moe_gates(model: torch.nn.Module) -> list[tuple[int, torch.nn.Module]]:
    return [(i, layer.mlp.gate) for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")]


def capture_router_io(model: torch.nn.Module, input_ids: torch.Tensor) -> dict[int, tuple[torch.Tensor, tuple]]:
    """Router input ([T, D], T = B*S tokens) and output (logits, weights, indices) per MoE layer."""
    return {i: (args[0], out) for i, (args, out) in capture(model, input_ids, moe_gates(model)).items()}


def sorted_choice(idx: torch.Tensor, w: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    order = idx.argsort(dim=-1)
    return idx.gather(-1, order), (None if w is None else w.gather(-1, order))


@torch.no_grad()
def save_fused(run: Run) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Write fused.safetensors = model.state_dict() (transformers' in-memory layout); assert it equals the hub
    file up to ``case.hub_name`` and the expert split, and that loading it reproduces the logits.
    Returns (fused, hub) as read back from disk."""
    case, d = run.case, run.dir
    fused = {k: v.detach().contiguous() for k, v in run.model.state_dict().items()}
    save_file(fused, str(d / "fused.safetensors"), metadata={"format": "pt"})
    fused = load_file(str(d / "fused.safetensors"))
    hub = load_file(str(d / "model.safetensors"))
    g, u, dn = case.hub_experts
    covered = set()
    for key, t in fused.items():
        hk = case.hub_name(key)
        if key.endswith(".experts.gate_up_proj"):
            pre = hk[: -len("gate_up_proj")]
            n_exp, two_f, _ = t.shape
            for e in range(n_exp):
                gate, up = hub[f"{pre}{e}.{g}.weight"], hub[f"{pre}{e}.{u}.weight"]
                assert torch.equal(t[e], torch.cat([gate, up], dim=0)) and two_f == 2 * gate.shape[0]
                covered |= {f"{pre}{e}.{g}.weight", f"{pre}{e}.{u}.weight"}
        elif key.endswith(".experts.down_proj"):
            pre = hk[: -len("down_proj")]
            for e in range(t.shape[0]):
                assert torch.equal(t[e], hub[f"{pre}{e}.{dn}.weight"])
                covered.add(f"{pre}{e}.{dn}.weight")
        else:
            assert hk in hub, (key, hk)
            assert torch.equal(t, hub[hk]), key
            covered.add(hk)
    assert covered == set(hub), sorted(set(hub) ^ covered)[:5]
    fresh = variant(run, state_dict=fused)
    assert torch.equal(logits(fresh, run.input_ids), run.logits), f"{case.name}: fused.safetensors logits differ"
    return fused, hub


def write_and_check_fused(run: Run) -> None:
    """``save_fused``, then print the first MoE layer's keys in both layouts."""
    fused, hub = save_fused(run)
    layer = moe_gates(run.model)[0][0]
    tag = f"layers.{layer}."
    print(f"  MoE layer {layer} keys, hub layout (model.safetensors, {len(hub)} tensors):")
    for key in sorted(hub):
        if tag in key and (".experts.0." in key or ".experts." not in key) and "self_attn" not in key:
            print(f"    {key:55s} {list(hub[key].shape)}")
    print(f"    ... experts 0..{fused[next(k for k in fused if tag in k and 'gate_up_proj' in k)].shape[0] - 1}")
    print(f"  MoE layer {layer} keys, fused layout (fused.safetensors, {len(fused)} tensors):")
    for key in sorted(fused):
        if tag in key and "self_attn" not in key:
            print(f"    {key:55s} {list(fused[key].shape)}")
    print("  fused check: == hub weights (gate_up_proj[e] = cat(gate_e, up_e)), load_state_dict logits bit-identical")


def write_golden(path: Path, input_ids: torch.Tensor, out_logits: torch.Tensor, **extra: torch.Tensor) -> None:
    """``input_ids`` and ``logits``, plus ``extra`` tensors (``logits_float64``, ``mtp_logits``)."""
    tensors = {"input_ids": input_ids, "logits": out_logits, **extra}
    save_file({key: t.contiguous() for key, t in tensors.items()}, str(path))


def reload(case: Case, directory: Path | str) -> torch.nn.Module:
    return case.model_cls.from_pretrained(directory, **case.impl(), dtype=torch.float32).eval()


def assert_reproduces(model: torch.nn.Module, golden: Path, input_ids: torch.Tensor, what: str) -> None:
    """``golden`` holds exactly ``input_ids`` and logits that ``model`` reproduces bit for bit."""
    stored = load_file(str(golden))
    assert set(stored) - {"logits_float64", "mtp_logits"} == {"input_ids", "logits"}
    assert torch.equal(stored["input_ids"], input_ids)
    relogits = logits(model, stored["input_ids"])
    max_diff = float((relogits - stored["logits"]).abs().max())
    assert torch.equal(relogits, stored["logits"]), f"{what} differ (max {max_diff:.3e})"


def grouped_mm_note(run: Run) -> None:
    try:
        other = run.case.model_cls.from_pretrained(run.dir, attn_implementation="eager", dtype=torch.float32).eval()
        impl = other.config._experts_implementation
        diff = float((logits(other, run.input_ids) - run.logits).abs().max())
        print(f"  (info) default experts_implementation={impl!r}: max|logits - golden| = {diff:.3e}")
    except Exception as exc:  # informational only
        print(f"  (info) default experts implementation failed: {exc!r}")


def versions(cases: Iterable[Case]) -> dict[str, Any]:
    """Contents of versions.json (library versions and the generation settings of all cases)."""
    cases = tuple(cases)
    info = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "seq_len": SEQ_LEN,
        "batch": BATCH,
        "model_seed": MODEL_SEED,
        "input_seed": INPUT_SEED,
        "case_seeds": {c.name: c.seed for c in cases if c.seed != MODEL_SEED},
        "moe_router_std": ROUTER_STD,
        "deepseek_bias_seed": BIAS_SEED,
        "deepseek_bias_scale": BIAS_SCALE,
        "experts_implementation": EXPERTS_IMPL,
        "case_seq_len": {c.name: c.seq_len for c in cases if c.seq_len != SEQ_LEN},
        "zero_centered_norm_std": NORM_STD,
    }
    for c in cases:
        info.update(c.versions)
    return info


def make_case(case: Case, out: Path) -> None:
    """Write ``out/<case>/`` (config, weights, golden logits), run the case's checks and the reload round trip."""
    print(f"[{case.name}]")
    d = out / case.name
    d.mkdir(parents=True, exist_ok=True)
    model = build(case)
    input_ids = case.input_ids()
    out_logits = logits(model, input_ids)
    assert out_logits.shape == (BATCH, input_ids.shape[1], VOCAB) and out_logits.dtype == torch.float32

    model.save_pretrained(d, safe_serialization=True)
    # Not needed by anything (no generation defaults for random models); keep assets minimal.
    (d / "generation_config.json").unlink(missing_ok=True)
    write_golden(d / "golden.safetensors", input_ids, out_logits)
    run = Run(case, model, input_ids, out_logits, d)
    for check in case.checks:
        check(run)

    # Round trip: reload the saved directory and compare bit-exactly.
    reloaded = reload(case, d)
    assert_reproduces(reloaded, d / "golden.safetensors", input_ids, f"{case.name}: reloaded logits")
    weights = load_file(str(d / "model.safetensors"))
    for name, b in model.named_buffers():  # persistent buffers (correction bias, hash table) round-trip
        if name.endswith("e_score_correction_bias") or name.endswith("tid2eid"):
            assert torch.equal(weights[case.hub_name(name)], b)
            assert torch.equal(reloaded.get_buffer(name), b)
    assert all(t.dtype == torch.float32 for k, t in weights.items() if not k.endswith("tid2eid")), "weights not float32"
    if case.moe:
        grouped_mm_note(run)

    for f in sorted(d.iterdir()):
        print(f"  {f.name:20s} {f.stat().st_size:>9d} bytes")
        assert f.stat().st_size < MAX_FILE_BYTES, f"{f} too large"
    print(
        f"  max|logit| = {float(out_logits.abs().max()):.4f}, "
        f"tensors in model.safetensors: {len(weights)}, "
        f"lm_head.weight stored: {'lm_head.weight' in weights}"
    )
    print("  reload check: logits bit-identical")
