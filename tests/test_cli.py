"""Command line: JSON output, and bad input -> one clear line and exit code 2."""
import json
import subprocess
import sys

import pytest

from treeflash.cli import main
from treeflash.models.drafter import Drafter
from treeflash.models.drafter_config import DrafterConfig

pytestmark = pytest.mark.slow  # the real default target (cached per process)


def cli(capsys, *args):
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_generate_json(capsys):
    code, out, _ = cli(capsys, "generate", "Say hi.", "--drafter", "random", "--json", "--max-new-tokens", "12",
                       "--method", "marginal", "--tree-size", "8")
    assert code == 0
    d = json.loads(out)
    assert len(d["token_ids"]) == 12 and isinstance(d["text"], str) and d["text"]
    s = d["stats"]
    assert sum(s["acceptance_lengths"]) + 1 == 12 and s["steps"] == len(s["acceptance_lengths"])
    assert s["tokens_per_second"] > 0


def test_generate_streams_same_text_as_json(capsys):
    args = ["generate", "Name a color.", "--drafter", "random", "--max-new-tokens", "10", "--tree-size", "8"]
    code, streamed, err = cli(capsys, *args)
    assert code == 0 and "tau" in err and "tok/s" in err
    _, out, _ = cli(capsys, *args, "--json")
    assert streamed.rstrip("\n") == json.loads(out)["text"]


def save_drafter(tmp_path, name, **changes):
    cfg = DrafterConfig.for_target(_smol_config(), mask_token_id=16)
    for k, v in changes.items():
        setattr(cfg, k, v)
    path = tmp_path / name
    Drafter(cfg).init_weights().save(path)
    return str(path)


def _smol_config():
    import treeflash.api as api
    return api._load_target("smollm2-135m", api.parse_dtype("float32")).config


BAD = [
    (["generate", "   "], "empty prompt"),
    (["generate", "word " * 9000], "context window"),
    (["generate", "hi", "--tree-size", "0"], "tree size"),
    (["generate", "hi", "--top-m", "100000"], "top-m"),
    (["generate", "hi", "--top-k", "100000"], "top-k"),
    (["generate", "hi", "--temperature", "-1"], "temperature"),
    (["generate", "hi", "--top-p", "0"], "top-p"),
    (["generate", "hi", "--top-p", "1.5"], "top-p"),
    (["generate", "hi", "--max-new-tokens", "0"], "max_new_tokens"),
    (["generate", "hi", "--drafter", "/nonexistent/drafter"], "not found"),
    (["generate", "hi", "--drafter", "none"], "needs a drafter"),  # before --tree-size auto says anything
    (["generate", "hi", "--target", "/nonexistent/model"], "target"),
]


@pytest.mark.parametrize("args,message", BAD)
def test_bad_input(capsys, args, message):
    if "--drafter" not in args:
        args = args + ["--drafter", "random"]
    code, _, err = cli(capsys, *args)
    assert code == 2
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


@pytest.mark.parametrize("change,message", [
    ({"hidden_size": 64, "intermediate_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1,
      "head_dim": 32}, "hidden size"),
    ({"vocab_size": 1000}, "vocabulary"),
    ({"target_layer_ids": [2, 40]}, "out of range"),
    ({"num_target_layers": 12}, "target layers"),
])
def test_mismatched_drafter(capsys, tmp_path, change, message):
    path = save_drafter(tmp_path, "bad", **change)
    code, _, err = cli(capsys, "generate", "hi", "--drafter", path)
    assert code == 2 and message in err


def test_corrupt_and_missing_checkpoint(capsys, tmp_path):
    path = save_drafter(tmp_path, "ok")
    (tmp_path / "ok" / "model.safetensors").write_bytes(b"not a safetensors file at all")
    code, _, err = cli(capsys, "generate", "hi", "--drafter", path)
    assert code == 2 and "corrupt" in err
    (tmp_path / "ok" / "model.safetensors").unlink()
    code, _, err = cli(capsys, "generate", "hi", "--drafter", path)
    assert code == 2 and "missing" in err
    (tmp_path / "ok" / "config.json").write_text("{not json")
    code, _, err = cli(capsys, "generate", "hi", "--drafter", path)
    assert code == 2 and "JSON" in err


def test_subprocess_exit_code_and_no_traceback():
    r = subprocess.run([sys.executable, "-m", "treeflash.cli", "generate", "hi", "--temperature", "-2",
                        "--drafter", "random"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr and "temperature must be >= 0" in r.stderr


def test_python_dash_m_and_the_console_script_both_run():
    """`python -m treeflash` and the installed `treeflash` script (next to this interpreter, as in .venv)."""
    from pathlib import Path

    script = Path(sys.executable).with_name("treeflash")
    for cmd in ([sys.executable, "-m", "treeflash", "--help"], [str(script), "--help"]):
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        assert r.stdout.startswith("usage: treeflash") and "generate" in r.stdout
    for name in ("lookup", "treeflash+lookup"):  # the new methods are offered
        r = subprocess.run([sys.executable, "-m", "treeflash", "generate", "--help"], capture_output=True, text=True,
                           timeout=120)
        assert name in r.stdout


def test_a_command_loads_only_its_own_module():
    """`treeflash generate` imports no training, bench or serve code; a bare `treeflash` lists them all."""
    code = ("import sys; from treeflash.cli import build_parser; p = build_parser(sys.argv[1:]); "
            "print(sorted(m for m in sys.modules if m.startswith('treeflash.') and m.count('.') >= 1))")
    gen = subprocess.run([sys.executable, "-c", code, "generate", "Hi"], capture_output=True, text=True, timeout=120)
    loaded = gen.stdout
    assert gen.returncode == 0 and "treeflash.cli_generate" in loaded
    for heavy in ("treeflash.training", "treeflash.bench", "treeflash.serve"):
        assert heavy not in loaded, heavy
    bare = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert bare.returncode == 0
    for heavy in ("treeflash.training", "treeflash.bench", "treeflash.serve"):  # listed from `cli.COMMANDS`
        assert heavy not in bare.stdout, heavy


HELP_CHECK = """
import contextlib, io, json, sys
from treeflash.cli import COMMANDS, main

heavy = ("torch", "transformers")
report = {}
for argv in [["--help"]] + [[name, "--help"] for name in COMMANDS]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            main(argv)
        except SystemExit as e:
            code = e.code
    report[" ".join(argv)] = {"code": code, "usage": out.getvalue().startswith("usage: treeflash"),
                              "heavy": [m for m in heavy if m in sys.modules]}
print(json.dumps(report))
"""


def test_help_answers_without_torch_or_transformers():
    """`treeflash --help` and `treeflash CMD --help` of every command answer without importing torch or
    transformers (each command's `register` is light; the top level lists commands from a table)."""
    from treeflash.cli import COMMANDS

    r = subprocess.run([sys.executable, "-c", HELP_CHECK], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert set(report) == {"--help"} | {f"{name} --help" for name in COMMANDS}
    for argv, got in report.items():  # the first command that loads a heavy module is named
        assert got == {"code": 0, "usage": True, "heavy": []}, (argv, got)


def test_the_command_table_matches_each_commands_own_help():
    """`treeflash --help` lists each command with the line its module registers."""
    import argparse

    from treeflash.cli import COMMANDS, build_parser

    for name, (_, line) in COMMANDS.items():
        sub = next(a for a in build_parser([name])._actions if isinstance(a, argparse._SubParsersAction))
        helps = {c.dest: c.help for c in sub._choices_actions}
        assert helps[name] == line, name


def test_generate_compare_decodes_plainly_too(capsys):
    """--compare: the same prompt decoded plainly in the same process (greedy: the same tokens) and
    the speed ratio; in --json mode it is a field and stderr stays quiet."""
    args = ["generate", "Name a color.", "--drafter", "random", "--max-new-tokens", "10", "--compare",
            "--dtype", "float32", "--tree-size", "8"]
    code, out, err = cli(capsys, *args, "--json")
    assert code == 0 and "plain decoding" not in err and "[vanilla@1]" not in err
    d = json.loads(out)
    assert d["compare"]["plain_token_ids"] == d["token_ids"] and d["compare"]["speedup"] > 0
    assert d["compare"]["plain"]["steps"] == len(d["token_ids"]) - 1  # the first token comes from the prefill
    code, _, err = cli(capsys, *args)
    assert code == 0 and "ran" in err and "x plain decoding" in err and "[vanilla@1]" in err
