"""Spec files and flag overrides: precedence, paths, validation messages."""

from __future__ import annotations

from pathlib import Path

import pytest

from mismatch_probe.config.spec import EngineSpec, ProbeSpec, ReferenceSpec
from mismatch_probe.config.spec_reading import apply_overrides, load_spec_file, spec_from_dict
from mismatch_probe.errors import ConfigError


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "probe.toml"
    p.write_text(text)
    return p


def test_spec_file_paths_are_relative_to_the_file(tmp_path):
    sub = tmp_path / "probes"
    sub.mkdir()
    spec = load_spec_file(write(sub, 'model = "../m"\nprompts = "/abs/p.jsonl"\n[engine]\ndtype = "bf16"\n'))
    assert spec.model == str((tmp_path / "m").resolve())
    assert spec.prompts == "/abs/p.jsonl"
    assert spec.engine.dtype == "bf16"
    assert spec.normalized().engine.dtype == "bfloat16" and spec.engine.dtype == "bf16"  # a normalized copy


def test_flags_override_the_file(tmp_path):
    spec = load_spec_file(write(tmp_path, 'model = "m"\nprompts = "p"\n[sampling]\ntemperature = 0.7\nn = 3\n'))
    spec = apply_overrides(spec, {"sampling.temperature": 1.0, "sampling.n": None, "reference.dtype": "fp16"})
    assert spec.sampling.temperature == 1.0
    assert spec.sampling.n == 3  # None means "flag not given"
    assert spec.reference.dtype == "fp16"


def test_corrections_section_is_validated(tmp_path):
    spec = load_spec_file(write(tmp_path, "[corrections]\ntoken_tis = 3.0\n"))
    assert spec.corrections.token_tis == 3.0
    with pytest.raises(ConfigError, match="token_tis"):
        load_spec_file(write(tmp_path, "[corrections]\ntoken_tis = 0.5\n"))


@pytest.mark.parametrize(
    "text, match",
    [
        ('[engine]\ndtyp = "bf16"\n', r"unknown key 'dtyp'.*did you mean 'dtype'"),
        ('modle = "x"\n', r"unknown key 'modle'.*did you mean 'model'"),
        ("[sampling]\nn = 1.5\n", "sampling.n must be an integer"),
        ('[reference]\npacking = "yes"\n', "reference.packing must be true or false"),
        ("engine = 3\n", r"\[engine\] must be a table"),
        ("model = [\n", "invalid TOML"),
    ],
)
def test_bad_spec_files_name_the_problem(tmp_path, text, match):
    with pytest.raises(ConfigError, match=match):
        load_spec_file(write(tmp_path, text))


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"engine.dtype": "fp8"}, "--engine-dtype must be one of auto, float32, bfloat16, float16, got 'fp8'"),
        ({"reference.dtype": "auto"}, "--train-dtype must be one of float32, bfloat16, float16, got 'auto'"),
        ({"sampling.top_p": 0.0}, "--top-p must be > 0, got 0.0"),
        ({"sampling.temperature": -1.0}, "--temperature must be >= 0, got -1.0"),
        ({"sampling.max_tokens": 0}, "--max-tokens must be >= 1, got 0"),
        ({"sampling.top_k": -2}, "--top-k must be >= -1, got -2"),
        ({"engine.logprobs_mode": "scaled"}, "--logprobs-mode must be one of raw, processed, got 'scaled'"),
        (
            {"reference.attn_implementation": "magic"},
            (
                "--train-attn must be one of auto, sdpa, eager, flash_attention_2, flash_attention_3, flex_attention, "
                "got 'magic'"
            ),
        ),
        ({"engine.gpu_memory_utilization": 1.5}, "--gpu-memory-utilization must be <= 1, got 1.5"),
        ({"reference.packing": "yes"}, "--packing/--no-packing must be true or false, got 'yes'"),
    ],
)
def test_validation_messages_name_the_flag(overrides, message):
    with pytest.raises(ConfigError) as exc:
        apply_overrides(ProbeSpec(model="m", prompts="p"), overrides)
    assert str(exc.value) == message


def test_missing_model_and_prompts():
    with pytest.raises(ConfigError, match="no model"):
        ProbeSpec(prompts="p").check_runnable()
    with pytest.raises(ConfigError, match="no prompts"):
        ProbeSpec(model="m").check_runnable()


def test_top_k_minus_one_means_disabled_and_greedy_forces_raw():
    spec = spec_from_dict(
        {
            "model": "m",
            "prompts": "p",
            "sampling": {"top_k": -1, "temperature": 0.0},
            "engine": {"logprobs_mode": "processed"},
        }
    ).normalized()
    assert spec.sampling.top_k == 0
    assert spec.engine.logprobs_mode == "raw"


def test_engine_logprobs_default_to_what_each_engine_returns():
    """Unset, logprobs_mode is the engine's own default: SGLang's sampler returns log_softmax(logits / T),
    vLLM and hf raw log-probs. An explicit choice is kept."""
    resolved = {
        name: spec_from_dict({"model": "m", "prompts": "p", "engine": {"name": name}}).normalized().engine.logprobs_mode
        for name in ("hf", "vllm", "sglang")
    }
    assert resolved == {"hf": "raw", "vllm": "raw", "sglang": "processed"}
    spec = spec_from_dict({"model": "m", "prompts": "p", "engine": {"name": "sglang", "logprobs_mode": "raw"}})
    assert spec.normalized().engine.logprobs_mode == "raw"


def test_fingerprint_ignores_output_location():
    a = ProbeSpec(model="m", prompts="p", out="x")
    b = ProbeSpec(model="m", prompts="p", out="y")
    assert a.fingerprint() == b.fingerprint()
    b.sampling.seed = 1
    assert a.fingerprint() != b.fingerprint()
    c = ProbeSpec(model="m", prompts="p", reference=ReferenceSpec(dtype="bf16"))
    assert c.fingerprint() == ProbeSpec(model="m", prompts="p").fingerprint()  # of the normalized spec


@pytest.mark.parametrize(
    "name", ["demo.toml", "demo-hf.toml", "demo-multi-turn.toml", "parallelism-tp2.toml", "demo-sglang.toml"]
)
def test_demo_specs_are_valid(name):
    from mismatch_probe.engines import get_entry

    spec = load_spec_file(Path(__file__).resolve().parents[2] / "probes" / name)
    if spec.engine.python and not Path(spec.engine.python).exists():
        assert spec.engine.python.endswith("/.venv-sglang/bin/python")  # built by tests/sglang-cpu/install.sh
        spec.engine.python = None
    spec.check_runnable()
    spec = spec.normalized()
    assert Path(spec.model).is_dir() and Path(spec.prompts).is_file()
    get_entry(spec.engine.name).check_settings(spec.engine)


def test_engine_python_and_extra_args_from_a_spec_file(tmp_path):
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    (tmp_path / "venv" / "bin" / "python").write_text("")
    f = tmp_path / "p.toml"
    f.write_text(
        'model = "m"\nprompts = "p"\n[engine]\nname = "vllm"\npython = "venv/bin/python"\n'
        "[engine.extra_args]\nmax_logprobs = 5\n"
    )
    spec = load_spec_file(f)
    spec.check_runnable()
    assert spec.engine.python == str(tmp_path / "venv" / "bin" / "python")
    assert spec.engine.extra_args == {"max_logprobs": 5}


def test_engine_settings_are_checked_per_engine():
    from mismatch_probe.engines import get_entry

    with pytest.raises(
        ConfigError, match=r"engine .hf. has no setting engine.prefix_caching \(--prefix-caching/--no-prefix-caching\)"
    ):
        get_entry("hf").check_settings(EngineSpec(prefix_caching=False))
    with pytest.raises(ConfigError, match="engine 'vllm' has no setting engine.attn_implementation"):
        get_entry("vllm").check_settings(EngineSpec(name="vllm", attn_implementation="eager"))
    get_entry("vllm").check_settings(EngineSpec(name="vllm", tensor_parallel_size=2, prefix_caching=False))


VARIANTS = """
name = "study"
model = "m"
prompts = "p"
[reference]
dtype = "bf16"
[[variants]]
name = "tp2"
reference.tensor_parallel_size = 2
[[variants]]
name = "sp2"
[variants.reference]
sequence_parallel_size = 2
[variants.corrections]
token_tis = 3.0
"""


def test_variants_expand_to_one_spec_each_on_the_same_rollouts(tmp_path):
    spec = load_spec_file(write(tmp_path, VARIANTS)).normalized()
    expanded = dict(spec.expand_variants(tmp_path / "out"))
    assert list(expanded) == ["tp2", "sp2"]
    tp2, sp2 = expanded["tp2"], expanded["sp2"]
    assert (tp2.reference.tensor_parallel_size, tp2.reference.sequence_parallel_size) == (2, 1)
    assert (sp2.reference.tensor_parallel_size, sp2.reference.sequence_parallel_size) == (1, 2)
    assert tp2.reference.dtype == sp2.reference.dtype == "bfloat16"  # the shared [reference] stays
    assert (tp2.corrections.token_tis, sp2.corrections.token_tis) == (2.0, 3.0)
    assert tp2.out == str(tmp_path / "out" / "tp2") and tp2.name == "study-tp2" and tp2.variants == []
    assert tp2.rollout_fingerprint() == sp2.rollout_fingerprint() == spec.rollout_fingerprint()
    assert tp2.fingerprint() != sp2.fingerprint()
    sp2.reference.dtype = "float32"  # each variant is its own copy
    assert tp2.reference.dtype == "bfloat16"
    sp2.sampling.top_p = 0.9
    assert sp2.rollout_fingerprint() != tp2.rollout_fingerprint()


@pytest.mark.parametrize(
    "variants, match",
    [
        ('[[variants]]\nreference.dtype = "fp32"\n[[variants]]\nname = "b"', "needs a name"),
        ('[[variants]]\nname = "a/b"\n[[variants]]\nname = "c"', "needs a name"),
        ('[[variants]]\nname = "a"\n[[variants]]\nname = "a"', "used twice"),
        ('[[variants]]\nname = "a"\nsampling.top_p = 0.5\n[[variants]]\nname = "b"', "'sampling' cannot vary"),
        ('[[variants]]\nname = "a"\nreference.tp = 2\n[[variants]]\nname = "b"', "unknown key 'tp'"),
        (
            '[[variants]]\nname = "a"\nreference.tensor_parallel_size = "2"\n[[variants]]\nname = "b"',
            "must be an integer",
        ),
        ('[[variants]]\nname = "a"', "one variant compares nothing"),
        ("variants = 3", "array of tables"),
    ],
)
def test_bad_variants_name_the_problem(tmp_path, variants, match):
    with pytest.raises(ConfigError, match=match):
        load_spec_file(write(tmp_path, f'model = "m"\nprompts = "p"\n{variants}\n'))


def test_a_variant_that_cannot_run_is_named(tmp_path):
    text = (
        'model = "m"\nprompts = "p"\n[[variants]]\nname = "a"\n[[variants]]\nname = "padded-sp"\n'
        "[variants.reference]\nsequence_parallel_size = 2\npacking = false\n"
    )
    with pytest.raises(ConfigError, match="variant 'padded-sp': Ulysses"):
        load_spec_file(write(tmp_path, text))
