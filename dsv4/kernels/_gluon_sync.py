"""Gluon twin of ``_triton_sync.pdl_enter`` for the warp-specialised Gluon kernels (programmatic dependent launch,
``dispatch.pdl_launch``): at the kernel's start the default warps wait for the previous kernel on the stream, then
release the next; the worker partitions start only when the default warps reach ``warp_specialize``, after it.
Gluon has no griddepcontrol op of its own here, so the two PTX instructions are inline assembly, as Triton's
``gdc_wait`` / ``gdc_launch_dependents`` are."""

from __future__ import annotations

try:  # Gluon (triton >= 3.5); absent -> the Gluon kernels are never launched
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    HAVE_GLUON = True
except ImportError:  # pragma: no cover - depends on the installed triton
    HAVE_GLUON = False

__all__ = ["HAVE_GLUON"] + (["pdl_enter_gl"] if HAVE_GLUON else [])

if HAVE_GLUON:

    @gluon.jit
    def pdl_enter_gl(PDL: gl.constexpr):
        """With ``PDL``: griddepcontrol.wait, then griddepcontrol.launch_dependents; without: nothing."""
        if PDL:
            gl.inline_asm_elementwise(
                "griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1
            )
            gl.inline_asm_elementwise(
                "griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1
            )
