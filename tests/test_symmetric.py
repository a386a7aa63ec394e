"""Symmetric memory is freed only at explicit collective points (runtime/dist/symmetric.py):
an owner's close() (Lease.release) or release_unclosed() — never when an owner is dropped.
torch's symmetric allocation is faked by CPU tensors, whose storage lifetime is what we watch."""
import gc
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
from torch.multiprocessing.reductions import StorageWeakRef  # noqa: E402

from tldsl.runtime.dist import symmetric as sym  # noqa: E402


class Handle:
    """rendezvous's handle: every rank's address of the block, as mapped here (a peer's copy
    is a second CPU tensor)."""

    def __init__(self, t):
        self.peer = torch.empty_like(t)
        self.buffer_ptrs = [t.data_ptr(), self.peer.data_ptr()]


class Owner:
    """An op: holds its lease and views of its blocks, as the fused ops do."""


@pytest.fixture
def ctx(monkeypatch):
    import torch.distributed._symmetric_memory as sm
    monkeypatch.setattr(sm, "empty", lambda size, dtype=None, device=None: torch.empty(size, dtype=dtype).fill_(7))
    monkeypatch.setattr(sm, "rendezvous", lambda t, group_name: Handle(t))
    monkeypatch.setattr(sym, "_LEDGER", {})
    monkeypatch.setattr(sym, "_SEQ", {})
    return SimpleNamespace(group_name="g0", group=None, device=0, rank=0, world_size=1)


def _own(ctx, what="op", shapes=((256, 64),)):
    owner = Owner()
    owner.lease = sym.Lease(ctx, what, owner)
    refs = []
    for i, shape in enumerate(shapes):
        t, h = owner.lease.empty(shape, torch.float32)
        setattr(owner, f"block{i}", t)
        setattr(owner, f"handle{i}", h)
        refs.append(StorageWeakRef(t.untyped_storage()))
    return owner, refs


def test_close_frees_at_the_release_and_not_before(ctx):
    owner, (ref,) = _own(ctx)
    owner.rows = owner.block0[3:9]                              # views in attributes ...
    owner.table = {"slots": (owner.block0[0], 5), "peer": owner.handle0.peer[1:2]}   # ... and containers,
    owner.name, owner.scratch = "keep me", torch.ones(3)       # a peer's mapping; unrelated state stays
    t = owner.block0
    del owner.block0
    gc.collect()
    assert not ref.expired()                                    # dropping views frees nothing
    del t
    owner.lease.forget(owner)
    assert owner.rows is None and owner.table is None and owner.handle0 is None
    assert owner.name == "keep me" and torch.equal(owner.scratch, torch.ones(3))
    with_warnings = []
    import warnings
    with warnings.catch_warnings(record=True) as with_warnings:
        warnings.simplefilter("always")
        owner.lease.release()
    assert ref.expired() and sym.outstanding() == [] and not with_warnings
    owner.lease.release()                                       # a second release does nothing
    del owner
    gc.collect()                                                # and the owner's end warns of nothing


def test_a_dropped_owner_warns_and_keeps_its_memory_until_release_unclosed(ctx):
    owner, refs = _own(ctx, "AllGatherMatmul(1, 2, 3)", shapes=((64, 64), (8,)))
    with pytest.warns(sym.SymmetricMemoryWarning, match=r"AllGatherMatmul\(1, 2, 3\) was dropped without close\(\).*"
                                                          r"0\.0 MiB.*release_unclosed"):
        del owner
        gc.collect()
    assert not any(r.expired() for r in refs)                   # never freed by the collector
    assert sym.outstanding() == [("AllGatherMatmul(1, 2, 3)", "dropped")]
    assert sym.release_unclosed() == 1
    assert all(r.expired() for r in refs) and sym.outstanding() == []
    assert sym.release_unclosed() == 0


def test_an_owner_in_a_cycle_is_found_by_release_unclosed(ctx):
    owner, (ref,) = _own(ctx)
    owner.me = owner                                            # only the collector would free it
    del owner
    with pytest.warns(sym.SymmetricMemoryWarning):
        assert sym.release_unclosed() == 1                      # collects at its own (collective) point
    assert ref.expired()


def test_a_view_held_past_close_lingers_until_it_is_gone(ctx):
    owner, (ref,) = _own(ctx)
    kept = owner.block0[:4]                                      # e.g. from workspace_tensors()
    owner.lease.forget(owner)
    with pytest.warns(sym.SymmetricMemoryWarning, match="still viewed outside the op after close"):
        owner.lease.release()
    assert not ref.expired() and sym.outstanding() == [("op", "lingering")]
    assert owner.lease.released
    assert sym.release_unclosed() == 0 and not ref.expired()     # the view is still there
    del kept
    gc.collect()
    assert not ref.expired()                                     # its end frees nothing ...
    assert sym.release_unclosed() == 1 and ref.expired()         # ... the next explicit point does


def test_blocks_of_another_allocator_are_freed_by_their_callback_in_order(ctx):
    freed = []
    a, b = Owner(), Owner()
    a.lease, b.lease = sym.Lease(ctx, "a", a), sym.Lease(ctx, "b", b)
    a.lease.hold("heap 1", lambda: freed.append(1), spans=[(0x1000, 0x2000)])
    a.lease.hold("heap 2", lambda: freed.append(2))
    b.lease.hold("heap 3", lambda: freed.append(3))
    a.view = SimpleNamespace()                                   # not a tensor: stays
    a.lease.forget(a)
    a.lease.release()
    assert freed == [1, 2] and a.view is not None
    with pytest.warns(sym.SymmetricMemoryWarning, match="1 block"):
        del b
        gc.collect()
    assert freed == [1, 2]                                       # NVSHMEM's free is collective: not from GC
    assert sym.release_unclosed() == 1 and freed == [1, 2, 3]


def test_an_owner_that_allocated_nothing_leaves_quietly(ctx):
    import warnings
    owner = Owner()
    owner.lease = sym.Lease(ctx, "failed build", owner)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        del owner
        gc.collect()
    assert sym.outstanding() == []


def test_release_unclosed_frees_only_what_every_rank_dropped(ctx, monkeypatch):
    """Collective: the ranks exchange their freeable leases and free the common ones, in the
    same (sequence) order, after synchronising and one barrier."""
    import torch.distributed as dist
    calls = []
    group = SimpleNamespace(group_name="g0")
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda g=None: 2)
    monkeypatch.setattr(dist, "barrier", lambda group=None, device_ids=None: calls.append(("barrier", group)))

    def all_gather_object(out, mine, group=None):
        calls.append(("exchange", list(mine)))
        out[0], out[1] = list(mine), [("g0", 1)]                  # the peer has dropped only lease 1
    monkeypatch.setattr(dist, "all_gather_object", all_gather_object)
    owners = [_own(ctx, f"op{i}") for i in range(3)]
    refs = [r for _, (r,) in owners]
    with pytest.warns(sym.SymmetricMemoryWarning):
        del owners
        gc.collect()
    assert [s for _, s in sym.outstanding()] == ["dropped"] * 3
    assert sym.release_unclosed(group) == 1
    assert calls == [("exchange", [("g0", 0), ("g0", 1), ("g0", 2)]), ("barrier", group)]
    assert [r.expired() for r in refs] == [False, True, False]
    calls.clear()
    monkeypatch.setattr(dist, "all_gather_object", lambda out, mine, group=None: out.__setitem__(slice(None), [[], []]))
    assert sym.release_unclosed(group) == 0 and calls == []           # nothing in common: not even a barrier
