"""The Python API holds every keyword to its declared type (issue 32: 26 of 104 wrong-typed calls raised
raw TypeError, AttributeError or decimal.Overflow; ``lora='false'`` turned LoRA on; ``torch=2.10`` became
PyTorch 2.1): a wrong type is one :class:`memcalc.UserError` naming the keyword, an unknown keyword a
TypeError, and nothing else escapes."""

from __future__ import annotations

import dataclasses
import typing

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import memcalc
from memcalc.inputs.resolve import Options

HINTS = typing.get_type_hints(Options)
# values of every kind a careless caller passes
ODD_VALUES = ["false", "2", 2.5, 1, True, None, [1], {"a": 1}, ("q",), object(), float("nan"), 10**400, -1]


def _wrong(field: str, value: object) -> bool:
    """Whether ``value`` is not of ``field``'s declared type (as the API reads it: params may be a number,
    recipe and lora_targets a list, seq a string such as "4k": memcalc.core.aliases)."""
    from memcalc.inputs.api_types import _args, _matches

    hint = HINTS[field]
    extra = {"params": (int, float), "recipe": (str, list, tuple), "lora_targets": (list, tuple),
             "seq": (str,)}.get(field, ())
    if isinstance(value, extra) and not isinstance(value, bool):
        return False
    return not any(_matches(value, a) for a in _args(hint))


WRONG = {f.name: [v for v in ODD_VALUES if _wrong(f.name, v)] for f in dataclasses.fields(Options) if f.name != "model"}


@pytest.mark.parametrize("field", sorted(WRONG))
def test_wrong_type_is_one_user_error_naming_the_keyword(field):
    # source: issue 32's API sweep (wrong-typed keywords); the types are Options' annotations
    assert WRONG[field], f"no value of ODD_VALUES is wrong for {field}"
    for value in WRONG[field]:
        with pytest.raises(memcalc.UserError) as e:
            memcalc.estimate(model="gpt2", **{field: value})
        assert str(e.value).startswith(f"{field}= must be ") and "\n" not in str(e.value), value


# (keywords, the message's start): the issue's own cases
CASES = [
    ({"lora": "false"}, "lora= must be True or False, not str 'false'"),  # source: issue 32 (turned LoRA on)
    ({"torch": 2.10}, "torch= must be a string or None, not float 2.1"),  # source: issue 32 (became PyTorch 2.1)
    ({"gpu": 5}, "gpu= must be"),  # source: issue 32 API sweep (TypeError: 'int' object is not iterable)
    ({"max_batch": "yes", "gpu": "rtx-4090"}, "max_batch= must be True or False"),  # source: estimate's signature
    # source: resolve._check_number (issue 32 fuzz: math.isfinite(10**400) was an OverflowError)
    ({"lora_alpha": 10**400}, "--lora-alpha must be a finite number, got an integer of about 400 digits"),
    ({"memory_budget": 10**400}, "--memory-budget must be a finite number, got an integer of about 400 digits"),
    # source: profiles.with_loss, KernelProfile.loss_chunks le=MAX_COUNT (issue 32 fuzz: 10**30 chunks were taken)
    ({"loss": "chunked", "loss_chunks": 10**30}, "--loss-chunks must be at most 1,048,576"),
]


@pytest.mark.parametrize("kwargs,message", CASES)
def test_issue_cases(kwargs, message):
    with pytest.raises(memcalc.UserError) as e:
        memcalc.estimate(model="gpt2", **kwargs)
    assert str(e.value).startswith(message)


@pytest.mark.parametrize("call,kwargs,message", [
    # source: resolve._model and plan.options.plan_model (issue 32 fuzz, stop 30): "" and 0 were taken as not given
    # (params="" beside model="gpt2" ignored; params=0 'no model'; plan(params=0) planned gpt2)
    ("estimate", {"model": "gpt2", "params": ""}, "give one of --model or --params, not both"),
    ("estimate", {"params": 0}, "--params must be positive, got '0'"),
    ("estimate", {"model": ""}, "empty --model value ''"),
    ("plan", {"model": "gpt2", "params": 0}, "give one of --model or --params, not both"),
    ("plan", {"params": ""}, "--params '' is not a parameter count"),
])
def test_empty_model_sources_are_given_not_absent(call, kwargs, message):
    with pytest.raises(memcalc.UserError) as e:
        getattr(memcalc, call)(**kwargs)
    assert str(e.value).startswith(message)


def test_plan_keywords_are_typed():
    # source: plan's signature (all: bool, recipe: str or paths)
    for kwargs, message in (({"all": "no"}, "all= must be True or False"),
                            ({"recipe": 5}, "recipe= must be a string or a list of strings or None"),
                            # source: api.plan checks the types before aliases.one_gpu (a TypeError from join)
                            ({"gpu": [1]}, "gpu= must be a string or None, not list [1]")):
        with pytest.raises(memcalc.UserError) as e:
            memcalc.plan(model="gpt2", **kwargs)
        assert str(e.value).startswith(message)


@pytest.mark.parametrize("kwargs,message", [
    # source: memcalc.api.measure's signature (issue 32 fuzz: output=[1] was a TypeError from os.path; quiet='false'
    # was taken as true), checked before torch is imported
    ({"output": [1]}, "output= must be a string or None, not list [1]"),
    ({"name": 5}, "name= must be a string or None, not int 5"),
    ({"quiet": "false"}, "quiet= must be True or False, not str 'false'"),
])
def test_measure_keywords_are_typed(kwargs, message):
    with pytest.raises(memcalc.UserError) as e:
        memcalc.measure(model="gpt2", **kwargs)
    assert str(e.value) == message


def test_python_spellings_are_the_flags():
    """A list of targets and one recipe path are what a Python caller writes: the same as the flags."""
    a = memcalc.options_from(model="llama-3.2-1b", lora=True, lora_targets=["q", "v"], recipe="r.yaml")
    assert (a.lora_targets, a.recipe) == ("q,v", ["r.yaml"])
    with pytest.raises(memcalc.UserError) as e:
        memcalc.estimate(recipe="no-such.yaml")
    assert str(e.value).startswith("--recipe no-such.yaml: no such file")


@pytest.mark.slow
@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(field=st.sampled_from([f.name for f in dataclasses.fields(Options)]),
       value=st.one_of(st.none(), st.booleans(), st.integers(-10**30, 10**30), st.floats(allow_nan=True),
                       st.sampled_from([10**400, "", 0, "/dev/full"]),  # issue 32 fuzz (stop 30): overflow, empties
                       st.text(max_size=12), st.lists(st.text(max_size=4), max_size=3),
                       st.dictionaries(st.text(max_size=3), st.integers(), max_size=2)))
def test_any_keyword_value_is_an_answer_or_one_user_error(field, value):
    """Whatever one keyword holds, the API answers or raises UserError (one line); nothing else escapes."""
    kwargs = {"model": "gpt2", field: value} if field != "model" else {"model": value}
    try:
        memcalc.estimate(**kwargs)
    except memcalc.UserError as e:
        assert "\n" not in str(e).strip()
