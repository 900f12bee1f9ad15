"""Helpers for the 2-process tests: a free rendezvous port, and the start and clean end of a spawned gloo worker."""

import os
import socket
import sys

import torch
import torch.distributed as dist


def free_port() -> int:
    """A free TCP port on the loopback interface, for a rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_gloo(rank: int, world: int, port: int) -> None:
    """Join the gloo process group of ``world`` processes on the loopback rendezvous ``port``, one CPU thread."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)


def end_worker() -> None:
    """Destroy the process group and leave the worker process without interpreter finalization.

    A finished gloo collective is released on gloo's own worker thread, and when it holds the last reference to a
    tensor that Python no longer references, releasing it takes the GIL. If the main thread has meanwhile returned
    and Python is finalizing, that thread is ended inside a destructor and the process aborts with "terminate called
    without an active exception" (a core dump of it: ``ProcessGroupGloo::runLoop`` ->
    ``~AsyncAllgatherCoalescedWork`` -> ``TensorImpl::decref_pyobject`` -> ``take_gil`` -> ``pthread_exit``; about
    one run in twenty of the FSDP2 optimizer test; torch's proposed fix, pytorch/pytorch#179291, was abandoned).
    Everything a worker reports is written before this is called, so skipping finalization loses nothing.
    """
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
