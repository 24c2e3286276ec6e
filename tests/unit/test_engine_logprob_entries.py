"""The engine adapters' pure parts, without the engines. Reading the sampled tokens' log-probs out of
each engine's own output format: looked up by token id, never by position in a top-k list; anything
missing or misaligned raises. Checking ``[engine.extra_args]`` against the engine's own arguments."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from mismatch_probe.engines import sglang_logprobs as sglang
from mismatch_probe.engines import vllm
from mismatch_probe.engines.base import check_extra_args
from mismatch_probe.engines.sglang import UNPINNED_CAPTURE_WORKAROUND, unpinned_capture_workaround
from mismatch_probe.errors import ConfigError


def test_sglang_triples_are_checked_against_the_sampled_ids():
    tokens = np.array([5, 9, 2], np.int32)
    entries = [(-0.5, 5, None), (-1.25, 9, None), (-0.0, 2, "<|im_end|>")]
    np.testing.assert_array_equal(sglang.sampled_logprobs(entries, tokens), np.array([-0.5, -1.25, 0.0], np.float32))
    assert sglang.sampled_logprobs([], np.zeros(0, np.int32)).shape == (0,)  # an empty response
    with pytest.raises(RuntimeError, match="entry 1 is for token 8, but the token there is 9"):
        sglang.sampled_logprobs([(-0.5, 5, None), (-1.0, 8, None), (-0.1, 2, None)], tokens)
    with pytest.raises(RuntimeError, match="no log-prob for token 9 at position 1"):
        sglang.sampled_logprobs([(-0.5, 5, None), (None, 9, None), (-0.1, 2, None)], tokens)
    with pytest.raises(RuntimeError, match="2 log-prob entries for 3 tokens"):
        sglang.sampled_logprobs(entries[:2], tokens)
    with pytest.raises(RuntimeError, match="none log-prob entries"):
        sglang.sampled_logprobs(None, tokens)


def test_a_prefill_entry_sglang_reports_as_token_0_at_the_last_vocabulary_id_is_taken_as_it(tmp_path):
    """SGLang rewrites a returned prompt id x to 0 unless x < vocab_size - 1: the workaround puts
    back exactly that pair (reported 0, our token V - 1) and nothing else."""
    (tmp_path / "config.json").write_text('{"vocab_size": 1024}')
    assert sglang.text_vocab_size(tmp_path) == 1023 + 1
    (tmp_path / "config.json").write_text('{"text_config": {"vocab_size": 512}, "vocab_size": 9}')
    assert sglang.text_vocab_size(tmp_path) == 512  # SGLang's ModelConfig reads the text config's
    assert sglang.text_vocab_size(tmp_path / "absent") is None

    tokens = np.array([7, 1023, 3, 1023, 0], np.int32)
    entries = [(-0.5, 7, None), (-2.0, 0, None), (-0.1, 3, None), (-3.0, 0, None), (-0.7, 0, None)]
    fixed, restored = sglang.restore_last_id(entries, tokens, 1023)
    assert restored == 2 and [e[1] for e in fixed] == [7, 1023, 3, 1023, 0]
    np.testing.assert_array_equal(
        sglang.sampled_logprobs(fixed, tokens), np.array([-0.5, -2.0, -0.1, -3.0, -0.7], np.float32)
    )
    assert entries[1][1] == 0  # the answer itself is left as it came
    # any other disagreement is still the engine's error: another id at V - 1; 0 where the token
    # is not V - 1 (the pair at V - 1 beside it is restored, the other still raises)
    for wrong, n_restored in (([(-0.5, 7, None), (-2.0, 5, None)], 0), ([(-0.5, 0, None), (-2.0, 0, None)], 1)):
        got, restored = sglang.restore_last_id(wrong, tokens[:2], 1023)
        assert restored == n_restored
        with pytest.raises(RuntimeError, match="is for token"):
            sglang.sampled_logprobs(got, tokens[:2])
    assert sglang.restore_last_id(entries, tokens, None) == (entries, 0)
    # what run.json records
    record = sglang.last_id_workaround(1023, 2)["last_vocab_id_reported_as_0"]
    assert record["restored"] == 2 and record["token_id"] == 1023 and "engine-findings" in record["what"]
    assert sglang.last_id_workaround(None, 0) == {}
    # what both SGLang adapters read prefills with: restored, counted over calls, recorded
    (tmp_path / "config.json").write_text('{"vocab_size": 1024}')
    reader = sglang.PrefillLogprobs(tmp_path)
    for _ in range(2):
        np.testing.assert_array_equal(
            reader.read(entries, tokens), np.array([-0.5, -2.0, -0.1, -3.0, -0.7], np.float32)
        )
    assert reader.workarounds()["last_vocab_id_reported_as_0"]["restored"] == 4


def test_sglang_finish_reasons_and_an_abort_that_is_not_a_sample():
    assert sglang.finish_reason({"finish_reason": {"type": "stop", "matched": 2}}, "r") == "stop"
    assert sglang.finish_reason({"finish_reason": {"type": "length", "length": 64}}, "r") == "length"
    assert sglang.finish_reason({"finish_reason": None}, "r") == "length"  # max_new_tokens = 0
    abort = {
        "type": "abort",
        "message": "Input length (9000 tokens) exceeds the maximum allowed length",
        "status_code": 400,
        "err_type": None,
    }
    with pytest.raises(
        RuntimeError, match=r"aborted sampling request 3: Input length \(9000 tokens\).*--max-model-len"
    ):
        sglang.finish_reason({"finish_reason": abort}, "sampling request 3")


def test_vllm_entries_are_looked_up_by_id_in_flat_and_dict_form():
    tokens = np.array([4, 7, 3], np.int32)
    # per position: the sampled token, then the top-1 when it differs (vLLM's order)
    flat = SimpleNamespace(
        start_indices=[0, 1, 3], end_indices=[1, 3, 4], token_ids=[4, 7, 1, 3], logprobs=[-0.1, -2.0, -0.2, -0.3]
    )
    np.testing.assert_allclose(vllm.sampled_logprobs(flat, tokens), [-0.1, -2.0, -0.3])
    np.testing.assert_allclose(vllm.sampled_logprobs(flat, tokens, first=1), [-2.0, -0.3])
    as_dicts = [
        {4: SimpleNamespace(logprob=-0.1)},
        {1: SimpleNamespace(logprob=-0.2), 7: SimpleNamespace(logprob=-2.0)},
        {3: SimpleNamespace(logprob=-0.3)},
    ]
    np.testing.assert_allclose(vllm.sampled_logprobs(as_dicts, tokens), [-0.1, -2.0, -0.3])
    with pytest.raises(RuntimeError, match="no log-prob for token 7 at position 1"):
        vllm.sampled_logprobs([as_dicts[0], {1: SimpleNamespace(logprob=-0.2)}, as_dicts[2]], tokens)


def test_extra_args_must_be_engine_arguments_mismatch_probe_does_not_set():
    known = {"enable_prefix_caching", "max_logprobs", "tensor_parallel_size", "seed"}
    check_extra_args({"max_logprobs": 5}, known, {"tensor_parallel_size"}, "vLLM 0.32", "EngineArgs")
    check_extra_args({}, known, {"tensor_parallel_size"}, "vLLM 0.32", "EngineArgs")
    with pytest.raises(ConfigError, match=r"vLLM 0.32 has no argument 'enable_prefx_caching' \(EngineArgs\)") as e:
        check_extra_args({"enable_prefx_caching": True}, known, (), "vLLM 0.32", "EngineArgs")
    assert e.value.hint == "did you mean 'enable_prefix_caching'?"
    with pytest.raises(ConfigError) as e:
        check_extra_args({"zzz": 1}, known, (), "SGLang 0.5.23", "ServerArgs")
    assert e.value.hint == "see ServerArgs"
    with pytest.raises(ConfigError, match="sets 'tensor_parallel_size', which mismatch-probe sets itself"):
        check_extra_args(
            {"max_logprobs": 5, "tensor_parallel_size": 2},
            known,
            {"tensor_parallel_size": 1},
            "vLLM 0.32",
            "EngineArgs",
        )


def test_an_applied_workaround_has_a_row_of_its_own_in_the_report():
    from mismatch_probe.record import EngineInfo, RunRecord
    from mismatch_probe.report.labels import setup_rows, workaround_rows

    record = RunRecord(
        engine=EngineInfo.model_validate({"engine": "sglang", "workarounds": sglang.last_id_workaround(1023, 0)})
    )
    assert workaround_rows(record) == []  # recorded, never applied: nothing to say
    record.engine = EngineInfo.model_validate({"engine": "sglang", "workarounds": sglang.last_id_workaround(1023, 3)})
    ((name, text),) = workaround_rows(record)
    assert name == "engine workarounds" and text.endswith(": 3 entries") and sglang.LAST_ID_FINDING in text
    settings = dict(setup_rows(record))["engine settings"]
    assert "workarounds" not in settings  # not repeated among the settings
    # a workaround that holds for the whole run (how SGLang's CPU routing buffer is allocated) has no count
    both = {**sglang.last_id_workaround(1023, 3), **unpinned_capture_workaround("unpinned")}
    record.engine = EngineInfo.model_validate({"engine": "sglang", "workarounds": both})
    ((_, text),) = workaround_rows(record)
    assert ": 3 entries; " in text and text.endswith(UNPINNED_CAPTURE_WORKAROUND)
