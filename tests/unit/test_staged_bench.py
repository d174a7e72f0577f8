"""`p2phub bench load|save` pieces that run without a GPU: the pattern file, the deep-queue
ceiling readers and writers, the CLI."""

from __future__ import annotations

import os

import pytest

from p2phub.cli import main
from p2phub.commands import bench_load as bl

MiB = 1 << 20


def test_parse_size() -> None:
    assert bl._parse_size("4G") == 4 << 30 and bl._parse_size("16MiB") == 16 * MiB
    assert bl._parse_size("4096") == 4096


def test_pattern_file_and_ceiling_readers(tmp_path) -> None:
    import array
    p = str(tmp_path / "f.bin")
    bl.make_file(p, 3 * MiB, chunk=MiB)
    words = array.array("q", open(p, "rb").read())
    assert len(words) == 3 * MiB // 8
    assert all(w == i ^ bl.SEED for i, w in enumerate(words))
    bl.make_file(p, 3 * MiB)                 # the right size already: left alone
    try:
        dt = bl.ceiling_read(p, 3 * MiB, MiB, 2)
    except OSError as exc:                   # a file system without O_DIRECT
        pytest.skip(f"O_DIRECT: {exc}")
    assert dt > 0
    out = str(tmp_path / "o.bin")
    assert bl.ceiling_write(out, 3 * MiB, MiB, 2) > 0
    assert os.path.getsize(out) == 3 * MiB


def test_cli_knows_load_and_save(capsys) -> None:
    for name in ("load", "save"):
        assert main(["bench", name, "--help"]) == 0
        assert "--peers" in capsys.readouterr().out
