"""Every command's result has one interface, and the one output sink writes it: the JSON
with the command line, the JUnit XML of its checks, and the exit code they imply."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from conftest import ROOT
from kvcalib.bench.result import BenchResult
from kvcalib.checkpoint.convert import Conversion
from kvcalib.checkpoint.inspect import Inspection
from kvcalib.checks import ERROR, FAIL, PASS, SKIP, WARN, Check, CommandResult
from kvcalib.cli._output import Output
from kvcalib.evaluate.result import EvalResult
from kvcalib.kvcache.capacity import Estimate
from kvcalib.lmeval.result import LmEvalResult
from kvcalib.verify.run import VerifyResult

RESULTS = [VerifyResult, EvalResult, BenchResult, LmEvalResult, Inspection, Conversion, Estimate]


@pytest.mark.parametrize("result", RESULTS, ids=lambda cls: cls.__name__)
def test_every_result_is_a_command_result_with_its_own_json_and_summary(result):
    assert issubclass(result, CommandResult)
    assert result.to_dict is not CommandResult.to_dict
    assert result.summary is not CommandResult.summary


def test_run_result_too():
    """calibrate/run.py needs torch only when it calibrates: its result class is importable
    here, and has the same interface."""
    from kvcalib.calibrate.run import CalibrationResult

    assert issubclass(CalibrationResult, CommandResult)
    assert CalibrationResult.summary is not CommandResult.summary


@pytest.mark.parametrize(("statuses", "code"), [
    ([PASS, WARN, SKIP], 0), ([PASS, ERROR], 2), ([ERROR, FAIL, PASS], 1), ([], 0)])
def test_emit_writes_json_and_junit_and_returns_the_exit_code(tmp_path, capsys, monkeypatch,
                                                               statuses, code):
    monkeypatch.setattr("sys.argv", ["kvcalib", "verify", "ckpt", "--json", "out.json"])
    checks = [Check("scales", status, f"check {i}") for i, status in enumerate(statuses)]
    result = VerifyResult("ckpt", checks)
    json_path, junit = tmp_path / "out.json", tmp_path / "out.xml"

    assert Output(json_path, junit).emit(result) == code

    written = json.loads(json_path.read_text())
    assert written["command"] == "kvcalib verify ckpt --json out.json"
    assert written["exit_code"] == code and written["checkpoint"] == "ckpt"
    assert [c["status"] for c in written["checks"]] == statuses
    suite = ET.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    assert suite.get("name") == "kvcalib.verify"
    cases = suite.findall("testcase")
    assert len(cases) == len(statuses)
    assert sum(case.find("failure") is not None for case in cases) == statuses.count(FAIL)
    assert "Checkpoint: ckpt" in capsys.readouterr().out  # the summary, on standard output


def test_json_on_stdout_replaces_the_summary(capsys, monkeypatch):
    monkeypatch.setattr("sys.argv", ["kvcalib", "convert"])
    result = Conversion("src", "out", "modelopt", "compressed-tensors", "tensor", {"a": [1.0]})
    assert Output(json_path=Path("-")).emit(result) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == {"command": "kvcalib convert", **result.to_dict()}


@pytest.mark.parametrize(("kind", "name"), [(EvalResult, "eval.json"), (BenchResult, "bench.json"),
                                            (LmEvalResult, "lm-eval.json")])
def test_measured_json_reads_back_as_its_result(kind, name):
    """The JSON of real runs (docs/measured), read back as its type, writes the same JSON:
    lm-eval's tables, comparisons and verdict computed again from its examples included."""
    written = json.loads((ROOT / "docs" / "measured" / "card-smollm2" / name).read_text())
    written.pop("command")
    again = json.loads(json.dumps(kind.from_dict(written).to_dict()))
    assert {key: again[key] for key in written} == written  # newer fields: their defaults


def test_a_result_of_the_wrong_shape_is_refused():
    with pytest.raises(ValueError, match="reference_ppl"):
        EvalResult.from_dict({"checkpoint": "c", "samples": {}, "metrics": {},
                              "reference_ppl": "high"})
