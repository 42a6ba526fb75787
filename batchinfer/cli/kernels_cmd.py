"""`batchinfer build-kernels`: build the native CPU kernels now (at install), not at the first `run`.

`make setup` and the Docker image run it, so a first job does not wait on the compiler; it prints where
the build lives and whether it was compiled now or found in the cache (engine/native/build.py).
"""

from __future__ import annotations

import click

from batchinfer.cli.output import emit, fail, json_option


@click.command("build-kernels")
@json_option("Print the result as one JSON object.")
def build_kernels(as_json: bool) -> None:
    """Build the native CPU kernels into this installation's cache (a no-op when already built)."""
    import os

    from batchinfer.engine.layers import cpu_attention

    if os.environ.get("BATCHINFER_CPU_ATTENTION") == "sdpa":
        fail("BATCHINFER_CPU_ATTENTION=sdpa turns the native kernels off; unset it to build them")
    if cpu_attention.load() is None or cpu_attention.build_info is None:
        fail("the native CPU kernels could not be built (see the warning above; a C++ compiler and ninja are "
             "needed); batchinfer still runs, on its slower torch path")
    info = cpu_attention.build_info
    how = f"built in {info.seconds:.0f} s" if info.built else "already built"
    emit({"directory": info.directory, "built": info.built, "seconds": round(info.seconds, 1)},
         f"native CPU kernels: {how} ({info.directory})")
