"""stripefs metadata service: namespace on a transactional store, membership, chain table, GC."""

from ._memstore import MemoryStore
from ._namespace import RENAME_EXCHANGE, RENAME_NOREPLACE, Namespace
from ._service import MetadataService, serve_metadata
from ._sqlite import SqliteStore

__all__ = ["Namespace", "RENAME_EXCHANGE", "RENAME_NOREPLACE", "MetadataService", "serve_metadata", "MemoryStore", "SqliteStore"]
