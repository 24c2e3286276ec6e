"""The probe spec's pydantic models: strict types, one-line errors with the file's line, variants."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from mismatch_probe.config.spec import (
    FINGERPRINT_SCHEMA,
    CorrectionThresholds,
    EngineSpec,
    ProbeSpec,
    SamplingSpec,
    rollout_fingerprint,
)
from mismatch_probe.config.spec_reading import apply_overrides, load_spec_file, spec_from_dict
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
        ("\n[corrections]\ntoken_tis = 0.5\n", "probe.toml:3: corrections.token_tis must be > 1, got 0.5"),
        ("[sampling]\ntop_p = 2\n", "probe.toml:2: sampling.top_p must be <= 1, got 2"),
        (
            '[engine]\ndtype = "fp8"\n',
            "probe.toml:2: engine.dtype must be one of auto, float32, bfloat16, float16, got 'fp8'",
        ),
        ("[reference]\nsequence_parallel_size = 2\npacking = false\n", "probe.toml:3: Ulysses sequence parallelism"),
        ('[engine]\nnnodes = 2\nname = "vllm"\n', "probe.toml:2: engine.nnodes = 2 needs engine.dist_init_addr"),
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


def test_overrides_are_checked_like_the_file_and_name_the_flag_or_the_setting():
    spec = ProbeSpec()
    with pytest.raises(ConfigError, match=r"^--top-p must be a number, got 'x'$"):
        apply_overrides(spec, {"sampling.top_p": "x"})
    with pytest.raises(ConfigError, match=r"^--top-p must be <= 1, got 2$"):
        apply_overrides(spec, {"sampling.top_p": 2})
    with pytest.raises(ConfigError, match=r"^--set sampling.top_p must be <= 1, got 2$"):
        apply_overrides(spec, {"sampling.top_p": 2}, named_by="set")
    with pytest.raises(ConfigError, match=r"^sampling.top_p must be <= 1, got 2$"):
        apply_overrides(spec, {"sampling.top_p": 2}, named_by="key")
    with pytest.raises(
        ConfigError, match=r"override: unknown key 'tensor_parallel'.*did you mean 'tensor_parallel_size'"
    ):
        apply_overrides(spec, {"engine.tensor_parallel": 2})
    with pytest.raises(ConfigError, match=r"^--seq-mis must be > 1, got 1.0"):
        apply_overrides(spec, {"corrections.seq_mis": 1.0})
    changed = apply_overrides(spec, {"corrections.seq_mis": 3.0, "engine.tensor_parallel_size": 2})
    assert changed.corrections.seq_mis == 3.0 and changed.engine.tensor_parallel_size == 2
    assert spec.corrections.seq_mis == 2.0  # a new spec; the one given is left as it was


def test_settings_that_only_hold_together_can_be_given_together():
    """The overrides are validated as a whole: sequence parallelism with packing, given at once,
    is fine even when the file turned packing off."""
    spec = spec_from_dict({"reference": {"packing": False}})
    changed = apply_overrides(spec, {"reference.sequence_parallel_size": 2, "reference.packing": True})
    assert changed.reference.sequence_parallel_size == 2
    with pytest.raises(ConfigError, match=r"Ulysses sequence parallelism \(--train-sp\)"):
        apply_overrides(spec, {"reference.sequence_parallel_size": 2})


def test_a_table_setting_given_as_a_flag_adds_to_the_files_table():
    spec = spec_from_dict({"engine": {"name": "vllm", "extra_args": {"max_logprobs": 5, "seed": 1}}})
    changed = apply_overrides(spec, {"engine.extra_args": {"seed": 2}})
    assert changed.engine.extra_args == {"max_logprobs": 5, "seed": 2}


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
    spec = load(tmp_path, VARIANTS.replace('logits_fp32 = "no"\n', "")).normalized()
    assert spec.to_dict()["variants"] == [
        {"name": "a", "reference": {"tensor_parallel_size": 2}},
        {"name": "b", "corrections": {"token_tis": 3.0}},
        {"name": "c", "reference": {"dtype": "fp32"}},
    ]
    expanded = dict(spec.expand_variants(tmp_path / "out"))
    assert expanded["c"].normalized().reference.dtype == "float32"
    assert expanded["b"].corrections.token_tis == 3.0 and expanded["a"].corrections.token_tis == 2.0
    assert expanded["a"].given_paths == {k: v for k, v in spec.given_paths.items() if k != "out"}
    assert expanded["a"].given_paths is not spec.given_paths


def test_a_variant_whose_corrections_are_out_of_range_is_named(tmp_path):
    text = VARIANTS.replace("token_tis = 3", "token_tis = 0.5").replace('logits_fp32 = "no"\n', "")
    assert error(tmp_path, text) == "probe.toml:9: variants[1].corrections.token_tis must be > 1, got 0.5"


def test_a_variant_that_breaks_a_rule_of_its_section_is_named_at_its_line(tmp_path):
    text = 'model = "m"\nprompts = "p"\n[reference]\npacking = false\n'
    text += '[[variants]]\nname = "a"\n[[variants]]\nname = "sp"\nreference.sequence_parallel_size = 2\n'
    assert error(tmp_path, text).startswith("probe.toml:9: variant 'sp': Ulysses sequence parallelism")


def test_committed_runs_record_their_spec_exactly_as_the_models_dump_it_by_their_schema():
    """run.json's ``spec`` of every committed example, through the models and back as a record of its
    schema holds it (schema 3: the settings added later only when set), byte for byte."""
    records = sorted((ROOT / "reports").rglob("run.json"))
    assert records
    for path in records:
        stored = json.loads(path.read_text())
        schema, spec = stored.get("fingerprint_schema", min(stored["schema_version"], 3)), stored["spec"]
        assert json.dumps(ProbeSpec.model_validate(spec).dump(schema)) == json.dumps(spec), path


# Fingerprints of schema 3, computed by the release before every setting was recorded (aa5dd98's
# config/spec.py, on these specs): runs recorded then must still be recognised, to resume them.
SCHEMA_3_FINGERPRINTS = [
    ({"model": "/m", "prompts": "/p"}, "bcc1bf7fe5149b25", "6d0508b6e2f1e41d"),
    (
        {"model": "/m", "prompts": "/p", "engine": {"name": "vllm", "dtype": "bf16", "tensor_parallel_size": 2}},
        "5c7d22543965d22e",
        "03078193ebf9e101",
    ),
    (
        {"model": "/m", "prompts": "/p", "engine": {"url": "http://h:1", "api": "sglang", "max_concurrency": 8}},
        "59cde38612da9342",
        "25c9ea6311908fc0",
    ),
    (
        {
            "model": "/m",
            "prompts": "/p",
            "engine": {"name": "vllm", "nnodes": 2, "dist_init_addr": "h:1", "pipeline_parallel_size": 2},
        },
        "adb8ff1b9cf04ad7",
        "6acea9342c9f584d",
    ),
    (
        {"model": "/m", "prompts": "/p", "reference": {"fsdp": True, "fsdp_param_dtype": "fp32", "dtype": "fp32"}},
        "50119c6ad4e1edaf",
        "6d0508b6e2f1e41d",
    ),
    (
        {
            "model": "/m",
            "prompts": "/p",
            "variants": [
                {"name": "a", "reference": {"tensor_parallel_size": 2}},
                {"name": "b", "corrections": {"seq_mis": 4.0}},
            ],
        },
        "bacee3f8e9bb4911",
        "6d0508b6e2f1e41d",
    ),
    (
        {
            "model": "/m",
            "prompts": "/p",
            "sweep": {"axes": [{"key": "engine.dtype", "values": ["bfloat16", "float32"]}]},
        },
        "31268688f6879a1e",
        "6d0508b6e2f1e41d",
    ),
]


@pytest.mark.parametrize(("data", "spec_fp", "rollout_fp"), SCHEMA_3_FINGERPRINTS)
def test_fingerprints_of_schema_3_are_what_that_schema_computed(data, spec_fp, rollout_fp):
    spec = ProbeSpec.model_validate(data)
    assert (spec.fingerprint(3), spec.rollout_fingerprint(3)) == (spec_fp, rollout_fp)
    assert rollout_fingerprint(spec.normalized().dump(3)) == rollout_fp  # from a stored spec, as old records need
    # the current schema records every setting, so its fingerprints are others
    assert spec.fingerprint() != spec_fp and spec.rollout_fingerprint() != rollout_fp


def test_the_fingerprint_schema_is_the_records():
    from mismatch_probe.record import SCHEMA_VERSION

    assert FINGERPRINT_SCHEMA == SCHEMA_VERSION


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
    # every setting is recorded; a schema-3 record held the ones added later only when set
    assert spec.to_dict()["reference"]["fsdp"] is False and "fsdp" not in spec.dump(3)["reference"]
    spec = apply_overrides(spec, {"reference.fsdp": True, "reference.fsdp_param_dtype": "fp32"}).normalized()
    assert spec.reference.fsdp and spec.reference.fsdp_param_dtype == "float32"
    assert spec.to_dict()["reference"]["fsdp_param_dtype"] == "float32" and spec.fingerprint() != fingerprint
    assert spec.dump(3)["reference"]["fsdp"] is True  # set: a schema-3 record held it too
    with pytest.raises(ConfigError, match="^--fsdp-output-dtype must be one of float32, bfloat16, float16, got 'fp33'"):
        apply_overrides(spec, {"reference.fsdp_output_dtype": "fp33"})
