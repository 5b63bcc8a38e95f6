"""stripefs storage server: chunk files with CRC32C blocks on a local directory."""

from ._chunks import BLOCK, HEADER_SIZE, ChunkMeta, ChunkStore, chunk_files, chunk_path
from ._server import StorageService, serve_storage

__all__ = ["BLOCK", "HEADER_SIZE", "ChunkMeta", "ChunkStore", "chunk_files", "chunk_path", "StorageService", "serve_storage"]
