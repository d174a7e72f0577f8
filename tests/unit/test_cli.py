"""The `p2phub` command line's one contract (docs/cli.md), checked over every subcommand.

The table below has a row for every runnable subcommand, found from the argparse tree: a new
subcommand without a row fails `test_every_subcommand_has_a_row`. Each row's bad arguments must
be refused before any work, in one line on stderr, exit 4 (USAGE); with --json the same error is
also a JSON document with a schema on stdout. Ctrl-C and a closed stdout run as real processes.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from p2phub import cli, deps
from p2phub.exitcodes import Exit

TOP = Path(__file__).resolve().parents[2]
FIXTURE = TOP / "tests" / "fixtures" / "doctor" / "lab-switch-6.12"
ABSENT_BDF = "0000:ff:1f.7"   # no host has a function there

# (words after `p2phub`) -> bad argument lists, each refused with USAGE
BAD: dict[tuple[str, ...], list[list[str]]] = {
    ("info",): [["--device", "/tmp/p2phub-no-such-node"], ["--no-such-option"]],
    ("doctor",): [["--root", "{notcapture}"], ["--root", "/no/such/dir"], ["--active", "--active-bytes", "0"],
                  ["--active", "--active-nvme", "zz:00.0"], ["--active-lba", "-1", "--active"],
                  ["--explain", "no.such.check"]],
    ("nvme", "list"): [["--no-such-option"]],
    ("nvme", "bind"): [["zz:00.0"], [ABSENT_BDF], ["/dev/nvme99"], ["/dev/sda"], []],
    ("nvme", "unbind"): [[ABSENT_BDF], ["zz:00.0"]],
    ("nvme", "identify"): [["zz:00.0"], ["/dev/nvme99n1"]],
    ("kv", "serve"): [["--listen", "127.0.0.1:70000"], ["--listen", "nohost"], ["--count", "-1"],
                      ["--layers", "0"], ["--stall-timeout", "0"], ["--metrics-port", "-1"]],
    ("kv", "send"): [["--to", "127.0.0.1:99999"], ["--to", "127.0.0.1:0"], ["--to", "127.0.0.1:1", "--pages", "0"],
                     ["--pages", "8"], ["--to", "127.0.0.1:1", "--blocks", "16", "--pages", "17"],
                     ["--to", "127.0.0.1:1", "--rdv", "tcpstore://127.0.0.1:1"]],
    ("bench", "nvme"): [["--device", "zz:00.0"], ["--device", ABSENT_BDF], ["--qd", "0"], ["--qd", "1,x"],
                        ["--seconds", "0"], ["--seconds", "nan"], ["--bs", "0"]],
    ("bench", "ordering"): [["--live", "-5"], ["--live", "1,-5"], ["--ops", "0"], ["--runs", "0"],
                            ["--plot", "/no/such/dir/x.png"]],
    ("bench", "fence"): [["--iters", "0"], ["--runs", "0"], ["--hold-us", "-1"]],
    ("bench", "load"): [["--runs", "0"], ["--size", "0"], ["--lanes", "0"], ["--ceiling-threads", "4,0"]],
    ("bench", "save"): [["--chunk", "0"], ["--mode", "fast"]],
    ("bench", "restore"): [["--count", "0"], ["--runs", "0"], ["--sizes", "4K,0"], ["--size", "1X"],
                           ["--depths", "64,0"], ["--device", "tpu"], ["--slot", "0"]],
    ("bench", "kv"): [["--iters", "0"], ["--runs", "0"], ["--total", "100T"], ["--total", "1000"],
                      ["--methods", "bogus"], ["--blocks", "0"], ["--timeout", "-1"], ["--device", "tpu"],
                      ["--device", "cuda", "--methods", "nixl"]],
    ("top",): [["nohost"], ["127.0.0.1:0"], ["127.0.0.1:9400", "--interval", "0"],
               ["127.0.0.1:65536"]],
    ("nixl", "install-plugin"): [["--as", "lower_case"], ["--no-such-option"]],
    ("bench", "register"): [["--max-iters", "0"], ["--sizes", "1X"], ["--min-time", "-1"],
                            ["--device", "zz:00.0"], ["--device", "0000:00:05.0"]],
}


def _leaves() -> dict[tuple[str, ...], argparse.ArgumentParser]:
    return dict(cli.leaf_parsers(cli.build_parser()))


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def _cases() -> list[tuple[tuple[str, ...], list[str]]]:
    return [(path, bad) for path, rows in BAD.items() for bad in rows]


def test_every_subcommand_has_a_row() -> None:
    assert set(_leaves()) == set(BAD), "a subcommand without a row in BAD (or a row for none)"


@pytest.fixture()
def notcapture(tmp_path: Path) -> str:
    (tmp_path / "something").write_text("not a capture\n")
    return str(tmp_path)


@pytest.fixture(autouse=True)
def _hardware_here(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The NEEDS checks see every optional package, so these cases reach argument checks."""
    monkeypatch.setenv("P2PHUB_BENCH_DEVICE", "")
    monkeypatch.delenv("P2PHUB_LOG", raising=False)


@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
@pytest.mark.parametrize("path,bad", _cases(), ids=[" ".join(p + tuple(b)) for p, b in _cases()])
def test_bad_arguments_are_refused_in_one_line_with_exit_4(path, bad, as_json, notcapture, capsys,
                                                           monkeypatch) -> None:
    monkeypatch.setattr(deps, "available", lambda m: True)
    argv = [*path, *[a.replace("{notcapture}", notcapture) for a in bad]] + (["--json"] if as_json else [])
    t0 = time.monotonic()
    code, out, err = _run(argv, capsys)
    assert code == Exit.USAGE, (argv, code, out, err)
    assert time.monotonic() - t0 < 5, "refused before any work"
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("p2phub"), err
    assert "Traceback" not in err
    if as_json:
        doc = json.loads(out)
        assert doc["schema"].startswith("p2phub.") and doc["error"] and doc["exit"] == 4, doc
    else:
        assert out == "", out


def test_every_option_has_help_text() -> None:
    missing = []

    def walk(p: argparse.ArgumentParser) -> None:
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                missing.extend(f"{p.prog} {c.dest}" for c in a._choices_actions if not c.help)
                for sp in dict.fromkeys(a.choices.values()):
                    walk(sp)
            elif not isinstance(a, (argparse._HelpAction, argparse._VersionAction)) and not a.help:
                missing.append(f"{p.prog} {'/'.join(a.option_strings) or a.dest}")
    walk(cli.build_parser())
    assert not missing, f"options without help: {missing}"


def test_top_level_help_lists_every_subcommand(capsys) -> None:
    code, out, _ = _run(["--help"], capsys)
    assert code == 0
    for name in cli.SUBCOMMANDS:
        assert name in out


@pytest.mark.parametrize("path", sorted(_leaves()), ids=" ".join)
def test_subcommand_help(path, capsys) -> None:
    code, out, err = _run([*path, "--help"], capsys)
    assert code == 0, err
    assert "usage: p2phub " + " ".join(path) in out


@pytest.mark.parametrize("argv", [["no-such-command"], ["bench"], ["nvme"], ["kv"], []], ids=repr)
def test_missing_or_unknown_subcommand_is_a_usage_error(argv, capsys) -> None:
    code, _out, err = _run(argv, capsys)
    assert code == Exit.USAGE
    assert len(err.strip().splitlines()) <= 1


def test_info_without_the_module_says_so(monkeypatch, tmp_path, capsys) -> None:
    from p2phub import uapi
    monkeypatch.setattr(uapi, "DEVICE_PATH", str(tmp_path / "p2phub"))
    code, out, err = _run(["info"], capsys)
    assert code == Exit.NOT_LOADED and "not loaded" in err and out == ""
    code, out, _ = _run(["info", "--json"], capsys)
    assert code == Exit.NOT_LOADED
    assert json.loads(out)["loaded"] is False and json.loads(out)["schema"] == "p2phub.info/1"


def test_info_names_the_path_not_the_module(capsys) -> None:
    code, _out, err = _run(["info", "--device", "/tmp/p2phub-no-such-node"], capsys)
    assert code == Exit.USAGE and "/tmp/p2phub-no-such-node does not exist" in err
    code, _out, err = _run(["info", "--device", "/dev/null"], capsys)
    assert code == Exit.USAGE and "/dev/null is not the p2phub device" in err


@pytest.mark.parametrize("argv,package", [
    (["bench", "kv", "--device", "cuda"], "torch"),
    (["bench", "load"], "torch"),
    (["bench", "fence"], "cupy"),
    (["bench", "register", "--device", "00:05.0", "--rdma-dev", "mlx5_0"], "pyverbs"),
    (["bench", "ordering", "--plot", "{tmp}/x.png"], "matplotlib"),
    (["kv", "serve", "--metrics-port", "0"], "prometheus_client"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else v)
def test_missing_optional_packages_are_named_with_the_install_line(argv, package, monkeypatch, tmp_path,
                                                                   capsys) -> None:
    monkeypatch.setattr(deps, "available", lambda m: m.split(".")[0] != package)
    for as_json in (False, True):
        code, out, err = _run([a.replace("{tmp}", str(tmp_path)) for a in argv] + (["--json"] * as_json),
                              capsys)
        what, how = deps.INSTALL[package]
        assert code == Exit.NEEDS, err
        assert err.strip() == f"p2phub {' '.join(argv[:2])}: needs {what}: {how}"
        if as_json:
            assert json.loads(out)["exit_name"] == "NEEDS"


def test_a_gpu_device_without_a_gpu_is_named(monkeypatch, capsys) -> None:
    from p2phub.commands import bench_kv
    monkeypatch.setattr(deps, "available", lambda m: True)
    monkeypatch.setattr(bench_kv, "gpu_present", lambda: None)
    code, _out, err = _run(["bench", "kv", "--device", "cuda"], capsys)
    assert code == Exit.NEEDS and "needs a GPU" in err and len(err.strip().splitlines()) == 1


def test_nvme_commands_take_a_device_node(monkeypatch, tmp_path) -> None:
    """/dev/nvmeN and /dev/nvmeNnM name the controller's PCI function through sysfs."""
    from p2phub.commands import argtypes
    real = os.path.realpath

    def fake_realpath(p, strict=False):  # noqa: ANN001
        if str(p) == "/sys/class/nvme/nvme3/device":
            return "/sys/devices/pci0000:00/0000:00:1d.0/0000:3b:00.0"
        return real(p, strict=strict)
    monkeypatch.setattr(argtypes.os.path, "realpath", fake_realpath)
    assert argtypes.nvme_controller("/dev/nvme3") == "0000:3b:00.0"
    assert argtypes.nvme_controller("/dev/nvme3n1") == "0000:3b:00.0"
    assert argtypes.nvme_controller("nvme3") == "0000:3b:00.0"


def test_errors_after_parsing_are_one_line_and_json(capsys) -> None:
    """An error a command raises (here: a tarball that is not one) is one line, never a traceback."""
    code, out, err = _run(["doctor", "--root", str(FIXTURE / "p2phub-capture.json"), "--json"], capsys)
    assert code == Exit.USAGE and len(err.strip().splitlines()) == 1
    assert json.loads(out)["schema"] == "p2phub.error/1"


def test_one_exit_code_table_for_every_command_and_its_documentation() -> None:
    import re

    from p2phub.exitcodes import COMMON, MEANING, USED_BY

    assert len({int(c) for c in Exit}) == len(Exit) and set(MEANING) == set(Exit)
    assert set(USED_BY) == {"p2phub", *cli.SUBCOMMANDS}
    assert Exit.USAGE in COMMON and Exit.INTERRUPTED in COMMON
    doc = (TOP / "docs" / "cli.md").read_text()
    rows = dict(re.findall(r"^\| (\d+) \| `(\w+)` \|", doc, flags=re.M))
    assert rows == {str(int(c)): c.name for c in Exit}, "docs/cli.md's exit-code table is out of date"


# ------------------------------------------------------------------ real processes


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TOP), os.environ.get("PYTHONPATH", "")]))
    env.pop("P2PHUB_LOG", None)
    return env


def _spawn(*args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "p2phub", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env(), **kw)


@pytest.mark.parametrize("argv", [
    ["bench", "ordering", "--live", "1000", "--ops", "200000", "--runs", "50"],
    ["bench", "kv", "--blocks", "64K", "--total", "8M", "--iters", "100000", "--runs", "3",
     "--methods", "p2phub", "--timeout", "60"],
], ids=["bench ordering", "bench kv"])
def test_ctrl_c_is_one_line_and_exit_130(argv) -> None:
    """Ctrl-C reaches the whole foreground process group, as a terminal sends it."""
    env = dict(_env(), P2PHUB_LOG="debug")   # the dispatcher says when the command runs
    # A terminal's command starts with SIGINT at its default; a test suite started in the
    # background of a script (nohup, `&`) hands its children SIGINT ignored, which Python keeps.
    p = subprocess.Popen([sys.executable, "-m", "p2phub", *argv], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env, start_new_session=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        seen = []
        for line in p.stderr:  # type: ignore[union-attr]
            seen.append(line)
            if line.rstrip().endswith(": running"):
                break
        time.sleep(1.0)   # well into its work
        assert p.poll() is None, seen
        # Python raises KeyboardInterrupt only between bytecodes: a main thread inside a long C
        # call (a hot-path loop) sees it when that call returns, which on a loaded 2-core host
        # can outlast a single press; a user presses again, and so does this test.
        for _ in range(24):
            os.killpg(p.pid, signal.SIGINT)
            try:
                out, err = p.communicate(timeout=5)
                break
            except subprocess.TimeoutExpired:
                continue
        else:
            raise AssertionError("the command did not stop after 2 minutes of Ctrl-C")
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode == Exit.INTERRUPTED, err
    lines = err.strip().splitlines()
    assert lines[-1] == f"p2phub {' '.join(argv[:2])}: interrupted", err
    assert "Traceback" not in err and not any("Error" in ln for ln in lines), err
    assert out == ""


def test_a_reader_that_closed_stdout_ends_the_command_silently() -> None:
    r, w = os.pipe()
    os.close(r)   # the reader is gone before the first byte
    try:
        p = subprocess.run([sys.executable, "-m", "p2phub", "doctor", "--json", "--root", str(FIXTURE)],
                           stdout=w, stderr=subprocess.PIPE, text=True, env=_env(), timeout=60)
    finally:
        os.close(w)
    assert p.returncode == Exit.CLOSED_PIPE and p.stderr == "", p.stderr


def test_doctor_json_into_head_prints_nothing_on_stderr() -> None:
    p = subprocess.run(f"'{sys.executable}' -m p2phub doctor --json --root '{FIXTURE}' | head -c 10",
                       shell=True, capture_output=True, text=True, env=_env(), timeout=60)
    assert p.returncode == 0 and p.stdout == "{\n  \"schem"[:10] and p.stderr == "", p.stderr
