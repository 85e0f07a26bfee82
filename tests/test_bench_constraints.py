"""benchmarks/constraints.py on a small trained vocabulary, with llguidance: the result's shape."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from jsonschema import Draft202012Validator as Validator

from benchmarks import _vocab, constraints

VOCAB = 600
TIMES = ("compile_ms", "warm_ms", "first_mask_ms", "mask_p50_ms", "mask_p90_ms", "advance_p50_ms")
STATUSES = {"enforced", "ignored", "rejects valid", "error"}


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("vocab") / "tokenizer.json"
    path.write_text(_vocab.train_tokenizer(VOCAB))
    return path


def test_llguidance_is_measured_on_every_schema_and_feature(
    tokenizer_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "result.json"
    argv = ["--tokenizer", str(tokenizer_file.parent), "--libraries", "llguidance"]
    argv += ["--steps", "30", "--batch", "4", "--samples", "2", "--json", str(out)]
    assert constraints.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["vocab"] == VOCAB and result["batch"] == 4
    assert result["libraries"]["llguidance"]["setup_ms"] > 0
    assert list(result["schemas"]) == list(constraints.SCHEMAS)
    for name, per_lib in result["schemas"].items():
        row = per_lib["llguidance"]
        assert "error" not in row, (name, row)
        assert all(row[key] >= 0 for key in TIMES), (name, row)
        assert row["mask_p50_ms"] <= row["mask_p90_ms"]
        assert row["batch_seq_ms"] > 0 and row["batch_par_ms"] > 0
    assert list(result["features"]) == list(constraints.FEATURES)
    for name, per_lib in result["features"].items():
        verdict = per_lib["llguidance"]
        assert verdict["status"] in STATUSES, (name, verdict)
        if verdict["status"] != "error":
            assert sum(verdict["samples"].values()) == 2
    assert result["features"]["pattern"]["llguidance"]["status"] == "enforced"
    table = capsys.readouterr().out
    assert "| flat | llguidance |" in table and "| pattern | enforced" in table


def test_a_library_that_does_not_import_is_skipped_with_the_reason(
    tokenizer_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def missing(tokenizer_json: str, vocab: int) -> constraints.Library:
        raise ImportError("No module named 'nothing'")

    monkeypatch.setitem(constraints.LIBRARIES, "nothing", missing)
    libs, info = constraints.load(["llguidance", "nothing"], tokenizer_file.read_text(), VOCAB)
    assert list(libs) == ["llguidance"]
    assert info["nothing"] == {"skipped": "ImportError: No module named 'nothing'"}


def test_the_instances_are_what_they_claim() -> None:
    """Each schema's instance is valid; each feature's second instance breaks it."""
    checker = Validator.FORMAT_CHECKER
    for schema, instance in constraints.SCHEMAS.values():
        Validator(schema, format_checker=checker).validate(instance)
    for name, (schema, good, bad) in constraints.FEATURES.items():
        Validator(schema, format_checker=checker).validate(good)
        if "date-time" not in name or "date-time" in checker.checkers:
            assert not Validator(schema, format_checker=checker).is_valid(bad), name


def test_the_tokenizer_holds_every_byte_and_eos_first() -> None:
    tokenizer_json = _vocab.train_tokenizer(VOCAB)
    raw = _vocab.token_bytes(tokenizer_json)
    assert {b[0] for b in raw.values() if len(b) == 1} == set(range(256))
    assert json.loads(tokenizer_json)["added_tokens"][0]["id"] == _vocab.EOS_ID


@pytest.mark.parametrize(
    "bad", [["--libraries", "nope"], ["--steps", "0"], ["--batch", "0"], ["--samples", "-1"]]
)
def test_bad_arguments_are_refused(bad: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        constraints.main(bad)
    assert exit_info.value.code == 2
    assert "error:" in capsys.readouterr().err
