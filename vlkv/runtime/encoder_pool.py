"""Encoder pool: the HF processor call (tokenizing, image preprocessing) in worker processes.

The processor's Python, PIL and numpy work holds the GIL. In a thread of the engine's process it
convoys with the engine thread, which releases the GIL on every torch op (thousands per decode
step), so a running stream's inter-token gaps grow while a large prompt is encoded. In a worker
process only the pickling of the call and of its result (a few memory copies) touches the engine
process's GIL; the thread that waits for the result releases it.

``pool.process(**kwargs)`` stands in for ``processor(**kwargs)`` (see
:func:`vlkv.runtime.prompt.encode_prompt`): the processor is pickled once into each worker by the
initializer; the result comes back as a plain dict of tensors. A worker that dies (killed, out of
memory) or an encode that outlasts ``timeout_s`` raises :class:`EncoderUnavailable` for the calls in
flight and the pool is rebuilt for the next call, so nothing waits forever.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import logging
import multiprocessing
import os
import pickle
import threading
from concurrent.futures.process import BrokenProcessPool

import torch

log = logging.getLogger("vlkv.encoder_pool")

WARM_KWARGS = {"text": ["warm up"], "return_tensors": "pt"}  # one tiny call imports everything
START_TIMEOUT_S = 300.0  # a spawned worker imports torch and transformers before its first call


class EncoderUnavailable(RuntimeError):
    """The encoder process died or did not answer in time (the request may be retried)."""


# ---------------------------------------------------------------- worker side
_processor = None  # this worker's processor, set once by _init


NICENESS = 10


def _init(blob: bytes) -> None:
    global _processor
    # One thread each: the engine process keeps the other cores; the work here is PIL / numpy.
    torch.set_num_threads(1)
    # Below the engine in the OS scheduler: where cores are short, decode steps go first and the
    # encode takes what is left (a running stream's gaps, not a new prompt's latency, are the promise).
    with contextlib.suppress(AttributeError, OSError):  # not on this platform: normal priority
        os.nice(NICENESS)
    _processor = pickle.loads(blob)


def _run(kwargs: dict) -> dict:
    return {k: _to_wire(v) for k, v in dict(_processor(**kwargs)).items()}


# Tensors travel as (dtype, shape, uint8 numpy bytes): plain pickle, any dtype (bfloat16 too), no
# shared-memory file descriptors that would tie the result to the worker's lifetime.
class _Wire(tuple):
    pass


def _to_wire(value):
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        return _Wire(
            (str(t.dtype).removeprefix("torch."), tuple(t.shape), t.reshape(-1).view(torch.uint8).numpy())
        )
    return value


def _from_wire(value):
    if isinstance(value, _Wire):
        dtype, shape, data = value
        return torch.from_numpy(data).view(getattr(torch, dtype)).reshape(shape)
    return value


# ---------------------------------------------------------------- engine side
class EncoderPool:
    """``workers`` processes that each hold a copy of ``processor``.

    Args:
        processor: the model's HF processor (picklable).
        workers: worker processes (>= 1).
        timeout_s: the longest one call may take before its workers are killed (> 0), once they are up:
            a call to workers that have not answered yet (a new pool, or one restarted after a crash or a
            hang) may take ``START_TIMEOUT_S`` (their imports), so a slow start is not taken for a hang.
        context: ``spawn`` or ``forkserver`` (never ``fork``: the engine process holds threads).
    """

    def __init__(self, processor, workers: int = 1, timeout_s: float = 120.0, context: str = "spawn"):
        if not isinstance(workers, int) or workers < 1:
            raise ValueError(f"workers must be an integer >= 1, got {workers!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        if context not in ("spawn", "forkserver"):
            raise ValueError(f"context must be spawn or forkserver, got {context!r}")
        self.workers, self.timeout_s = workers, float(timeout_s)
        self._blob = pickle.dumps(processor)
        self._ctx = multiprocessing.get_context(context)
        self._lock = threading.Lock()
        self._executor: cf.ProcessPoolExecutor | None = self._new_executor()
        self._answered: cf.ProcessPoolExecutor | None = None  # the executor whose workers have answered
        self.rebuilds = 0

    def _new_executor(self) -> cf.ProcessPoolExecutor:
        return cf.ProcessPoolExecutor(
            self.workers, mp_context=self._ctx, initializer=_init, initargs=(self._blob,)
        )

    def warm(self) -> None:
        """Start the workers and run one tiny call (imports, tokenizer load) before the first request."""
        self._call(WARM_KWARGS, max(self.timeout_s, START_TIMEOUT_S))

    def process(self, **kwargs) -> dict:
        """``processor(**kwargs)`` in a worker: a dict of CPU tensors (and any plain values).

        Raises what the processor raises (a refused prompt), or :class:`EncoderUnavailable` when a
        worker died or the call outlasted ``timeout_s`` (the pool is rebuilt for the next call).
        """
        return self._call(kwargs, self.timeout_s)

    def _call(self, kwargs: dict, timeout_s: float) -> dict:
        with self._lock:
            executor = self._executor
            if executor is None:
                raise EncoderUnavailable("the encoder pool is shut down")
            try:
                future = executor.submit(_run, kwargs)
            except BrokenProcessPool:
                future = None
        if future is None:
            self._rebuild(executor)
            raise EncoderUnavailable("the encoder process died; the pool was restarted, retry")
        if executor is not self._answered:  # its workers may still be importing
            timeout_s = max(timeout_s, START_TIMEOUT_S)
        try:
            out = future.result(timeout=timeout_s)
        except BrokenProcessPool:
            self._rebuild(executor)
            raise EncoderUnavailable("the encoder process died; the pool was restarted, retry") from None
        except cf.CancelledError:
            raise EncoderUnavailable("the encoder pool was shut down") from None
        except cf.TimeoutError:
            self._rebuild(executor, kill=True)
            raise EncoderUnavailable(
                f"encoding took over {timeout_s:g} s; the encoder was restarted"
            ) from None
        self._answered = executor
        return {k: _from_wire(v) for k, v in out.items()}

    def _rebuild(self, broken: cf.ProcessPoolExecutor, kill: bool = False) -> None:
        with self._lock:
            if self._executor is not broken:  # another caller rebuilt it already (or it was shut down)
                return
            log.warning("encoder pool: a worker died or hung; starting a new pool")
            _stop(broken, kill)
            self._executor = self._new_executor()
            self._executor.submit(_run, WARM_KWARGS)  # start the new worker now, not on the next request
            self.rebuilds += 1

    def pids(self) -> list[int]:
        """The live worker processes' ids (for tests and diagnostics)."""
        executor = self._executor
        procs = getattr(executor, "_processes", None) or {}
        return [p.pid for p in list(procs.values()) if p.is_alive()]

    def shutdown(self) -> None:
        """Stop the workers (calls in flight raise :class:`EncoderUnavailable`)."""
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            _stop(executor, kill=False)

    def __enter__(self) -> EncoderPool:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _stop(executor: cf.ProcessPoolExecutor, kill: bool) -> None:
    if kill:  # a hung worker never returns: end it so shutdown does not wait on it
        for p in list((getattr(executor, "_processes", None) or {}).values()):
            p.kill()
    executor.shutdown(wait=False, cancel_futures=True)
