"""Hypothesis stateful test of the native file object against a model (a bytearray).

Complements the seeded exerciser (tests/core/test_differential.py): Hypothesis
picks the operations and shrinks a failure to a short sequence. Sizes cluster
around the test cluster's chunk (256 KiB) and the write-behind window, where the
write path changes strategy (buffered, background, sent straight from the
caller's memory).
"""

from __future__ import annotations

import itertools

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from stripefs.fsclient import Client
from tests.conftest import TEST_CHUNK

_names = itertools.count()

SIZES = st.sampled_from([1, 100, 4096, TEST_CHUNK - 1, TEST_CHUNK, TEST_CHUNK + 1, 3 * TEST_CHUNK, 5 * TEST_CHUNK])
POSITIONS = st.one_of(st.integers(0, 6 * TEST_CHUNK), st.sampled_from([0, TEST_CHUNK, 2 * TEST_CHUNK - 1]))


def _run_machine(client: Client, testdir: str) -> None:
    class FileModel(RuleBasedStateMachine):
        """One open ``r+b`` file and the bytes it must hold."""

        @initialize()
        def start(self) -> None:
            self.path = f"{testdir}/m{next(_names)}"
            self.model = bytearray()
            self.pos = 0
            self.f = client.open(self.path, "w+b")
            self.fill = 0

        def _data(self, n: int) -> bytes:
            self.fill = (self.fill + 1) % 251
            return bytes([self.fill + 1]) * n  # each write its own byte value: a lost one shows

        def _put(self, at: int, data: bytes) -> None:
            if at > len(self.model):
                self.model.extend(bytes(at - len(self.model)))
            self.model[at : at + len(data)] = data

        @rule(n=SIZES)
        def write(self, n: int) -> None:
            data = self._data(n)
            assert self.f.write(data) == n
            self._put(self.pos, data)
            self.pos += n

        @rule(at=POSITIONS, n=SIZES)
        def pwrite(self, at: int, n: int) -> None:
            data = self._data(n)
            self.f.pwrite(data, at)
            self._put(at, data)

        @rule(at=POSITIONS)
        def seek(self, at: int) -> None:
            self.pos = self.f.seek(at)

        @rule(size=POSITIONS)
        def truncate(self, size: int) -> None:
            self.f.truncate(size)
            del self.model[size:]
            self.model.extend(bytes(size - len(self.model)))

        @rule(n=SIZES)
        def read(self, n: int) -> None:
            got = self.f.read(n)
            assert got == bytes(self.model[self.pos : self.pos + n])
            self.pos += len(got)

        @rule()
        def fsync(self) -> None:
            self.f.fsync()
            assert client.read_bytes(self.path) == bytes(self.model)

        @precondition(lambda self: hasattr(self, "f"))
        @rule()
        def reopen(self) -> None:
            self.f.close()
            assert client.read_bytes(self.path) == bytes(self.model)
            self.f = client.open(self.path, "r+b")
            self.pos = 0

        @invariant()
        def position(self) -> None:
            if hasattr(self, "f"):
                assert self.f.tell() == self.pos

        def teardown(self) -> None:
            if hasattr(self, "f"):
                self.f.close()
                assert client.read_bytes(self.path) == bytes(self.model)

    FileModel.TestCase.settings = settings(max_examples=15, stateful_step_count=25, deadline=None,
                                           suppress_health_check=list(HealthCheck))
    FileModel.TestCase().runTest()


def test_file_object_matches_a_bytearray(client: Client, testdir: str) -> None:
    _run_machine(client, testdir)
