"""Training-script flags: ``use_tiled_mlp`` spelled as a bool or a string, ms-swift's
``--use_tiled_mlp true``, and one parser of ``num_shards`` for flags, configs and the CLI."""
import argparse

import pytest

from tiled_mlp.core import shard_plan
from tiled_mlp.integrations.args import add_tiled_mlp_args, read_tiled_mlp_flags

pytestmark = pytest.mark.timeout(30)

TRUE_SPELLINGS = ["true", "True", "TRUE", "1", "yes", "Yes", "on", "ON", " true "]
FALSE_SPELLINGS = ["false", "False", "FALSE", "0", "no", "No", "off", "OFF", " false "]


def _parser() -> argparse.ArgumentParser:
    return add_tiled_mlp_args(argparse.ArgumentParser(prog="train"))


def _argparse_error(capsys, argv) -> str:
    with pytest.raises(SystemExit) as exit_info:
        _parser().parse_args(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


# -- use_tiled_mlp -------------------------------------------------------------------------------------
@pytest.mark.parametrize("true_text, false_text", list(zip(TRUE_SPELLINGS, FALSE_SPELLINGS, strict=True)))
def test_dict_string_spellings_both_ways(true_text, false_text):
    # bool("false") is True: a YAML/JSON config saying "false" must not turn tiling on.
    assert read_tiled_mlp_flags({"use_tiled_mlp": true_text}).use_tiled_mlp is True
    assert read_tiled_mlp_flags({"use_tiled_mlp": false_text}).use_tiled_mlp is False


@pytest.mark.parametrize("bad", ["maybe", "", "tru", "2", 2, -1, 0.5, [], "none"])
def test_dict_unknown_spelling_names_the_key_and_the_accepted_values(bad):
    with pytest.raises(ValueError) as info:
        read_tiled_mlp_flags({"use_tiled_mlp": bad})
    message = str(info.value)
    assert "use_tiled_mlp" in message and repr(bad) in message
    assert all(word in message for word in ("true", "false", "yes", "no", "on", "off", "1", "0"))


def test_dict_real_bools_and_absent_key():
    assert read_tiled_mlp_flags({"use_tiled_mlp": True}).use_tiled_mlp is True
    assert read_tiled_mlp_flags({"use_tiled_mlp": False}).use_tiled_mlp is False
    assert read_tiled_mlp_flags({}).use_tiled_mlp is False
    # a key left empty in YAML (None) reads as absent; 1 and 0 as JSON numbers read as the bools
    assert read_tiled_mlp_flags({"use_tiled_mlp": None}).use_tiled_mlp is False
    assert read_tiled_mlp_flags({"use_tiled_mlp": 1}).use_tiled_mlp is True
    assert read_tiled_mlp_flags({"use_tiled_mlp": 0}).use_tiled_mlp is False
    # the dict is validated even when tiling is off: "flase" is a typo, not "off"
    with pytest.raises(ValueError, match="use_tiled_mlp"):
        read_tiled_mlp_flags({"use_tiled_mlp": "flase"})


@pytest.mark.parametrize("text, expected", [(t, True) for t in TRUE_SPELLINGS] + [(f, False) for f in FALSE_SPELLINGS])
def test_argparse_value_spellings_both_ways(text, expected):
    args = _parser().parse_args(["--use_tiled_mlp", text])
    assert args.use_tiled_mlp is expected
    assert read_tiled_mlp_flags(args).use_tiled_mlp is expected
    assert _parser().parse_args([f"--use_tiled_mlp={text}"]).use_tiled_mlp is expected


def test_ms_swift_spelling_bare_flag_and_absent_flag():
    args = _parser().parse_args(["--use_tiled_mlp", "true", "--tiled_mlp_num_shards", "4"])
    assert (args.use_tiled_mlp, args.tiled_mlp_num_shards) == (True, 4)
    flags = read_tiled_mlp_flags(args)
    assert (flags.use_tiled_mlp, flags.num_shards) == (True, 4)
    # the store_true spelling keeps working, and absent is off
    assert _parser().parse_args(["--use_tiled_mlp"]).use_tiled_mlp is True
    assert _parser().parse_args(["--use_tiled_mlp", "--tiled_mlp_num_shards", "2"]).use_tiled_mlp is True
    assert _parser().parse_args([]).use_tiled_mlp is False
    assert _parser().parse_args(["--use_tiled_mlp", "false", "--tiled_mlp_num_shards", "4"]).use_tiled_mlp is False


def test_argparse_rejects_an_unknown_boolean(capsys):
    err = _argparse_error(capsys, ["--use_tiled_mlp", "maybe"])
    assert "--use_tiled_mlp" in err and "'maybe'" in err and "true" in err and "false" in err


# -- num_shards: one parser ----------------------------------------------------------------------------
@pytest.mark.parametrize("value, expected", [("auto", "auto"), (" AUTO ", "auto"), ("Auto", "auto"), ("4", 4),
                                             (" 4 ", 4), (4, 4), (1, 1), ("1", 1)])
def test_parse_num_shards_accepts(value, expected):
    assert shard_plan.parse_num_shards(value) == expected
    assert type(shard_plan.parse_num_shards(value)) is type(expected)
    # the same answers through a training config
    assert read_tiled_mlp_flags({"tiled_mlp_num_shards": value}).num_shards == expected


@pytest.mark.parametrize("bad, error, words", [
    (2.7, TypeError, ["float", "2.7", "whole number"]),
    (2.0, TypeError, ["float", "2.0", "whole number"]),
    ("2.7", ValueError, ["'2.7'", "whole number"]),
    (0, ValueError, [">= 1", "0"]),
    (-3, ValueError, [">= 1", "-3"]),
    ("0", ValueError, [">= 1", "0"]),
    (True, TypeError, ["bool", "True"]),
    (False, TypeError, ["bool", "False"]),
    ("x", ValueError, ["'x'", "'auto'"]),
    ("", ValueError, ["''", "'auto'"]),
    (None, TypeError, ["NoneType"]),
])
def test_parse_num_shards_rejects_with_a_clear_message(bad, error, words):
    with pytest.raises(error) as info:
        shard_plan.parse_num_shards(bad)
    message = str(info.value)
    assert message.startswith("num_shards must be"), message
    assert all(word in message for word in words), message


@pytest.mark.parametrize("bad, words", [(2.7, ["whole number", "2.7"]), (0, [">= 1"]), (True, ["bool"]),
                                        ("x", ["'x'"])])
def test_dict_num_shards_goes_through_the_one_parser(bad, words):
    with pytest.raises(ValueError) as info:
        read_tiled_mlp_flags({"use_tiled_mlp": True, "tiled_mlp_num_shards": bad})
    message = str(info.value)
    assert message.startswith("tiled_mlp_num_shards: num_shards must be"), message
    assert all(word in message for word in words), message


@pytest.mark.parametrize("bad, words", [("2.7", ["whole number"]), ("0", [">= 1"]), ("x", ["'x'"])])
def test_argparse_num_shards_goes_through_the_one_parser(capsys, bad, words):
    err = _argparse_error(capsys, ["--use_tiled_mlp", "--tiled_mlp_num_shards", bad])
    assert "argument --tiled_mlp_num_shards: num_shards must be" in err, err
    assert all(word in err for word in words), err
    assert _parser().parse_args(["--tiled_mlp_num_shards", " AUTO "]).tiled_mlp_num_shards == "auto"
