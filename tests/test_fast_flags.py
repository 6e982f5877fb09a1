"""The flag check made before torch is imported (``commands.check_flags`` over the generated flag
table): it answers exactly as the recipes' real parser does, its table is the real parsers', a bad
flag in a real recipe process is reported without importing torch or transformers, and every range
check is one check shared by the library's dataclasses and the flags."""
import dataclasses
import os
import pathlib
import subprocess
import sys

import pytest
from test_bad_inputs import CLI_ROWS, ROWS

from lp_decentral_nlp.checks import NUMBER_FIELDS
from lp_decentral_nlp.commands import build_nlp_parser, check_flags, recipe_main
from lp_decentral_nlp.commands.flags import fixed_field_reasons
from lp_decentral_nlp.commands.flag_table import FLAG_TABLES
from lp_decentral_nlp.commands.nlp import NLPArguments
from lp_decentral_nlp.commands.recipe_parser import FLAG_TABLE_PATH, render_flag_table
from lp_decentral_nlp.trainer import DecentralizedTrainingArguments
from lp_decentral_nlp.vision.recipe import VisionArguments, build_vision_parser

REPO = pathlib.Path(__file__).resolve().parents[1]
PROG = "recipe.py"


def test_the_flag_table_is_generated_from_the_parsers():
    assert render_flag_table() == FLAG_TABLE_PATH.read_text(), (
        "lp_decentral_nlp/commands/flag_table.py differs from the parsers: regenerate it with "
        "python -m lp_decentral_nlp.commands.recipe_parser")


def outcome(call, capsys):
    """(exit status or None when it returned, stdout, stderr) of ``call()``."""
    try:
        call()
        code = None
    except SystemExit as exc:
        code = exc.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def fast_nlp(argv, task="ag_news", algorithm="choco"):
    fixed = fixed_field_reasons(PROG, {"algorithm": algorithm, **({"task": task} if task else {})})
    return lambda: check_flags("nlp", argv, fixed=fixed, prog=PROG,
                               description=FLAG_TABLES["nlp"]["descriptions"][task, algorithm])


def real_nlp(argv, task="ag_news", algorithm="choco"):
    return lambda: build_nlp_parser(task, algorithm, prog=PROG).parse(argv)


# the command-line rows of docs/bad_inputs.md whose answer needs no library: the flag check gives it
ANSWERED_BEFORE_TORCH = {1, 2, 3, 4, 5, 7, 8, 9, 11, 17, 65, 104}
MORE_BAD_FLAGS = [["--bf16", "maybe"], ["--lr_scheduler_type", "nope"], ["--max-length", "1"], ["--threads", "0"],
                  ["--task", "sentlen"], ["--lr"], ["--nodes=2.5"], ["--compressor", "zip"], ["--backend", "mpi"],
                  ["--learning_rate", "1", "--skew", "-0.5"], ["--straggler", "1:x", "--leave"]]


@pytest.mark.parametrize("argv", [ROWS[n].wrong_input.split("`")[1].split() for n in CLI_ROWS] + MORE_BAD_FLAGS)
def test_the_flag_check_answers_as_the_parser_or_leaves_it_the_flags(argv, capsys):
    fast = outcome(fast_nlp(argv), capsys)
    if fast[0] is None:  # passed: the real parser decides (a combination of flags, a file)
        assert argv not in [ROWS[n].wrong_input.split("`")[1].split() for n in ANSWERED_BEFORE_TORCH]
        return
    assert fast == outcome(real_nlp(argv), capsys)
    assert fast[0] == 2 and fast[2].count("\n") == 1 and fast[2].startswith(f"{PROG}: error: ")


@pytest.mark.parametrize("number", sorted(ANSWERED_BEFORE_TORCH))
def test_the_rows_answered_before_torch(number, capsys):
    code, _, err = outcome(fast_nlp(ROWS[number].wrong_input.split("`")[1].split()), capsys)
    assert code == 2 and err == f"{PROG}: error: {ROWS[number].message}\n"


@pytest.mark.parametrize("argv", [["--nodes", "8", "--skew", "0.9", "--comp", "99", "--lr=1e-4", "--bf16", "false"],
                                  ["--straggler", "1:0.5", "--straggler", "2:0.1", "--full-precision"], []])
def test_good_flags_pass_the_check(argv, capsys):
    assert outcome(fast_nlp(argv), capsys)[0] is None


@pytest.mark.parametrize("task, algorithm", [("ag_news", "choco"), ("sentlen", "deepsqueeze"), (None, "dpsgd")])
def test_help_is_the_parsers_help(task, algorithm, capsys):
    code, out, _ = outcome(fast_nlp(["--help"], task, algorithm), capsys)
    assert code == 0 and out == build_nlp_parser(task, algorithm, prog=PROG).format_help()
    assert "(default: 3e-05)" in " ".join(out.split())


def test_the_flag_of_a_field_the_recipe_sets_is_refused_naming_the_recipe_to_run(capsys):
    """--algorithm and a recipe's --task were "unrecognized arguments"."""
    assert outcome(fast_nlp(["--algorithm", "deepsqueeze"]), capsys) == (
        2, "", "recipe.py: error: argument --algorithm: recipe.py runs choco: run the deepsqueeze recipe for "
               "deepsqueeze\n")
    assert outcome(fast_nlp(["--task=sentlen"]), capsys)[2] == (
        "recipe.py: error: argument --task: recipe.py trains the ag_news task: each task has its recipes "
        "(recipes/agnews_*.py, sentlen_*.py, and text_*.py for your own data)\n")
    proc = subprocess.run([sys.executable, str(REPO / "recipes" / "agnews_choco.py"), "--algorithm", "deepsqueeze"],
                          capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stderr) == (2, "agnews_choco.py: error: argument --algorithm: agnews_choco.py runs "
                                                 "choco: run agnews_deepsqueeze.py for deepsqueeze\n")


def test_vision_flags_and_help_are_the_vision_parsers(capsys):
    def fast(argv):
        return lambda: check_flags("vision", argv, fixed=fixed_field_reasons(PROG, {"algorithm": "deepsqueeze"}), prog=PROG,
                                   description=FLAG_TABLES["vision"]["descriptions"][None, "deepsqueeze"])

    code, out, _ = outcome(fast(["--help"]), capsys)
    assert code == 0 and out == build_vision_parser("deepsqueeze", prog=PROG).format_help()
    for argv in (["--arch", "vgg99"], ["--norm", "layernorm"], ["--groups", "0"], ["--dataset", "mnist"]):
        answer = outcome(fast(argv), capsys)
        assert answer[0] == 2 and answer == outcome(lambda: build_vision_parser("deepsqueeze", prog=PROG).parse(argv),
                                                    capsys)


def out_of_range(spec):
    """A value just outside ``spec`` (an int for an integer setting, else a float)."""
    value = spec.low - 1 if spec.low is not None else spec.high + 1
    return int(value) if spec.integer else float(value)


def build_with(name, value, tmp_path):
    """The dataclass of the recipes holding field ``name``, built with ``name=value``."""
    for cls, base in ((NLPArguments, {}), (VisionArguments, {}),
                      (DecentralizedTrainingArguments, dict(output_dir=str(tmp_path), use_cpu=True, report_to="none"))):
        if name in {f.name for f in dataclasses.fields(cls) if f.init}:
            return cls(**base, **{name: value})
    raise AssertionError(f"no recipe dataclass has a field {name!r}")


@pytest.mark.parametrize("name", sorted(NUMBER_FIELDS))
def test_the_flag_and_the_dataclass_give_the_same_range_error(name, tmp_path, capsys):
    """One set of range checks: the message of a value out of range is the same from the flag
    check (before torch), the real parser, and the dataclass built by library code."""
    family = next(f for f, table in FLAG_TABLES.items() if name in {flag["dest"] for flag in table["flags"]})
    value = out_of_range(NUMBER_FIELDS[name])
    with pytest.raises(ValueError) as err:
        build_with(name, value, tmp_path)
    fixed = fixed_field_reasons(PROG, {"algorithm": "choco", **({} if family == "vision" else {"task": "ag_news"})})
    description = FLAG_TABLES[family]["descriptions"][None if family == "vision" else "ag_news", "choco"]
    code, _, message = outcome(lambda: check_flags(family, [f"--{name}", str(value)], fixed=fixed, prog=PROG,
                                                   description=description), capsys)
    assert code == 2 and message == f"{PROG}: error: argument --{name}: {err.value}\n"


def test_recipe_main_refuses_what_it_does_not_run():
    with pytest.raises(ValueError, match="family must be one of"):
        recipe_main("audio", "choco")
    with pytest.raises(ValueError, match="algorithm must be one of"):
        recipe_main("nlp", "gossip", task="ag_news")
    with pytest.raises(ValueError, match="task: the vision recipes take --dataset"):
        recipe_main("vision", "choco", task="ag_news")


def imported_modules(importtime_stderr: str) -> set[str]:
    """The modules ``python -X importtime`` reports on stderr (``import time: self | cumulative | name``)."""
    return {line.rsplit("|", 1)[1].strip() for line in importtime_stderr.splitlines()
            if line.startswith("import time:") and "|" in line}


@pytest.mark.parametrize("recipe, argv, status", [
    ("agnews_choco.py", ["--skew", "2"], 2),
    ("sentlen_deepsqueeze.py", ["--no-such-flag"], 2),
    ("agnews_choco.py", ["--learning_rate", "abc"], 2),
    ("vision_choco.py", ["--nodes", "0"], 2),
    ("agnews_choco.py", ["--help"], 0),
    ("vision_deepsqueeze.py", ["--help"], 0),
    ("sweep.py", ["--skews", "2"], 2),
    ("sweep.py", ["--help"], 0),
])
def test_a_real_recipe_answers_a_bad_flag_or_help_without_importing_torch(recipe, argv, status):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-X", "importtime", str(REPO / "recipes" / recipe), *argv],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == status, proc.stderr[-2000:]
    modules = imported_modules(proc.stderr)
    assert "lp_decentral_nlp.commands.flag_table" in modules  # the table answered
    assert not {m for m in modules if m.split(".")[0] in ("torch", "transformers", "numpy", "datasets")}
    messages = [line for line in proc.stderr.splitlines() if not line.startswith("import time:")]
    if status == 2:
        assert len(messages) == 1 and messages[0].startswith(f"{recipe}: error: argument " if argv[0] != "--no-such-flag"
                                                             else f"{recipe}: error: unrecognized arguments")
    else:
        assert messages == [] and proc.stdout.startswith(f"usage: {recipe} [options]")


@pytest.mark.parametrize("argv", [["--arch", "resnet20", "--batch-size", "0"], ["--arch", "resnet20", "--convention", "x"],
                                  ["--help"]])
def test_the_cost_command_answers_a_bad_flag_or_help_without_importing_torch(argv):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "lp_decentral_nlp.cost", *argv],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == (0 if argv == ["--help"] else 2), proc.stderr[-2000:]
    modules = imported_modules(proc.stderr)
    assert "lp_decentral_nlp.cost.conventions" in modules
    assert not {m for m in modules if m.split(".")[0] in ("torch", "transformers", "numpy", "datasets")}
    messages = [line for line in proc.stderr.splitlines() if not line.startswith("import time:")]
    if argv == ["--help"]:
        assert messages == [] and "--convention" in proc.stdout
    else:
        assert len(messages) == 1 and messages[0].startswith("python -m lp_decentral_nlp.cost: error: argument --")
