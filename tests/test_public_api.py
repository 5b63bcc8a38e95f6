"""Pin the public API: names users and other packages import (STYLE.md #9)."""

from __future__ import annotations

import importlib

import pytest

PUBLIC = {
    "fsclient": {"AsyncClient", "Client", "ClusterConfig", "ROOT_INO", "StripeFile", "find_cluster", "normpath"},
    "fsclient.batchread": {"SharedBuffer", "ReadRing", "Completion", "RegisteredFile", "resolve_mounted", "read_batch"},
    "staging": {"save", "load", "latest", "SaveHandle", "StagedStorageWriter", "StagedStorageReader", "Mover",
                "MoverOptions", "ChecksumError", "CheckpointConflict"},
    "wire": {"StripefsError", "ErrorCode", "FrameDecoder", "encode_frame", "encode_prefix", "decode_message",
             "Attr", "Layout", "Routing", "MESSAGES", "MAX_HEADER", "MAX_PAYLOAD"},
    "metadata": {"Namespace", "SqliteStore", "MemoryStore", "serve_metadata"},
    "storage": {"ChunkStore", "serve_storage"},
    "rpc": {"Connection", "TrioConnection", "Service", "serve_rpc", "BufferPool"},
}


@pytest.mark.parametrize("module", sorted(PUBLIC))
def test_exports(module: str) -> None:
    mod = importlib.import_module(module)
    exported = set(getattr(mod, "__all__", dir(mod)))
    assert PUBLIC[module] <= exported, PUBLIC[module] - exported
    for name in PUBLIC[module]:
        assert getattr(mod, name) is not None


def test_fsspec_entry_point() -> None:
    import fsspec

    cls = fsspec.get_filesystem_class("stripefs")
    assert cls.__name__ == "StripeFileSystem" and "stripefs" in (cls.protocol if isinstance(cls.protocol, tuple) else (cls.protocol,))


def test_console_script_commands() -> None:
    from fsclient.cli import EXTRA_COMMANDS, build_parser

    commands = set(build_parser()._subparsers._group_actions[0].choices)  # type: ignore[union-attr]
    assert {"up", "down", "status", "add-server", "scrub", "ls", "stat", "cat", "put", "get", "cp", "mv", "rm", "mkdir",
            "mount", "umount", "mover", "bench"} <= commands
    assert set(EXTRA_COMMANDS) == {"mount", "umount", "mover", "bench"}
