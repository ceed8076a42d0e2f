"""Triton device helpers for kernels whose programs hand work to one another inside a launch, or across launches.

``last_arrival(cnt_ptr, n)``: the "last block done" pattern.  Each of n programs calls it once after
storing its share of some data; exactly one of them (the last to arrive) gets True and may then read
every other program's stores.  Nothing waits, so it needs neither co-resident programs nor a GPU (under
``TRITON_INTERPRET=1`` programs run one after another and the last one in order is the last arrival).

Ordering: a CTA barrier (every thread's stores precede the arrival), then one acquire-release atomic add
at GPU scope on the shared int32 counter, then a CTA barrier (the acquire precedes every thread's later
loads).  Release/acquire is cumulative over the barrier, so the last program observes all the stores
that the others made before they arrived.  The counter must be 0 when the launch starts; the last
arrival sets it back to 0, so one counter serves every launch (and every replay of a CUDA graph) as
long as launches using it do not overlap.

``pdl_enter(PDL)``: programmatic dependent launch (Hopper+; ``dispatch.pdl_launch`` decides and gives the launch
keywords; every Triton kernel of dsv4 takes it, the Gluon ones ``_gluon_sync.pdl_enter_gl``).  A kernel launched
with ``launch_pdl`` may start while the kernel before it on the stream is still running; its programs call
``pdl_enter`` first, which waits until that kernel has completed (its writes visible) and then lets the next kernel
launch.  Waiting before letting the next one launch keeps the chain transitive: when a kernel's programs get past
``pdl_enter``, every kernel launched before it has completed.  What is saved is the launch gap between dependent
kernels (the next grid is resident and waiting when the previous one ends).  A kernel may do work before
``pdl_enter`` when that work only reads what was written before the previous kernel started and touches nothing the
previous kernel reads or writes (when its programs start, every kernel before the previous one has completed): the
state writes of a prefill load their rows before it and store after it, and an emit that follows them
(``PDL_LATE``, ``pdl_start`` / ``pdl_end``) runs whole before it, beside the state write.  Every program reaches
``pdl_enter`` before it exits.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

__all__ = ["last_arrival", "pdl_end", "pdl_enter", "pdl_start"]


@triton.jit
def last_arrival(cnt_ptr, n):
    """True in exactly one of the n programs that call this on the int32 counter ``cnt_ptr`` (0 on entry):
    the last to arrive, which then sees every other caller's earlier stores and resets the counter to 0."""
    tl.debug_barrier()  # every thread's stores precede the release
    old = tl.atomic_add(cnt_ptr, 1, sem="acq_rel")
    last = old == n - 1
    if last:
        tl.store(cnt_ptr, 0)
    tl.debug_barrier()  # the acquire precedes every thread's loads
    return last


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """At a kernel's start: with ``PDL``, wait for the previous kernel on the stream, then release the next one
    (module docstring); without, nothing (the interpreter has no such instructions)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def pdl_start(PDL: tl.constexpr, LATE: tl.constexpr):
    """``pdl_enter`` at a kernel's start, unless ``LATE`` (then ``pdl_end`` calls it)."""
    if not LATE:
        pdl_enter(PDL)


@triton.jit
def pdl_end(PDL: tl.constexpr, LATE: tl.constexpr):
    """``pdl_enter`` at a kernel's end (and before any early return) when ``LATE``: the kernel ran whole beside the
    previous one (module docstring)."""
    if LATE:
        pdl_enter(PDL)
