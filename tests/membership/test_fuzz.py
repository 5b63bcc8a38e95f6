"""A bounded structured fuzz of the control plane (issue 20), with the soak's machinery.

``bench.control_fuzz`` (``python -m stripefs.bench.control_fuzz --duration 600`` for the
soak) generates the frames: 2,000 membership frames (``RegisterServer``,
``Heartbeat``, ``SyncDone``) with random field values sent with the server
credential, so they reach the service's validation; 300 server-only frames
(membership, ``RemoveServer``, chunk management, versioned writes) from a client
connection, each refused with EACCES; raw garbage, truncated and oversized frames
before and after the handshake, to the metadata service and every storage server.
Afterwards every process is alive, nothing was registered, the routing version
and the chain table did not move, and the cluster reads and writes.
"""

from __future__ import annotations

import os
from typing import Iterator

import pytest

from stripefs.bench.control_fuzz import Fuzz, snapshot
from stripefs.fsclient import Client
from stripefs.fsclient.testing import LocalCluster

from ..conftest import TEST_CHUNK

MEMBERSHIP_FRAMES = 2000
CLIENT_FRAMES = 300
RAW_CONNECTIONS = 150
SEED = 20


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    h = LocalCluster.start(str(tmp_path_factory.mktemp("fuzz")), servers=2, chunk_size=TEST_CHUNK, gc_grace=2.0)
    yield h
    h.down()


def _before(h: LocalCluster) -> tuple:
    with h.client() as c:
        return snapshot(c)


def test_membership_fuzz_changes_nothing(fuzzed: LocalCluster) -> None:
    fuzz = Fuzz(fuzzed, SEED)
    before = _before(fuzzed)
    with Client(os.path.join(fuzzed.root, "server.json")) as server:  # as a server: the frames reach the service
        fuzz.membership(server, MEMBERSHIP_FRAMES)
    print(f"{MEMBERSHIP_FRAMES} membership frames: {fuzz.answers}")
    checks = fuzz.check(before)
    assert all(checks.values()), (checks, fuzz.answers)


def test_server_only_frames_from_a_client_are_all_refused(fuzzed: LocalCluster) -> None:
    fuzz = Fuzz(fuzzed, SEED + 2)
    before = _before(fuzzed)
    with fuzzed.client() as client:
        fuzz.as_client(client, CLIENT_FRAMES)  # raises on any answer other than EACCES
    assert fuzz.refused_client == CLIENT_FRAMES
    checks = fuzz.check(before)
    assert all(checks.values()), checks


def test_raw_garbage_before_and_after_authentication(fuzzed: LocalCluster) -> None:
    fuzz = Fuzz(fuzzed, SEED + 1)
    before = _before(fuzzed)
    fuzz.raw_connections(RAW_CONNECTIONS)
    checks = fuzz.check(before)
    assert all(checks.values()), checks
