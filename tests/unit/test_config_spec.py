"""The probe spec's pydantic models: strict types, one-line errors with the file's line, variants."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from mismatch_probe.config.spec import (
    CorrectionThresholds,
    EngineSpec,
    ProbeSpec,
    SamplingSpec,
    apply_overrides,
    load_spec_file,
    spec_from_dict,
)
from mismatch_probe.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def load(tmp_path: Path, text: str) -> ProbeSpec:
    p = tmp_path / "probe.toml"
    p.write_text(text)
    return load_spec_file(p)


def error(tmp_path: Path, text: str) -> str:
    with pytest.raises(ConfigError) as exc:
        load(tmp_path, text)
    assert exc.value.exit_code == 2 and "\n" not in str(exc.value)
    return str(exc.value).replace(str(tmp_path) + "/", "")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            'name = "x"\n[engine]\n\ndtyp = "bf16"\n',
            "probe.toml:4 [engine]: unknown key 'dtyp' (did you mean 'dtype'?)",
        ),
        ('\nmodle = "x"\n', "probe.toml:2: unknown key 'modle' (did you mean 'model'?)"),
        ("[sampling]\nseed = 0\nn = 1.5\n", "probe.toml:3: sampling.n must be an integer, got 1.5"),
        ('[sampling]\ntop_k = "2"\n', "probe.toml:2: sampling.top_k must be an integer, got '2'"),
        ('[reference]\npacking = "yes"\n', "probe.toml:2: reference.packing must be true or false, got 'yes'"),
        ('[sampling]\ntemperature = "hot"\n', "probe.toml:2: sampling.temperature must be a number, got 'hot'"),
        ("[engine]\nname = 3\n", "probe.toml:2: engine.name must be a string, got 3"),
        ("[engine]\nextra_args = 3\n", "probe.toml:2: engine.extra_args must be a table, got 3"),
        ('model = "m"\nengine = 3\n', "probe.toml:2: [engine] must be a table"),
        (
            "\n[corrections]\ntoken_tis = 0.5\n",
            "probe.toml:2: [corrections] correction threshold token_tis must be > 1",
        ),
        ('max_turns = "2"\n', "probe.toml:1: max_turns must be an integer, got '2'"),
    ],
)
def test_errors_name_the_key_and_its_line(tmp_path, text, message):
    assert error(tmp_path, text).startswith(message)


def test_a_value_of_the_wrong_type_in_python_is_a_validation_error():
    with pytest.raises(ValidationError):
        SamplingSpec(n="2")
    spec = ProbeSpec()
    with pytest.raises(ValidationError):
        spec.sampling.top_p = "high"  # validated on assignment too
    with pytest.raises(ValidationError, match="token_tis"):
        CorrectionThresholds(token_tis=0.5)
    with pytest.raises(ValidationError):
        CorrectionThresholds().token_tis = 3.0  # frozen, as the dataclass was


def test_integers_are_numbers_and_stored_as_floats():
    spec = spec_from_dict({"sampling": {"temperature": 1}, "corrections": {"token_tis": 3}})
    assert repr(spec.sampling.temperature) == "1.0" and repr(spec.corrections.token_tis) == "3.0"


def test_overrides_are_checked_like_the_file():
    spec = ProbeSpec()
    with pytest.raises(ConfigError, match=r"^--sampling-top-p must be a number, got 'x'$"):
        apply_overrides(spec, {"sampling.top_p": "x"})
    with pytest.raises(
        ConfigError, match=r"override: unknown key 'tensor_parallel'.*did you mean 'tensor_parallel_size'"
    ):
        apply_overrides(spec, {"engine.tensor_parallel": 2})
    with pytest.raises(ConfigError, match=r"^corrections.seq_mis: correction threshold seq_mis must be > 1"):
        apply_overrides(spec, {"corrections.seq_mis": 1.0})
    apply_overrides(spec, {"corrections.seq_mis": 3.0, "engine.tensor_parallel_size": 2})
    assert spec.corrections.seq_mis == 3.0 and spec.engine.tensor_parallel_size == 2


VARIANTS = """\
model = "m"
prompts = "p"
[[variants]]
name = "a"
reference.tensor_parallel_size = 2
[[variants]]
name = "b"
[variants.corrections]
token_tis = 3
[[variants]]
name = "c"
[variants.reference]
dtype = "fp32"
logits_fp32 = "no"
"""


def test_variant_errors_point_at_the_variant(tmp_path):
    assert (
        error(tmp_path, VARIANTS) == "probe.toml:14: variants[2].reference.logits_fp32 must be true or false, got 'no'"
    )
    text = VARIANTS.replace('logits_fp32 = "no"', "tp = 2")
    assert error(tmp_path, text).startswith("probe.toml:14: variants[2].reference: unknown key 'tp'")
    text = VARIANTS.replace('logits_fp32 = "no"', "").replace('name = "b"', 'name = "a"')
    assert error(tmp_path, text) == "probe.toml:6: variants[1]: the name 'a' is used twice"


def test_variants_record_only_what_they_change(tmp_path):
    spec = load(tmp_path, VARIANTS.replace('logits_fp32 = "no"\n', "")).validate()
    assert spec.to_dict()["variants"] == [
        {"name": "a", "reference": {"tensor_parallel_size": 2}},
        {"name": "b", "corrections": {"token_tis": 3.0}},
        {"name": "c", "reference": {"dtype": "fp32"}},
    ]
    expanded = dict(spec.expand_variants(tmp_path / "out"))
    assert expanded["c"].validate().reference.dtype == "float32"
    assert expanded["b"].corrections.token_tis == 3.0 and expanded["a"].corrections.token_tis == 2.0
    assert expanded["a"].given_paths == {k: v for k, v in spec.given_paths.items() if k != "out"}
    assert expanded["a"].given_paths is not spec.given_paths


def test_a_variant_whose_corrections_are_out_of_range_is_named(tmp_path):
    text = VARIANTS.replace("token_tis = 3", "token_tis = 0.5").replace('logits_fp32 = "no"\n', "")
    with pytest.raises(ConfigError, match=r"^variant 'b': \[corrections\] correction threshold token_tis must be > 1"):
        load(tmp_path, text).validate()


def test_committed_runs_record_their_spec_exactly_as_the_models_dump_it():
    """run.json's ``spec`` of every committed example, through the models and back, byte for byte."""
    records = sorted((ROOT / "reports").rglob("run.json"))
    assert records
    for path in records:
        spec = json.loads(path.read_text())["spec"]
        assert json.dumps(ProbeSpec.model_validate(spec).model_dump()) == json.dumps(spec), path


def test_to_dict_keeps_the_paths_as_given(tmp_path):
    spec = load(tmp_path, 'model = "../m"\nprompts = "p.jsonl"\n')
    d = spec.to_dict()
    assert (d["model"], d["prompts"]) == ("../m", "p.jsonl")
    assert spec.model == str((tmp_path / "../m").resolve())
    assert "given_paths" not in d and "given_paths" not in ProbeSpec.model_fields


def test_engine_spec_copies_and_fields():
    e = EngineSpec(name="vllm")
    assert e.model_copy(update={"logprobs_mode": "raw"}).logprobs_mode == "raw" and e.logprobs_mode is None
    assert EngineSpec(**e.model_dump()) == e  # what the engine worker rebuilds from the wire


def test_fsdp_policy_defaults_are_verls_and_its_dtypes_are_checked():
    spec = spec_from_dict({"model": "m", "prompts": "p"})
    fingerprint = spec.fingerprint()
    r = spec.reference
    assert (r.fsdp, r.fsdp_param_dtype, r.fsdp_reduce_dtype, r.fsdp_output_dtype) == (
        False,
        "bfloat16",
        "float32",
        None,
    )
    # settings added later are recorded only when set: earlier runs keep their spec and fingerprint
    assert "fsdp" not in spec.to_dict()["reference"]
    apply_overrides(spec, {"reference.fsdp": True, "reference.fsdp_param_dtype": "fp32"})
    spec.validate()
    assert spec.reference.fsdp and spec.reference.fsdp_param_dtype == "float32"
    assert spec.to_dict()["reference"]["fsdp_param_dtype"] == "float32" and spec.fingerprint() != fingerprint
    apply_overrides(spec, {"reference.fsdp_output_dtype": "fp33"})
    with pytest.raises(ConfigError, match="unknown dtype 'fp33' for reference.fsdp_output_dtype"):
        spec.validate()
