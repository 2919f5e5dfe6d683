"""A hand-off between a CUDA stream and one thread of ours that needs no GIL: two POSIX barriers of two, met by
libc's own `pthread_barrier_wait`, enqueued on the stream as host functions.

    handoff = Handoff()
    handoff.enqueue(stream)    # on the stream: meet `start`, then meet `finish` (the stream waits there)
    # the thread of ours, in a loop:  handoff.start(); ...work...; handoff.finish()
    # or from Python, in place of a stream:  handoff.start(); handoff.finish()

A host function (`cuLaunchHostFunc`; a host node when the stream is being
captured in a CUDA graph) runs on a thread of the CUDA driver's once the work
before it on the stream is done, and the stream goes on when it returns. Here
the two host functions are `pthread_barrier_wait` itself, with a barrier as
its argument (its signature is a host function's: one pointer). The first
releases our thread, the second holds the stream until our thread has done
its work. A host function written in Python would take the GIL in the driver's
thread, and wait for whatever Python thread holds it (the one launching the
work, say): these take nothing. A barrier rather than a semaphore: a signal
delivered to the waiting thread does not end a barrier's wait (`sem_wait`
returns early, with EINTR), and a wait that ended early would let the stream
read the work's output before it is written.

`serve` is the loop of that thread of ours, and `stop` ends it: the loop holds
its target (the engine) weakly, so that an engine dropped without `close` is
collected, its finalizer stopping the loop.

Limits: Linux (glibc's `pthread_barrier_*`). The driver runs a context's host
functions on one thread, so while the stream waits at `finish`, host functions
of other streams wait too (the runtime enqueues none). Our thread must keep
meeting the barriers as long as a stream or a captured graph may enqueue them:
a replay with no thread to meet it stalls its stream for good (`close` says
when that is safe).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import threading

STOP = -2  # the call slot's value that stops `serve`
_SERIAL = -1  # PTHREAD_BARRIER_SERIAL_THREAD in glibc: what one of the two meeting threads gets back
_BARRIER_BYTES = 128  # sizeof(pthread_barrier_t) is 32 on x86-64 and aarch64 glibc; room to spare


class Handoff:
    """Two barriers of two (`start`, `finish`) and the ways to meet them (module doc)."""

    def __init__(self):
        self._libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        self._memory = ctypes.create_string_buffer(2 * _BARRIER_BYTES)  # malloc'd: aligned for the barriers
        base = ctypes.addressof(self._memory)
        self._barriers = (ctypes.c_void_p(base), ctypes.c_void_p(base + _BARRIER_BYTES))
        wait = self._libc.pthread_barrier_wait
        wait.argtypes, wait.restype = [ctypes.c_void_p], ctypes.c_int
        self._wait = wait
        for barrier in self._barriers:
            if self._libc.pthread_barrier_init(barrier, None, ctypes.c_uint(2)) != 0:
                raise OSError(ctypes.get_errno(), "offplan: pthread_barrier_init failed")

    def start(self) -> None:
        """Meet `start` (ctypes releases the GIL while this thread waits)."""
        self._meet(0)

    def finish(self) -> None:
        """Meet `finish`."""
        self._meet(1)

    def enqueue(self, stream: int) -> None:
        """On CUDA stream `stream` (its handle), meet `start` and then `finish`, as host functions."""
        function = ctypes.cast(self._wait, ctypes.c_void_p).value
        for barrier in self._barriers:
            launch_host_func(stream, function, barrier.value)

    def _meet(self, which: int) -> None:
        status = self._wait(self._barriers[which])
        if status not in (0, _SERIAL):
            raise OSError(status, "offplan: pthread_barrier_wait failed")

    def close(self) -> None:
        """Destroy the barriers: call only once nothing can meet them again."""
        for barrier in self._barriers:
            self._libc.pthread_barrier_destroy(barrier)
        self._barriers = ()


def launch_host_func(stream: int, function: int, argument: int) -> None:
    """Enqueue `function(argument)` (addresses: a C function of one pointer, and that pointer) on CUDA stream
    `stream` as a host function (a host node where the stream is being captured)."""
    global _driver
    if _driver is None:
        driver = ctypes.CDLL("libcuda.so.1")
        driver.cuLaunchHostFunc.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        driver.cuLaunchHostFunc.restype = ctypes.c_int
        _driver = driver
    status = _driver.cuLaunchHostFunc(ctypes.c_void_p(stream), ctypes.c_void_p(function), ctypes.c_void_p(argument))
    if status != 0:
        raise RuntimeError(f"offplan: cuLaunchHostFunc failed (CUresult {status})")


_driver = None  # libcuda, loaded at the first host function


def serve(target_ref, handoff: Handoff, call_slot) -> None:
    """A worker thread's loop: each time `start` is met, `target.work(call)` for the call in `call_slot` (a
    one-element tensor that the stream or the caller wrote), then `finish`, which it must meet whatever happens
    (a captured graph's stream waits there); it returns at `STOP`. It holds its target only while it works
    (`target_ref`: a weak reference), so that a target dropped without being closed is collected, and stopped
    (`stop`, from its finalizer)."""
    while True:
        handoff.start()
        target = target_ref()
        call = int(call_slot[0])
        if target is None or call == STOP:
            return
        try:
            target.work(call)
        finally:
            del target
            handoff.finish()


def stop(worker: threading.Thread, handoff: Handoff, call_slot) -> None:
    """Stop `serve`'s thread: the call slot says so, `start` is met for it; then the barriers go."""
    if worker is threading.current_thread():
        return  # the target collected in its own worker, which finds it gone at its next call
    if worker.is_alive():
        call_slot[0] = STOP
        handoff.start()
        worker.join()
    handoff.close()
