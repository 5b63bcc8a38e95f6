"""stripefs metadata service: namespace on a transactional store, membership, chain table, GC."""

from ._namespace import RENAME_EXCHANGE, RENAME_NOREPLACE, Namespace
from ._server import MetadataService, serve_metadata
from ._store import MemoryStore, SqliteStore

__all__ = ["Namespace", "RENAME_EXCHANGE", "RENAME_NOREPLACE", "MetadataService", "serve_metadata", "MemoryStore", "SqliteStore"]
