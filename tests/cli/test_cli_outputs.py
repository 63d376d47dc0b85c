"""Output options of every command: checked before any work, one `Error:` line (exit 2),
valid JSON on standard output with `--json -` even when the command fails, and numeric
options refused where they are meaningless."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from conftest import builtin, run_kvcalib
from kvcalib.calibrate import calibrate

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def tiny_ckpt(tiny_model, tmp_path_factory) -> Path:
    """A calibrated tiny Llama: enough for every command's option checks."""
    out = tmp_path_factory.mktemp("tiny-ckpt") / "ckpt"
    calibrate(tiny_model("llama"), out, samples=builtin(2, 16), log=lambda _: None)
    return out


@pytest.fixture
def bad_paths(tmp_path) -> dict[str, Path]:
    """Paths no output file can be written to."""
    (tmp_path / "folder").mkdir()
    (tmp_path / "file").write_text("keep")
    return {"folder": tmp_path / "folder", "under a file": tmp_path / "file" / "x.json",
            "full device": Path("/dev/full"),
            # os.access says yes to root here, but no file can be created
            "in /proc": Path("/proc/kvcalib-out.json")}


def _assert_usage_error(result, message: str) -> None:
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and message in errors[0], result.stderr


def _commands(ckpt: Path, out: Path) -> dict[str, list]:
    """Each command with cheap arguments; `out` is a --output that must stay untouched."""
    return {
        "run": ["run", "--model", ckpt, "--output", out, "--dataset", "builtin",
                "--num-samples", 2, "--max-seq-len", 16],
        "verify": ["verify", ckpt, "--static-only"],
        "eval": ["eval", ckpt, "--num-samples", 1, "--max-seq-len", 16, "--passkey-lengths", "",
                 "--kivi", "--kivi-group-size", 8],
        "estimate": ["estimate", ckpt],
        "inspect": ["inspect", ckpt],
        "convert": ["convert", ckpt, "--to", "modelopt", "--output", out],
    }


@pytest.mark.parametrize("kind, message", [("folder", "is a folder"),
                                           ("under a file", "is a file, not a folder"),
                                           ("full device", "is not a regular file"),
                                           ("in /proc", "cannot write in /proc")])
@pytest.mark.parametrize("command", ["run", "verify", "eval", "estimate", "inspect", "convert"])
def test_bad_json_path_is_refused_before_any_work(command, kind, message, tiny_ckpt, tmp_path,
                                                  bad_paths):
    out = tmp_path / "out"
    result = run_kvcalib(*_commands(tiny_ckpt, out)[command], "--json", bad_paths[kind])
    _assert_usage_error(result, message)
    assert not out.exists()  # run stopped before calibrating
    assert (tmp_path / "file").read_text() == "keep"


@pytest.mark.parametrize("option", ["--junit", "--log-dir"])
def test_verify_junit_and_log_dir_paths(option, tiny_ckpt, tmp_path, bad_paths):
    wrong = bad_paths["folder"] if option == "--junit" else tmp_path / "file"
    message = "is a folder" if option == "--junit" else "is a file, not a folder"
    _assert_usage_error(run_kvcalib("verify", tiny_ckpt, "--static-only", option, wrong),
                        message)


@pytest.mark.parametrize("command", ["eval", "inspect"])
@pytest.mark.parametrize("kind, message", [("folder", "is a folder"),
                                           ("under a file", "is a file, not a folder")])
def test_bad_plot_path_is_refused_before_any_work(command, kind, message, tiny_ckpt,
                                                  tmp_path, bad_paths):
    path = bad_paths[kind] if kind == "folder" else bad_paths[kind].with_suffix(".png")
    result = run_kvcalib(*_commands(tiny_ckpt, tmp_path / "out")[command], "--plot", path)
    _assert_usage_error(result, message)
    assert "Evaluating" not in result.stderr


@pytest.mark.parametrize("args, message", [
    (["run", "--model", "CKPT", "--output", "/proc/kvcalib-out"], "--output /proc/kvcalib-out"),
    (["run", "--model", "CKPT", "--output", "OUT", "--plot", "/proc/x.png"], "--plot"),
    (["run", "--model", "CKPT", "--output", "OUT", "--plot", "OUT.txt"],
     "unsupported plot format"),
    (["eval", "CKPT", "--formats", "fp8", "--pareto", "/proc/x.png"], "--pareto"),
    (["verify", "CKPT", "--static-only", "--log-dir", "/proc/logs"], "--log-dir"),
    (["demo", "--output", "/proc/kvcalib-demo"], "--output /proc/kvcalib-demo"),
    (["demo", "--output", "OUT/../file/x"], "is a file, not a folder"),
    (["demo-model", "--dest", "/proc/kvcalib-model"], "--dest /proc/kvcalib-model"),
])
def test_unwritable_places_are_refused_before_any_work(args, message, tiny_ckpt, tmp_path):
    """Proven by creating a file there, not by os.access (which says yes to root on
    /proc): once a regression of `run --output /proc/x` to a reflink probe's traceback."""
    out = tmp_path / "out"
    (tmp_path / "file").write_text("keep")
    args = [str(out) if a == "OUT" else str(tiny_ckpt) if a == "CKPT" else
            a.replace("OUT", str(out)) for a in args]
    result = run_kvcalib(*args, timeout=120)
    _assert_usage_error(result, message)
    assert "Loading" not in result.stderr and "Evaluating" not in result.stderr
    assert not out.exists() and (tmp_path / "file").read_text() == "keep"


def test_plot_folder_is_refused_and_a_bare_name_gets_png(tiny_ckpt, tmp_path):
    folder = tmp_path / "plots"
    folder.mkdir()
    _assert_usage_error(run_kvcalib("inspect", tiny_ckpt, "--plot", folder), "is a folder")
    assert list(tmp_path.iterdir()) == [folder] and not any(folder.iterdir())
    result = run_kvcalib("inspect", tiny_ckpt, "--plot", tmp_path / "scales")
    assert result.returncode == 0, result.stderr
    shown = Path(result.stderr.split("Plot: ")[1].split()[0])
    assert shown == tmp_path / "scales.png"  # what was printed is what was written
    assert shown.read_bytes().startswith(PNG_SIGNATURE)
    _assert_usage_error(run_kvcalib("inspect", tiny_ckpt, "--plot", tmp_path / "s.xyz"),
                        "unsupported plot format")


def test_junit_to_standard_output(tiny_ckpt, tmp_path):
    result = run_kvcalib("verify", tiny_ckpt, "--static-only", "--junit", "-", "--json",
                         tmp_path / "v.json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    suite = ET.fromstring(result.stdout)  # the XML alone, no table
    checks = json.loads((tmp_path / "v.json").read_text())["checks"]
    assert suite.tag == "testsuite" and len(suite.findall("testcase")) == len(checks) > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v.json"]  # no file named '-'


def test_json_and_junit_cannot_both_go_to_standard_output(tiny_ckpt, tmp_path):
    result = run_kvcalib("verify", tiny_ckpt, "--static-only", "--junit", "-", "--json", "-",
                         cwd=tmp_path)
    _assert_usage_error(result, "--json - and --junit - cannot both")
    assert json.loads(result.stdout)["exit_code"] == 2
    assert list(tmp_path.iterdir()) == []


def test_output_files_are_replaced_whole(tiny_ckpt, tmp_path):
    out = tmp_path / "sub" / "e.json"  # missing folders are created, as before
    assert run_kvcalib("estimate", tiny_ckpt, "--json", out).returncode == 0
    first = json.loads(out.read_text())
    out.write_text("x" * 100_000)  # longer than the report: a partial overwrite would show
    assert run_kvcalib("estimate", tiny_ckpt, "--json", out).returncode == 0
    assert json.loads(out.read_text()) == first
    assert [p.name for p in out.parent.iterdir()] == ["e.json"]  # no temporary left


# ----- `--json -`: standard output is JSON whatever happens ----- #


@pytest.mark.parametrize("args, code, message", [
    (["estimate", "{ckpt}", "--batch", "0"], 2, "Invalid value for '--batch'"),
    (["estimate", "{ckpt}", "--batch", "lots"], 2, "Invalid value for '--batch'"),
    (["estimate", "{ckpt}", "--no-such-option"], 2, "No such option"),
    (["estimate", "{missing}"], 2, "model folder not found"),
    (["inspect", "{missing}"], 2, "not found"),
    (["estimate", "{ckpt}", "--budget", "lots"], 2, "budget"),
    (["run", "--model", "{missing}", "--output", "{out}"], 2, "model folder not found"),
    (["eval", "{ckpt}", "--kivi-group-size", "0"], 2, "Invalid value for '--kivi-group-size'"),
    (["eval", "{ckpt}", "--kivi-group", "0"], 2,  # the old spelling, an alias
     "Invalid value for '--kivi-group-size' / '--kivi-group'"),
])
@pytest.mark.parametrize("form", [["--json", "-"], ["--json=-"]])
def test_json_stdout_on_errors(args, code, message, form, tiny_ckpt, tmp_path):
    names = {"ckpt": tiny_ckpt, "missing": tmp_path / "missing", "out": tmp_path / "out"}
    result = run_kvcalib(*[a.format(**names) for a in args], *form)
    assert result.returncode == code, result.stderr
    payload = json.loads(result.stdout)
    assert payload["exit_code"] == code and message in payload["error"], payload
    assert "Error:" in result.stderr and "Traceback" not in result.stderr


def test_json_stdout_on_success_is_the_report(tiny_ckpt):
    result = run_kvcalib("estimate", tiny_ckpt, "--json", "-")
    assert result.returncode == 0, result.stderr
    assert "error" not in json.loads(result.stdout)


# ----- numeric options: one range check, at parse time ----- #


@pytest.mark.parametrize("command, option, value", [
    ("run", "--num-samples", "0"), ("run", "--max-seq-len", "-5"), ("run", "--seed", "-1"),
    ("verify", "--max-model-len", "0"),
    ("eval", "--kivi-group-size", "0"), ("eval", "--kivi-group", "0"),
    ("eval", "--kivi-residual", "-1"),
    ("eval", "--batch-size", "0"), ("eval", "--sweep-samples", "0"),
    ("eval", "--num-samples", "0"), ("eval", "--max-seq-len", "0"), ("eval", "--seed", "-3"),
    # once an OverflowError from the tokenizer; `run` refused it only by its memory need
    ("eval", "--max-seq-len", str(2**64)), ("run", "--max-seq-len", str(2**64)),
    ("eval", "--max-kl", "-0.1"), ("eval", "--max-ppl-increase", "-1"),
    ("eval", "--min-passkey", "1.5"), ("eval", "--passkey-lengths", "1024,0"),
    ("eval", "--passkey-depths", "0.5,1.5"),
    ("estimate", "--context-length", "0"), ("estimate", "--batch", "-2"),
    ("estimate", "--block-size", "0"), ("estimate", "--kivi-group-size", "0"),
    ("estimate", "--kivi-residual", "-1"),
    ("inspect", "--outlier-ratio", "0.5"),
])
def test_meaningless_numbers_are_usage_errors(command, option, value, tiny_ckpt, tmp_path):
    out = tmp_path / "out"
    result = run_kvcalib(*_commands(tiny_ckpt, out)[command], option, value, timeout=120)
    _assert_usage_error(result, "Invalid value for '")
    assert f"'{option}'" in result.stderr, result.stderr
    assert not out.exists()


@pytest.mark.parametrize("extra, message", [
    (["--budget", "12 parsecs"], "--budget needs --formats"),  # once silently ignored
    (["--block-size", "16"], "--block-size needs --formats"),
    (["--formats", "fp8", "--budget", "12 parsecs"], "budget '12 parsecs' is not a size"),
])
def test_format_options_without_formats_or_with_a_bad_budget(extra, message, tiny_ckpt):
    result = run_kvcalib("eval", tiny_ckpt, *extra, timeout=120)
    _assert_usage_error(result, message)
    assert "Evaluating" not in result.stderr


def test_a_pareto_plot_with_no_format_scored_keeps_the_json(tiny_ckpt, tmp_path):
    """Neither format runs on an AVX2 CPU: the plot has nothing to show and says so, after
    the JSON is written (it once crashed log-scaling an empty plot and lost the JSON)."""
    result = run_kvcalib(*_commands(tiny_ckpt, tmp_path / "out")["eval"], "--formats",
                         "fp8_e5m2,nvfp4", "--target", "cpu-avx2", "--pareto",
                         tmp_path / "p.png", "--json", tmp_path / "p.json", timeout=600)
    _assert_usage_error(result, "nothing to plot: no format of --formats was scored on "
                                "cpu-avx2")
    assert json.loads((tmp_path / "p.json").read_text())["formats"]["target"] == "cpu-avx2"
    assert not (tmp_path / "p.png").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.json"]


def test_demo_model_dest_that_is_a_file(tmp_path):
    (tmp_path / "f").write_text("keep")
    _assert_usage_error(run_kvcalib("demo-model", "--dest", tmp_path / "f"),
                        "is a file, not a folder")
    assert (tmp_path / "f").read_text() == "keep"
