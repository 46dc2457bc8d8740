"""CUDA graphs of the static decode forward (``runtime/static_step.py``), one per batch size and mode.

vLLM and nano-vllm capture the decode forward per batch size at a fixed table capacity and replay it: one
``cudaGraphLaunch`` in place of every kernel launch of the step (GPU run 6 counted 224 Triton launches
a step at LLaVA-1.5-7B's shape, 13-21 ms of launcher time under cProfile). :class:`DecodeGraphs` does
that for :func:`~vlkv.runtime.static_step.forward`, whose inputs sit in a
:class:`~vlkv.runtime.static_step.StaticBuffers` per batch size: the first step at a batch size (or
at a wider read table) warms the forward up on a side stream (Triton compiles, the layers' scratch
buffers are allocated), captures it into a graph whose memory comes from one pool shared by every
size, and replays it; later steps copy their inputs into the same buffers and replay.

The warm-up and the replay both run the step's forward: its writes (the new K/V rows, the tables' new
column, the read table) are the same values at the same places, so running it twice changes nothing.

A statistics step's forward also writes its probabilities into the buffers (``StaticBuffers.probs``):
its graph is another one (key: batch size, statistics mode and reads: holes, a selection, linked entries),
and those rows stay in the buffers,
read by the host half before the next step.

Opt-in (``Engine(decode_graph=True)``, ``vlkv generate --cuda-graph``, ``vlkv serve --cuda-graph``): off
by default until a GPU run has compared it with the eager step (``scripts/gpu_parts.py``'s ``compile`` part,
``tests/runtime/test_cuda_graph.py``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


def cli_refusal(device, backend: str, fixed_pool: bool | None = None) -> str | None:
    """Why ``--cuda-graph`` cannot run with a command's settings, one line naming the flags (None: it
    can): a CUDA device, the torch backend and a fixed pool (``fixed_pool`` None: the command's pool
    always is, as ``vlkv serve``'s). Host checks only, made before the model loads."""
    needs = ["--device cuda", "--backend torch"] + (
        [] if fixed_pool is None else ["a fixed pool (--pool-bytes)"]
    )
    if torch.device(device).type == "cuda" and backend == "torch" and fixed_pool is not False:
        return None
    return f"--cuda-graph needs {', '.join(needs[:-1])} and {needs[-1]}"


def check_device(device) -> None:
    """Raise ``ValueError`` (one line) unless ``device`` is a CUDA device: a CUDA graph needs one."""
    dev = torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"a CUDA-graph decode step needs a CUDA device; this model is on {dev.type!r}")
    if not torch.cuda.is_available():
        raise ValueError("a CUDA-graph decode step needs CUDA, which this PyTorch cannot reach")


class DecodeGraphs:
    """Per batch size a captured graph of the static forward and the buffers it was captured against.

    Attributes:
        captures: graphs captured so far (a batch size's first step, or its read table widened).
        replays: steps replayed.
    """

    def __init__(self, device):
        check_device(device)
        self.device = torch.device(device)
        self.pool = torch.cuda.graph_pool_handle()  # one memory pool for every batch size's graph
        # key (the static step's: batch size, statistics mode, reads) → (buffers captured against, pool
        # addresses, graph, its outputs, tensors it must keep alive)
        self._graphs: dict = {}
        self.captures = self.replays = 0

    def run(
        self, bufs, forward: Callable[[], tuple[Tensor, Tensor]], pools: tuple = (), key=None
    ) -> tuple[Tensor, Tensor]:
        """``forward()``'s outputs for this step, by replay; captured first where ``bufs`` (filled for
        this step) is not the buffers its ``key`` (default: the batch size; the static step's is the
        batch size, statistics mode and holes) was captured against, or ``pools`` (the K/V pool tensors it
        writes and reads, compared by address: another scheduler's pool) are not the ones. The outputs
        are copies: the next replay rewrites the graph's own (a statistics step's probabilities stay
        in ``bufs.probs``, read before the next step)."""
        key = bufs.batch if key is None else key
        where = tuple(t.data_ptr() for t in pools)
        got = self._graphs.get(key)
        if got is None or got[0] is not bufs or got[1] != where:
            self._graphs.pop(key, None)  # a narrower table's graph: its memory back to the pool
            got = self._graphs[key] = (bufs, where, *self._capture(forward))
            self.captures += 1
        got[2].replay()
        self.replays += 1
        return tuple(t.clone() for t in got[3])

    def clear(self) -> None:
        """Drop every captured graph (with the buffers and pool tensors it holds); the counters stay."""
        self._graphs.clear()

    @property
    def held(self) -> int:
        """The graphs held (not ``__len__``: an empty instance must stay truthy)."""
        return len(self._graphs)

    def _capture(self, forward) -> tuple:
        from vlkv.plugins import triton_paged_attention
        from vlkv.runtime.models import device_layer

        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):  # Triton compiles, scratch buffers allocated: outside the graph
            forward()
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread-local: another thread's CUDA work (a server's encoder threads) does not break the capture;
        # a host sync in this thread's forward still does
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            outputs = forward()
        # the layers' and the paged read's reused scratch buffers the graph writes: held here, so a
        # cache cleared later cannot hand their memory to another tensor while the graph still writes it
        keep = (dict(device_layer._WORK), dict(triton_paged_attention._PARTIALS))
        return graph, outputs, keep
