"""Every entry point fed a corpus of bad inputs generated from the config schema
(`tests/bad_input_corpus.py`: each key of the frozen dataclass configs given a value of the wrong
type and, where it is numeric, values out of range; the path keys pointed where no path can be;
malformed files): each is refused with exit status 2 and one line (naming the key, where the
launcher refuses it), never a traceback. `launch/run.py`'s cases share one launcher process, as
tests/run/test_bad_inputs.py's table does; the other scripts' take their arguments in-process or,
where they have no `main(argv)`, in a process of their own.
"""

import shutil
import subprocess
import sys
import traceback
from pathlib import Path

import pytest

from ferry.data.config import DataConfig
from tests.bad_input_corpus import Case, malformed_files, path_cases, schema_keys, value_cases
from tests.conftest import ROOT, SMALL_RUN
from tests.launcher_cases import load_script
from tests.run.test_bad_inputs import run_cases, tree_digest

RUNS_OWN_DIR = ("run.dir", "run.root")  # the cases of these keys name where the run goes themselves


def launcher_argv(case: Case, run_dir: Path) -> list[str]:
    """The small run, pointed at the finished run (a refusal must leave it as it was; a value
    wrongly accepted resumes it, and says it is complete, exit 0), with the case's overrides."""
    own = case.key in RUNS_OWN_DIR
    return [*SMALL_RUN, *case.overrides, *([] if own else [f"run.dir={run_dir}"])]


def refusal_problem(case: Case, code: int, stdout: str, stderr: str) -> str | None:
    """What is wrong with how a case ended (None: refused in one line naming the key, or the file,
    with exit status 2)."""
    if "Traceback" in stdout + stderr:
        return "traceback: " + (stdout + stderr)[-400:]
    if code != 2:
        return f"exit status {code}: " + (stdout + stderr)[-300:]
    errors = [line for line in stdout.splitlines() if line.startswith("error:")]
    if len(errors) != 1:
        return f"{len(errors)} error lines: " + stdout[-300:]
    if case.key.split(".")[-1] not in errors[0]:
        return f"the error does not name {case.key}: {errors[0]}"
    return None


def assert_all_refused(problems: dict[str, str], total: int) -> None:
    listed = "\n".join(f"{name} -> {problem}" for name, problem in problems.items())
    assert not problems, (
        f"{len(problems)} of {total} bad inputs were not refused in one line with exit status 2:\n{listed}"
    )


def test_the_corpus_covers_every_key_of_the_schema():
    keys = dict(schema_keys())
    for key in ("train.steps", "offload.auto.steps", "data.eval_fraction", "platform.compilation_cache"):
        assert key in keys
    assert {
        "mesh.data",
        "distributed.process_id",
        "plan.capacity_gib",
        "model.dim",
        "model.rope_scaling.factor",
    } <= set(keys)
    cases = value_cases(list(keys.items()))
    assert {c.key for c in cases} == set(keys)  # every key has its wrong-typed value
    assert len(cases) > 2 * len(keys)


def test_the_launcher_refuses_the_corpus(finished_run, tmp_path):
    """Every key's wrong-typed and out-of-range values, the paths and the malformed files, in one
    launcher process; the finished run it points at unchanged."""
    before = tree_digest(finished_run)
    cases = value_cases(list(schema_keys())) + path_cases(tmp_path) + malformed_files(tmp_path)
    results = run_cases([launcher_argv(case, finished_run) for case in cases], timeout=900, own_compilation_cache=True)
    problems = {}
    for case, result in zip(cases, results, strict=True):
        problem = refusal_problem(case, result["code"], result["stdout"], result["stderr"])
        if problem is not None:
            problems[case.name] = problem
    assert_all_refused(problems, len(cases))
    assert tree_digest(finished_run) == before
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("n")) == []  # no too-long name made


def prepare_data_cases(root: Path) -> list[Case]:
    """The data group's keys, as prepare_data.py takes them, and its paths and malformed files
    (data.cache_dir is where a run caches a raw source's tokens: prepare_data.py writes none)."""
    keys = list(schema_keys(DataConfig, "data."))
    made = [c for c in path_cases(root) + malformed_files(root) if c.key.startswith("data.") or ".jsonl" in c.key]
    made = [c for c in made if c.key != "data.cache_dir" and not any(o.startswith("data=") for o in c.overrides)]
    return value_cases(keys) + made


def test_prepare_data_refuses_the_corpus(tmp_path, capsys):
    prepare_data = load_script("prepare_data.py")
    (tmp_path / "corpus").mkdir()
    for index in range(40):  # enough documents for a held-out split: a case wrongly accepted would succeed
        (tmp_path / "corpus" / f"{index}.txt").write_text(f"document {index}\n" * 20)
    base = ["data.source=text", f"data.path={tmp_path / 'corpus'}", f"data.prepared={tmp_path / 'out'}"]
    problems, cases = {}, prepare_data_cases(tmp_path / "made")
    for case in cases:
        try:
            code = prepare_data.main([*base, *case.overrides])
        except Exception:  # what the interpreter would print
            traceback.print_exc()
            code = 1
        out = capsys.readouterr()
        problem = refusal_problem(case, code, out.out, out.err)
        if problem is not None:
            problems[case.name] = problem
        shutil.rmtree(tmp_path / "out", ignore_errors=True)  # a case wrongly accepted wrote there
    assert_all_refused(problems, len(cases))


def test_export_hf_refuses_the_corpus(finished_run, tmp_path, capsys):
    """Its arguments (argparse's own errors exit 2 with its usage, no traceback), the places it
    reads and writes, and a run whose files are malformed."""
    export_hf = load_script("export_hf.py")
    (tmp_path / "a_file").write_text("x")
    runs = {"not YAML": "model: [1, 2\n", "a list for a name": "model: {family: [llama]}\n", "a bare value": "5\n"}
    for index, text in enumerate(runs.values()):
        shutil.copytree(finished_run, tmp_path / f"run{index}")
        (tmp_path / f"run{index}" / "config.yaml").write_text(text)
    out = str(tmp_path / "out")
    argv_cases = {
        "--step abc": [str(finished_run), out, "--step", "abc"],
        "--step -1": [str(finished_run), out, "--step", "-1"],
        "--dtype 5": [str(finished_run), out, "--dtype", "5"],
        "no out_dir": [str(finished_run)],
        "an option it lacks": [str(finished_run), out, "--steps", "2"],
        "run below a file": [str(tmp_path / "a_file" / "run"), out],
        "run name too long": [str(tmp_path / ("n" * 300)), out],
        "out below a file": [str(finished_run), str(tmp_path / "a_file" / "out")],
        "out name too long": [str(finished_run), str(tmp_path / ("n" * 300))],
    }
    argv_cases |= {f"config.yaml {name}": [str(tmp_path / f"run{i}"), out] for i, name in enumerate(runs)}
    problems = {}
    for name, argv in argv_cases.items():
        try:
            code = export_hf.main(argv)
        except SystemExit as exit_:  # argparse
            code = exit_.code
        captured = capsys.readouterr()
        lines = captured.err.strip().splitlines()
        if "Traceback" in captured.out + captured.err or code != 2 or not lines or "error" not in lines[-1]:
            problems[name] = f"exit status {code}: {captured.out[-200:]} {captured.err[-300:]}"
    assert_all_refused(problems, len(argv_cases))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "script, argv",
    [
        ("launch/local.py", ["--processes", "abc"]),
        ("launch/local.py", ["--processes", "0"]),
        ("launch/local.py", ["--processes", "1", "--", *SMALL_RUN, "train.steps=abc"]),
        ("benchmarks/deepseek_cpu.py", ["--steps", "abc"]),
        ("benchmarks/deepseek_cpu.py", ["--no-such-option"]),
    ],
    ids=lambda value: " ".join(value) if isinstance(value, list) else value,
)
def test_scripts_without_main_argv_refuse_bad_arguments(script, argv, tmp_path):
    """local.py and a benchmark parse sys.argv: their own process each. A bad override given to
    local.py is its child launcher's refusal, whose exit status it returns."""
    result = subprocess.run(
        [sys.executable, str(ROOT / script), *argv, *([f"run.dir={tmp_path / 'run'}"] if "--" in argv else [])],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2 and "Traceback" not in result.stdout + result.stderr, result.stdout + result.stderr
    assert "error" in (result.stdout + result.stderr)
