"""Shared pieces of the benchmarks: a GPT-like training state, page-cache dropping, timing.

The state is what a mixed-precision Adam run checkpoints: for every parameter a bf16 model weight
plus fp32 master weight and two fp32 Adam moments (14 bytes per parameter), for a GPT with
``layers`` transformer blocks (12 tensors each: qkv / proj / fc1 / fc2 weights and biases, two
layer norms' weights and biases), a vocab embedding and a final norm: a few hundred tensors, most
of them small (norms, biases), a few large.
"""

from __future__ import annotations

import contextlib
import math
import os
import socket
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple

import torch

BYTES_PER_PARAM = 2 + 4 + 4 + 4  # bf16 weight, fp32 master, fp32 exp_avg, fp32 exp_avg_sq
STATES = (("model", torch.bfloat16), ("master", torch.float32), ("exp_avg", torch.float32),
          ("exp_avg_sq", torch.float32))


@dataclass(frozen=True)
class ParamSpec:
    """One parameter: global shape, and the axis tensor parallelism splits (None: replicated)."""

    name: str
    shape: Tuple[int, ...]
    tp_axis: Optional[int]


def gpt_params(total_bytes: int, layers: int = 12, multiple: int = 64) -> List[ParamSpec]:
    """Parameters of a GPT whose full training state is about ``total_bytes``.

    hidden size h is solved from ``(12 * layers + 4) * h^2 * 14 bytes ~= total_bytes`` with a vocab of
    4h (kept small so the transformer blocks dominate, as in real models), rounded to ``multiple``.
    Tensor-parallel axes follow Megatron: column-parallel weights/biases split axis 0, row-parallel
    weights axis 1, the vocab embedding axis 0, norms and row-parallel biases replicated.
    """
    params = total_bytes / BYTES_PER_PARAM
    h = max(multiple, int(round(math.sqrt(params / (12 * layers + 4)) / multiple)) * multiple)
    vocab = 4 * h
    specs = [ParamSpec("embedding.word_embeddings.weight", (vocab, h), 0)]
    for i in range(layers):
        p = f"decoder.layers.{i}."
        specs += [
            ParamSpec(p + "input_layernorm.weight", (h,), None),
            ParamSpec(p + "input_layernorm.bias", (h,), None),
            ParamSpec(p + "self_attention.linear_qkv.weight", (3 * h, h), 0),
            ParamSpec(p + "self_attention.linear_qkv.bias", (3 * h,), 0),
            ParamSpec(p + "self_attention.linear_proj.weight", (h, h), 1),
            ParamSpec(p + "self_attention.linear_proj.bias", (h,), None),
            ParamSpec(p + "pre_mlp_layernorm.weight", (h,), None),
            ParamSpec(p + "pre_mlp_layernorm.bias", (h,), None),
            ParamSpec(p + "mlp.linear_fc1.weight", (4 * h, h), 0),
            ParamSpec(p + "mlp.linear_fc1.bias", (4 * h,), 0),
            ParamSpec(p + "mlp.linear_fc2.weight", (h, 4 * h), 1),
            ParamSpec(p + "mlp.linear_fc2.bias", (h,), None),
        ]
    specs += [ParamSpec("decoder.final_layernorm.weight", (h,), None),
              ParamSpec("decoder.final_layernorm.bias", (h,), None)]
    return specs


@dataclass
class LocalTensor:
    """One tensor of a rank's state: its key, local data and place in the global tensor."""

    key: str
    data: torch.Tensor
    global_shape: Tuple[int, ...]
    tp_axis: Optional[int]  # split axis (None: the whole tensor, replicated over ranks)
    replicated: bool  # every rank holds the same data


def local_state(total_bytes: int, rank: int, world: int, layout: str, seed: int = 0,
                layers: int = 12) -> List[LocalTensor]:
    """This rank's tensors. ``layout="tp"``: tensor parallel over ``world`` ranks (norms and
    row-parallel biases replicated); ``layout="dp"``: every rank holds the whole state.
    Values are deterministic (``seed``, key) so loads can be checked on any rank."""
    if layout not in ("tp", "dp"):
        raise ValueError(f"layout must be 'tp' or 'dp', got {layout!r}")
    out = []
    for n, spec in enumerate(gpt_params(total_bytes, layers)):
        for s, (state, dtype) in enumerate(STATES):
            g = torch.Generator().manual_seed(seed * 1_000_003 + n * 7 + s)
            full_numel = math.prod(spec.shape)
            axis = spec.tp_axis if layout == "tp" else None
            if axis is None:
                data = _fill(full_numel, dtype, g).view(spec.shape)
            else:
                # Generate only this rank's slice: values depend on the global index, not the split.
                full = _fill(full_numel, dtype, g).view(spec.shape)
                data = full.chunk(world, dim=axis)[rank].contiguous()
                del full
            out.append(LocalTensor(f"{state}.{spec.name}", data, spec.shape, axis, axis is None))
    return out


def _fill(numel: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    return torch.randn(numel, generator=g, dtype=torch.float32).to(dtype)


def state_bytes(tensors: Iterable[LocalTensor]) -> int:
    return sum(t.data.numel() * t.data.element_size() for t in tensors)


def unique_bytes(total_bytes: int, layers: int = 12) -> int:
    """Bytes of the whole (global) state: what a checkpoint stores once."""
    return sum(math.prod(p.shape) * BYTES_PER_PARAM for p in gpt_params(total_bytes, layers))


# -- files ---------------------------------------------------------------------------------
def files_under(path: str) -> List[str]:
    return [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]


def drop_page_cache(path: str) -> int:
    """Evict every file under ``path`` (or ``path`` itself) from the page cache; returns the
    number of files. Files must be fsync'd (clean pages only can be dropped)."""
    paths = files_under(path) if os.path.isdir(path) else [path]
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)  # no-op for clean files; makes sure nothing is left dirty
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return len(paths)


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(p) for p in files_under(path))


def timed(fn: Callable[[], object]) -> Tuple[float, object]:
    t0 = time.perf_counter()
    res = fn()
    return time.perf_counter() - t0, res


def timed_collective(fn: Callable[[], object]) -> float:
    """Wall seconds of a collective operation on every rank: from a barrier to the slowest rank's end
    (the same number on every rank)."""
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    fn()
    elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed.item())


def fmt_table(headers: List[str], rows: List[List[object]]) -> str:
    """A GitHub-markdown table."""
    cells = [[str(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    return "\n".join([line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(r) for r in cells])


def machine_summary() -> Dict[str, object]:
    import platform

    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {"cpus": os.cpu_count(), "mem_gib": round(mem / 2**30, 1), "python": platform.python_version(),
            "torch": torch.__version__, "platform": platform.platform()}


def run_header(args: Any, started: float, load_before: Tuple[float, ...],
               load_after: Tuple[float, ...]) -> Dict[str, Any]:
    """What a results JSON records about its run: the command, the machine, its load, the arguments."""
    import sys

    return {"command": " ".join([os.path.basename(sys.executable), *sys.argv]), "machine": machine_summary(),
            "loadavg_before": load_before, "loadavg_after": load_after, "args": vars(args),
            "seconds": round(time.time() - started, 1)}


def prefault(nbytes: int) -> None:
    """Touch ``nbytes`` of fresh memory and free it again, right before a timed operation.

    On VMs that hand free guest memory back to the host (virtio free page reporting, as on the
    Firecracker VM these benchmarks were run on), the first touch of a page the guest freed a
    while ago costs a hypervisor fault: writing a new 128 MB file can take 0.3 s instead of
    0.03 s depending on whether the page cache finds recently freed pages. Freeing a touched
    buffer just before each contestant's save or load gives every contestant the same hot free
    memory, so the comparison measures the software and the disk, not the hypervisor.
    """
    if nbytes > 0:
        buf = torch.empty(int(nbytes), dtype=torch.uint8)
        buf.fill_(1)
        del buf


def free_port() -> int:
    """A free TCP port on loopback for a benchmark's process group."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def chunk_checksums_off() -> Iterator[None]:
    """Within the block, saves store chunks without checksums (neither the zarr ``crc32c`` codec
    nor the CRC-32C list in each zarr.json: the arrays are then what format 2 wrote) and loads
    verify none (``LIGHTNING_DISTCKPT_VERIFY=0``): the "checksums off" side of an A/B. Benchmarks only."""
    from lightning_distckpt.storage.checksums import VERIFY_ENV
    from lightning_distckpt.storage.tensorstore_io import TensorStoreIO

    with_crc, ours, verify = TensorStoreIO.create_spec, TensorStoreIO.own_checksums, os.environ.get(VERIFY_ENV)

    def without_crc(self: Any, *args: Any, **kwargs: Any) -> Dict[str, Any]:
        spec = with_crc(self, *args, **kwargs)
        spec["metadata"]["codecs"] = [c for c in spec["metadata"]["codecs"] if c["name"] != "crc32c"]
        return spec

    TensorStoreIO.create_spec = without_crc  # type: ignore[method-assign]
    TensorStoreIO.own_checksums = lambda self, arr, chunk_bytes=None: False  # type: ignore[method-assign]
    os.environ[VERIFY_ENV] = "0"
    try:
        yield
    finally:
        TensorStoreIO.create_spec, TensorStoreIO.own_checksums = with_crc, ours  # type: ignore[method-assign]
        if verify is None:
            os.environ.pop(VERIFY_ENV, None)
        else:
            os.environ[VERIFY_ENV] = verify


@contextlib.contextmanager
def codec_checksums() -> Iterator[None]:
    """Within the block, saves checksum chunks with the zarr ``crc32c`` codec, computed by
    tensorstore, as formats 3-4 did (not in each array's zarr.json). Benchmarks only."""
    from lightning_distckpt.storage.tensorstore_io import TensorStoreIO

    ours = TensorStoreIO.own_checksums
    TensorStoreIO.own_checksums = lambda self, arr, chunk_bytes=None: False  # type: ignore[method-assign]
    try:
        yield
    finally:
        TensorStoreIO.own_checksums = ours  # type: ignore[method-assign]


@contextlib.contextmanager
def moto_s3(bucket: str) -> Iterator[str]:
    """moto's S3 server (``moto[server]``, the one the tests use) on 127.0.0.1 in this process, with
    ``bucket`` made; yields the endpoint URL. The AWS environment points at it for the block (seen by
    processes started inside it) and is restored after; the server stops with the block."""
    import logging

    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()  # returns once the socket listens
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    env = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
           "AWS_REGION": "us-east-1"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)
        yield endpoint
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
