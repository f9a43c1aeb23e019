"""The committed protobuf code (shellrl/v1/*_pb2.py, *.pyi) is what proto/ generates today."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.helpers.owned_processes import run_owned

REPO = Path(__file__).resolve().parents[2]
PROTOS = sorted((REPO / "proto" / "shellrl" / "v1").glob("*.proto"))


def test_generated_protobuf_code_is_not_stale(tmp_path):
    pytest.importorskip("grpc_tools")
    assert PROTOS, "no .proto files found"
    run_owned(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            "-I",
            str(REPO / "proto"),
            f"--python_out={tmp_path}",
            f"--pyi_out={tmp_path}",
            *map(str, PROTOS),
        ],
        check=True,
        capture_output=True,
        timeout_s=120,
    )
    stale = []
    for proto in PROTOS:
        for suffix in ("_pb2.py", "_pb2.pyi"):
            name = proto.stem + suffix
            fresh = (tmp_path / "shellrl" / "v1" / name).read_bytes()
            committed = REPO / "shellrl" / "v1" / name
            if not committed.is_file() or committed.read_bytes() != fresh:
                stale.append(name)
    assert not stale, f"regenerate with `make proto` and commit: {stale}"


def test_every_generated_module_has_a_proto_and_vice_versa():
    generated = {p.name.removesuffix("_pb2.py") for p in (REPO / "shellrl" / "v1").glob("*_pb2.py")}
    assert generated == {p.stem for p in PROTOS}
