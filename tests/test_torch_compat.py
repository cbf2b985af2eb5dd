"""Pins every torch name neps_bcast uses beyond the public ``torch.distributed`` API.

If one of these fails after a torch upgrade, ``src/neps_bcast/compat/torch.py`` is the
one module to adapt. (The texts of gloo's peer-closed errors are pinned on a real
two-process group in ``test_channel.py``.)
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from neps_bcast.compat import torch as tc


def test_store_classes_come_from_the_c_module() -> None:
    store = tc.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    assert isinstance(store, tc.Store)
    prefixed = tc.PrefixStore("p", store)
    tc.set_bytes(prefixed, "k", b"\x00\xffbytes")
    assert store.get("p/k") == b"\x00\xffbytes"


def test_a_raw_gloo_group_is_not_registered_with_c10d() -> None:
    store = tc.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    pg = tc.new_gloo_group(store, 0, 1, datetime.timedelta(seconds=10))
    assert not dist.is_initialized()
    data = torch.arange(4, dtype=torch.uint8)
    outs = [torch.zeros(4, dtype=torch.uint8)]
    tc.gloo_allgather(pg, outs, data)
    assert outs[0].tolist() == [0, 1, 2, 3]
    tc.close_gloo_group(pg)


def test_the_nccl_abort_function_exists() -> None:
    assert callable(dist.distributed_c10d._abort_process_group)


def test_peer_closed_texts_are_recognized_and_others_are_not() -> None:
    for marker in tc.PEER_CLOSED_MARKERS:
        assert tc.is_peer_closed(RuntimeError(f"[pair.cc:553] {marker} [127.0.0.1]:1"))
    assert not tc.is_peer_closed(ValueError("injected failure"))


def test_a_group_that_is_gone_is_a_peers_doing_only_after_neps_bcast_released_it() -> None:
    # The user's own code using a group it never formed is the user's error (primary);
    # after neps_bcast released this rank's group for a peer's failure, it is secondary.
    for marker in tc.GROUP_GONE_MARKERS:
        error = ValueError(f"Default process group has {marker}")
        assert not tc.is_peer_closed(error)
        assert tc.is_peer_closed(error, group_released=True)


def test_a_failed_init_leaves_the_group_counter_up_and_reset_puts_it_back() -> None:
    """c10d names the default group by a counter that only destroy_process_group() resets:
    after a failed init there is nothing to destroy, and the next group would take
    another name (another store prefix) than its peers'."""
    from torch.distributed import distributed_c10d as c10d

    tc.reset_group_names()
    assert c10d._world.group_count == 0
    try:
        dist.init_process_group(
            "gloo",
            store=dist.HashStore(),
            rank=0,
            world_size=2,  # rank 1 never comes: the rendezvous fails
            timeout=datetime.timedelta(seconds=0.5),
        )
    except (RuntimeError, dist.DistError):
        pass
    assert not dist.is_initialized()
    assert c10d._world.group_count == 1  # the failed init took name "0"
    tc.reset_group_names()
    assert c10d._world.group_count == 0
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert c10d._world.group_count == 1
    finally:
        dist.destroy_process_group()
    assert c10d._world.group_count == 0  # what reset_group_names does
