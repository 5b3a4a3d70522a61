"""Serving across hosts (server/nodes.py): node 0's device calls reach the other nodes in order,
with the models and request slots by reference and host values by value; bad set-ups are clear
errors. The two-process end-to-end check is tests/test_tp.py::test_serve_two_hosts."""

from __future__ import annotations

import dataclasses
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.errors import JaxspecError
from jaxspec.server.nodes import Nodes, channel_address, new_batch
from jaxspec.sharding import HostKeys, to_host, to_mesh
from jaxspec.weights import Models

from helpers import free_port


@dataclasses.dataclass
class FakeEngine:
    models: Models
    target_models: Models
    mesh: None = None


class FakePrograms:
    def __init__(self):
        self.calls: list[tuple] = []

    def get_local(self, key):
        def prog(*args):
            self.calls.append((key, args))
            return "new batch" if key[0] in ("copy", "chunk") else ("new batch", "outs")

        return prog


class FakeSched:
    def __init__(self, tag: str):
        self.eng = FakeEngine(Models(tag, {}, prop="draft"), Models(tag, {}))
        self.batch = f"{tag} batch"
        self.programs = FakePrograms()


def pair(timeout: float = 30.0) -> tuple[Nodes, Nodes]:
    addr = f"127.0.0.1:{free_port() - 1}"
    lead, follow = Nodes(addr, 2, 0, timeout), Nodes(addr, 2, 1, timeout)
    t = threading.Thread(target=follow.connect)
    t.start()
    lead.connect()
    t.join()
    return lead, follow


def test_calls_reach_the_other_node_in_order():
    lead, follower = pair()
    lead.sched, follower.sched = FakeSched("lead"), FakeSched("follow")
    got: dict = {}
    t = threading.Thread(target=lambda: got.update(rc=follower.follow()))
    t.start()
    key = jax.vmap(jax.random.key)(jnp.arange(2, dtype=jnp.uint32))
    st = {"temperature": jnp.asarray([0.5, 1.0]), "keys": key}
    lead.run(("chunk", 2, 4, 64), lambda *a: "lead out", lead.sched.eng.models, lead.sched.batch, np.arange(2))
    lead.run(("finish", 2), lambda *a: ("lead out", 1), lead.sched.eng.models, lead.sched.batch, st)
    lead.run(("dispatch", 2), lambda *a: ("lead out", 1), lead.sched.eng.target_models, lead.sched.batch, np.ones(3))
    lead.stop()
    t.join(10)
    assert got["rc"] == 0
    calls = follower.sched.programs.calls
    assert [k for k, _ in calls] == [("chunk", 2, 4, 64), ("finish", 2), ("dispatch", 2)]
    # the follower's own models and slots, node 0's host values
    (_, a0), (_, a1), (_, a2) = calls
    assert a0[0] is not lead.sched.eng.models and a0[0].graphdef == "follow" and a0[0].prop == "draft"
    assert a0[1] == "follow batch" and a1[1] == "new batch"  # the batch the chunk program returned
    np.testing.assert_array_equal(a0[2], [0, 1])
    np.testing.assert_array_equal(a1[2]["temperature"], [0.5, 1.0])
    np.testing.assert_array_equal(jax.random.key_data(a1[2]["keys"]), jax.random.key_data(key))
    assert a2[0].graphdef == "follow" and a2[0].prop is None
    assert follower.sched.batch == "new batch"


def test_agree_gives_node_0s_value():
    lead, follower = pair()
    got = {}
    t = threading.Thread(target=lambda: got.update(v=follower.agree("slots", 3)))
    t.start()
    assert lead.agree("slots", 8) == 8
    t.join(10)
    assert got["v"] == 8
    lead.stop()
    follower.stop()


def test_a_follower_whose_node_0_is_gone_stops_with_a_clear_error():
    lead, follower = pair()
    follower.sched = FakeSched("follow")
    for c in lead.conns:
        c.close()
    with pytest.raises(JaxspecError, match="node 0 is gone"):
        follower.follow()


def test_node_0_waits_a_bounded_time_for_the_others():
    with pytest.raises(JaxspecError, match="1 of 2 nodes joined within 1 s"):
        Nodes(f"127.0.0.1:{free_port() - 1}", 2, 0, timeout=1).connect()
    with pytest.raises(JaxspecError, match="node 0 did not answer"):
        Nodes(f"127.0.0.1:{free_port() - 1}", 2, 1, timeout=1).connect()


def test_host_values_round_trip():
    key = jax.random.key(7)
    h = to_host({"k": key, "x": jnp.arange(3)})
    assert isinstance(h["k"], HostKeys) and isinstance(h["x"], np.ndarray)
    back = to_mesh(h, None)
    np.testing.assert_array_equal(jax.random.key_data(back["k"]), jax.random.key_data(key))
    assert channel_address("10.0.0.1:5000") == ("10.0.0.1", 5001)
    assert new_batch(("copy",), "b") == "b" and new_batch(("dispatch", 1), ("b", "o")) == "b"
