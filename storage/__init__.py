"""stripefs storage server: chunk files and container logs of small chunks, with CRC32C blocks, on a local directory."""

from ._chunks import BLOCK, HEADER_SIZE, ChunkMeta, ChunkStore, chunk_files, chunk_path, chunk_places
from ._server import StorageService, serve_storage

__all__ = ["BLOCK", "HEADER_SIZE", "ChunkMeta", "ChunkStore", "chunk_files", "chunk_path", "chunk_places", "StorageService", "serve_storage"]
