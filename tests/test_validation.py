"""The shared input checks (phasewise.engine.validation): no model needed."""

import subprocess
import sys

import pytest

from phasewise.engine.validation import ValidationError, check_context, check_token_ids


def test_max_tokens_defaults_to_the_room_the_prompt_leaves():
    assert check_context(10, None, 64) == 54
    assert check_context(63, None, 64) == 1
    assert check_context(10, 54, 64) == 54
    assert check_context(10, 5, 64) == 5


@pytest.mark.parametrize("n,match", [
    (0, "prompt is empty"),
    (65, "prompt has 65 tokens, more than max_model_len \\(64\\).*at most 63"),
    (64, "prompt has 64 tokens, as many as max_model_len \\(64\\).*at most 63"),
])
def test_prompt_that_leaves_no_room_is_refused_naming_the_prompt(n, match):
    with pytest.raises(ValidationError, match=match) as e:
        check_context(n, None, 64)
    assert e.value.param == "prompt"
    assert isinstance(e.value, ValueError)


def test_max_tokens_beyond_the_room_is_refused_naming_its_param():
    with pytest.raises(ValidationError, match="max_tokens is 55.*prompt uses 10: at most 54") as e:
        check_context(10, 55, 64)
    assert e.value.param == "max_tokens"
    with pytest.raises(ValidationError, match="max_completion_tokens must be an integer >= 1") \
            as e:
        check_context(10, 0, 64, max_tokens_param="max_completion_tokens")
    assert e.value.param == "max_completion_tokens"
    with pytest.raises(ValidationError, match="messages has 70") as e:
        check_context(70, 1, 64, prompt_param="messages")
    assert e.value.param == "messages"


def test_token_ids_must_be_in_the_vocabulary():
    assert check_token_ids((1, 2, 99), 100) == [1, 2, 99]
    for bad in (100, -1, True, 2.0, "3"):
        with pytest.raises(ValidationError, match=r"integers in \[0, 100\); got ") as e:
            check_token_ids([1, bad], 100, "input_ids")
        assert e.value.param == "input_ids"
    with pytest.raises(ValidationError, match="empty") as e:
        check_token_ids([], 100)
    assert e.value.param == "prompt"


def test_validation_error_takes_param_by_keyword():
    e = ValidationError("bad thing", param="stop")
    assert (str(e), e.param) == ("bad thing", "stop")
    assert ValidationError("no field").param is None


def test_validation_imports_without_torch():
    code = ("import sys; sys.modules['torch'] = None\n"
            "import phasewise.engine.validation as v\n"
            "print(v.check_context(3, None, 8))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "5"


def test_a_request_may_not_ask_for_more_sequences_than_may_wait():
    from phasewise.engine.validation import check_sequences

    check_sequences(16, 16, 256)  # exactly the limit
    check_sequences(10**6, 16, None)  # no limit
    with pytest.raises(ValidationError, match="257 sequences") as err:
        check_sequences(257, 1, 256)
    assert err.value.param == "prompt"
    with pytest.raises(ValidationError, match=r"2 prompt\(s\) x n=16") as err:
        check_sequences(2, 16, 31)
    assert err.value.param == "n"


@pytest.mark.parametrize("field,value", [("stop", {"a": 1}), ("stop", {"a"}),
                                         ("stop_token_ids", {1: 2}), ("stop_token_ids", 7)])
def test_stop_lists_must_be_lists_not_sets_or_mappings(field, value):
    """A dict or a set would be taken by its keys (the relay once did so for a dict)."""
    from phasewise.engine.sampling_params import SamplingParams

    with pytest.raises(ValidationError, match=rf"{field} must be a list, got "
                                              rf"{type(value).__name__}") as e:
        SamplingParams(**{field: value})
    assert e.value.param == field
    assert SamplingParams(stop=["a"], stop_token_ids=(1,)).stop == ("a",)
    assert SamplingParams(stop="ab").stop == ("ab",)
