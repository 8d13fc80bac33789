"""Mutation testing for the kernels: a kernel's source with edits made, in memory, for the
tests that show a check catches a broken kernel; the files are not touched."""

from __future__ import annotations

from metal_kernels import build


def mutating(monkeypatch, stem: str, *edits: tuple[str, str], readers=(build,)) -> None:
    """The kernel `stem` (its body, and its header where the edit is there) with each (old, new)
    edit made, in the source each module of `readers` reads (build: MLX and the Metal harness;
    cuda_source and cuda_emulator: the CUDA emulator); build's kernel cache is cleared."""
    original = build.source

    def mutated(spec, backend):
        header, body = original(spec, backend)
        if spec.stem == stem:
            for old, new in edits:
                assert old in body or old in header, old
                body, header = body.replace(old, new), header.replace(old, new)
        return header, body

    for module in readers:
        monkeypatch.setattr(module, "source", mutated)
    build.kernel.cache_clear()
