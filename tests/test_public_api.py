"""Pin the public API: the names users and the other packages import.

The lists are exact: a name added to ``__all__`` without being listed here fails as
surely as a name removed, so every change to the public surface is a deliberate one.
"""

from __future__ import annotations

import importlib

import pytest

PUBLIC: dict[str, set[str]] = {
    'stripefs': {'AsyncClient', 'Client', 'ClusterConfig', 'find_cluster', 'StripeFile'},
    'stripefs.wire': {'CRC_BLOCK', 'check_segments', 'segments', 'Attr', 'BadRequest', 'check_proof', 'ClientConnection', 'ConnectionClosed', 'ConnState', 'ErrorReceived', 'Event', 'HandshakeComplete', 'RequestReceived', 'ResponseCancelled', 'ResponseReceived', 'ServerConnection', 'client_proof', 'decode_message', 'decode_reply', 'DirEntry', 'encode_frame', 'encode_prefix', 'error_from_oserror', 'ErrorCode', 'FLAG_ERROR', 'FLAG_RESPONSE', 'Frame', 'FrameDecoder', 'FrameHead', 'Layout', 'MAGIC', 'MAX_CHUNK', 'MAX_FILE_SIZE', 'MAX_HEADER', 'MAX_NAME', 'MAX_PATH', 'MAX_PAYLOAD', 'MAX_STRIPE', 'Message', 'messages', 'MESSAGES', 'MIN_CHUNK', 'NEED_DATA', 'new_nonce', 'new_secret', 'PREFIX', 'ROLES', 'role_credential', 'ReplyMessage', 'Routing', 'server_proof', 'ServerInfo', 'StripefsError', 'validate_name', 'VERSION'},
    'stripefs.rpc': {'cannot_start', 'int_setting', 'my_pid', 'abandon', 'BUSY_AFTER', 'ByteBudget', 'ClientSlots', 'MAX_CLIENT_CONNECTIONS', 'PAYLOAD_BUDGET', 'aligned', 'BufferPool', 'Connection', 'ConnectionPool', 'ReplayCache', 'ThreadReply', 'TrioPool', 'Reply', 'serve_rpc', 'ServerConn', 'Service', 'TrioConnection', 'tune_socket', 'unavailable'},
    'stripefs.metadata': {'MemoryStore', 'MetadataService', 'Namespace', 'RENAME_EXCHANGE', 'RENAME_NOREPLACE', 'serve_metadata', 'SqliteStore'},
    'stripefs.storage': {'BLOCK', 'ChunkMeta', 'ChunkStore', 'chunk_files', 'chunk_path', 'chunk_places', 'HEADER_SIZE', 'serve_storage', 'StorageService'},
    'stripefs.fsclient': {'AsyncClient', 'Client', 'ClusterConfig', 'find_cluster', 'normpath', 'ROOT_INO', 'StripeFile'},
    'stripefs.fsclient.core': {'Lease', 'AsyncClient', 'Client', 'ClusterConfig', 'default_state_file', 'fill_bytes', 'find_cluster', 'mode_flags', 'mounts', 'normpath', 'pid_alive', 'PREFIX', 'remember_cluster', 'ROOT_INO', 'split', 'StripeFile'},
    'stripefs.fsclient.fuse': {'FuseConfig', 'main', 'mount', 'mount_record', 'MOUNT_STATE_DIR', 'mount_state_path', 'mounted_fstype', 'MountError', 'StripeOperations', 'umount'},
    'stripefs.fsclient.fsspec': {'StripeFileSystem', 'StripeFsFile'},
    'stripefs.fsclient.batchread': {'Completion', 'MOUNT_STATE_DIR', 'mount_state_path', 'MountedFile', 'read_batch', 'ReadRing', 'RegisteredFile', 'resolve_mounted', 'SharedBuffer'},
    'stripefs.fsclient.batchread.dataset': {'Batch', 'collate_batch', 'IndexDataset', 'loader', 'RecordDataset'},
    'stripefs.fsclient.testing': {'LocalPostgres', 'postgres_bin', 'add_server', 'down', 'LocalCluster', 'mark_removed', 'read_cluster', 'up'},
    'stripefs.fsclient.testing.differential': {'Divergence', 'LocalRoute', 'MountRoute', 'NativeRoute', 'parse_seeds', 'replay', 'Route', 'run_seed'},
    'stripefs.staging': {'CheckpointAborted', 'CheckpointConflict', 'ChecksumError', 'default_staging_dir', 'Durability', 'latest', 'load', 'Mover', 'MoverOptions', 'read_manifest', 'release_buffers', 'save', 'SaveHandle', 'StagedStorageReader', 'StagedStorageWriter', 'verify'},
    'stripefs.bench': {'aggregate', 'BenchConfig', 'run_bench'},
}


@pytest.mark.parametrize("module", sorted(PUBLIC))
def test_exports_are_exactly_the_pinned_names(module: str) -> None:
    mod = importlib.import_module(module)
    exported = set(mod.__all__)
    assert len(exported) == len(mod.__all__), "a name is listed twice in __all__"
    assert not PUBLIC[module] - exported, f"removed from {module}.__all__: {sorted(PUBLIC[module] - exported)}"
    assert not exported - PUBLIC[module], f"added to {module}.__all__ without a pin: {sorted(exported - PUBLIC[module])}"
    for name in exported:
        assert getattr(mod, name) is not None, name


def test_fsspec_entry_point() -> None:
    import fsspec

    cls = fsspec.get_filesystem_class("stripefs")
    assert cls.__module__.startswith("stripefs.fsclient.fsspec")
    assert cls.__name__ == "StripeFileSystem" and "stripefs" in (cls.protocol if isinstance(cls.protocol, tuple) else (cls.protocol,))


def test_console_script_commands() -> None:
    from stripefs.cli import EXTRA_COMMANDS, build_parser

    commands = set(build_parser()._subparsers._group_actions[0].choices)  # type: ignore[union-attr]
    assert {"up", "down", "status", "add-server", "scrub", "ls", "stat", "cat", "put", "get", "cp", "mv", "rm", "mkdir",
            "mount", "umount", "mover", "bench", "serve", "token", "client-config"} <= commands
    assert set(EXTRA_COMMANDS) == {"mount", "umount", "mover", "bench", "serve"}
