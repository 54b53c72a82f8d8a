"""The config diff of two runs: dotted keys, only those that differ, added / removed / changed."""
from __future__ import annotations

from app.api.configdiff import config_diff, flatten
from app.runconfig import RunConfig


def test_flatten_makes_one_dotted_key_per_leaf_and_keeps_lists_whole():
    assert flatten({"a": {"b": 1, "c": {"d": None}}, "e": [1, {"f": 2}], "g": {}}) == {
        "a.b": 1, "a.c.d": None, "e": [1, {"f": 2}], "g": {}}
    assert flatten({}) == {}


def test_diff_names_added_removed_and_changed_keys_only():
    a = {"kind": "eval", "model": {"name": "m", "checkpoint": None}, "simulate": None, "instances": ["x", "y"]}
    b = {"kind": "eval", "model": {"name": "m", "checkpoint": "run:3"}, "simulate": {"seed": 1},
         "instances": ["x", "z"], "series": {"id": "s"}}
    assert config_diff(a, b) == [
        {"key": "instances", "change": "changed", "a": ["x", "y"], "b": ["x", "z"]},
        {"key": "model.checkpoint", "change": "changed", "a": None, "b": "run:3"},
        {"key": "series.id", "change": "added", "a": None, "b": "s"},
        {"key": "simulate", "change": "removed", "a": None, "b": None},
        {"key": "simulate.seed", "change": "added", "a": None, "b": 1},
    ]
    assert config_diff(b, b) == [] and config_diff(None, None) == []


def test_a_number_of_another_type_is_a_change():
    """1 and 1.0 (or True and 1) are equal in Python but not the same setting in a stored config."""
    assert [d["key"] for d in config_diff({"lr": 1, "flag": True}, {"lr": 1.0, "flag": 1})] == ["flag", "lr"]


def test_two_stored_run_configs_differ_only_where_they_were_set_differently():
    base = {"kind": "train", "harness": "mini-swe-agent", "task_set": "synthetic"}
    a = RunConfig.model_validate(base).model_dump(mode="json")
    b = RunConfig.model_validate({**base, "group_size": 8, "training": {"learning_rate": 3e-6}}).model_dump(mode="json")
    keys = {d["key"]: d for d in config_diff(a, b)}
    assert set(keys) == {"group_size", "training.learning_rate"}
    assert keys["group_size"]["b"] == 8 and keys["training.learning_rate"]["b"] == 3e-6
