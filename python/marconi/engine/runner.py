"""Model runner: one scheduled batch -> one forward pass -> one sampled token per request.

The runner sees neither the cache nor the scheduler's queues: it gets ``SequenceInput``s (slots
already chosen by the cache manager) and the requests' sampling parameters.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from functools import lru_cache
from typing import TYPE_CHECKING

import torch

from marconi.engine import ONEDNN_CAPACITY_SET_BY_USER
from marconi.layers import small_m, ssm_step
from marconi.layers.linear import packed_primitives
from marconi.models.batch import ForwardBatch, SequenceInput

if TYPE_CHECKING:
    from marconi.engine.request import Req
    from marconi.models.hybrid import HybridForCausalLM
    from marconi.models.memory import HybridMemory

log = logging.getLogger(__name__)


def decode_kernel_wanted() -> bool:
    """Whether decode rows should take the C linear kernel: where OpenMP threads sleep at
    barriers (``OMP_WAIT_POLICY=PASSIVE`` without ``GOMP_SPINCOUNT``), each sgemm call pays
    their wake-ups and the kernel streams the weights faster; where they spin (the engine's
    default, ``marconi.engine``) two-thread sgemm is faster at 1-4 rows (measured, small model:
    35 / 32 / 50 ms decode steps at 1 / 2 / 4 rows vs 37 / 65 / 81 through the kernel;
    ``docs/performance_log.md``). ``MARCONI_SMALL_M_KERNEL=1`` forces the kernel, ``=0`` never."""
    forced = os.environ.get("MARCONI_SMALL_M_KERNEL")
    if forced in ("0", "1"):
        return forced == "1"
    sleeps = os.environ.get("OMP_WAIT_POLICY", "").upper() == "PASSIVE"
    return sleeps and not os.environ.get("GOMP_SPINCOUNT")


def size_onednn_cache(model: torch.nn.Module, max_rows: int) -> int:
    """Make oneDNN's primitive cache hold every primitive the packed `Linear` path can build for
    ``model`` in steps of up to ``max_rows`` rows (``linear.packed_primitives``; ``marconi.engine``
    explains the cost of a smaller cache), and return that count. Raises the capacity set by
    ``import marconi.engine`` (4,096), rounded up to a multiple of 1,024; oneDNN reads it at its
    first primitive, so this counts only before the process's first packed forward pass (the
    server's engine is built before any). A capacity the user set is kept, with a warning when
    it is smaller. Memory grows only with the row counts that actually occur (~60 KB each)."""
    need = packed_primitives(model, max_rows)
    name = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"
    capacity = int(os.environ.get(name, "1024"))
    if need > capacity:
        if ONEDNN_CAPACITY_SET_BY_USER:
            log.warning(
                "%s=%d is below the %d oneDNN primitives that steps of up to %d rows can use: "
                "prefill steps may rebuild them (raise it, or lower --chunked-prefill-size)",
                name, capacity, need, max_rows,
            )  # fmt: skip
        else:
            os.environ[name] = str(-(-need // 1024) * 1024)
    return need


class ModelRunner:
    """Owns the model and its ``HybridMemory`` (the tensors behind the cache's slot ids)."""

    def __init__(self, model: HybridForCausalLM, memory: HybridMemory, seed: int = 0) -> None:
        self.model = model
        self.memory = memory
        self.vocab_size = model.config.vocab_size
        self._seed = seed
        self.cpu = memory.device.type == "cpu"
        #: torch's intra-op threads for steps with many rows (prefill, large decode batches)
        self.max_threads = torch.get_num_threads()
        self._threads = self.max_threads
        #: decode rows (<= small_m.MAX_ROWS) through the C linear kernel on one OpenMP thread
        self.decode_kernel = self.cpu and decode_kernel_wanted()
        small_m.set_enabled(self.decode_kernel)
        if self.cpu:  # build the Mamba-2 kernels now, not inside the first request
            ssm_step.available()
            ssm_step.prefill_kernel()
        if self.decode_kernel and small_m.available():
            # threads of the decode linear kernel (its own helper thread, not OpenMP's)
            small_m.set_threads(int(os.environ.get("MARCONI_SMALL_M_THREADS", self.max_threads)))

    def forward(self, inputs: Sequence[SequenceInput]) -> torch.Tensor:
        """Last-token logits [B, vocab] (fp32) of each input, in order."""
        if self.cpu:
            self._set_threads(sum(len(i.token_ids) for i in inputs))
        return self.model(ForwardBatch(tuple(inputs)), self.memory).logits

    def _set_threads(self, rows: int) -> None:
        """One intra-op thread for a decode step the C kernel takes (``decode_kernel``, <=
        ``small_m.MAX_ROWS`` rows: the kernel brings its own helper thread, so OpenMP threads
        would only add barriers to its small ops), ``max_threads`` otherwise."""
        want = 1 if self.decode_kernel and rows <= small_m.MAX_ROWS else self.max_threads
        if want != self._threads:
            torch.set_num_threads(want)
            self._threads = want

    def sample(self, logits: torch.Tensor, reqs: Sequence[Req]) -> list[int | Exception]:
        """One token per row of ``logits`` under each request's sampling parameters, or the
        exception sampling that row raised (a fault of that request alone: the other rows are
        sampled exactly as without it)."""
        out: list[int | Exception] = []
        greedy = logits.argmax(dim=-1).tolist()
        for row, req, g in zip(logits, reqs, greedy, strict=True):
            try:
                out.append(self._sample_one(row, req, int(g)))
            except Exception as e:
                out.append(e)
        return out

    def _sample_one(self, row: torch.Tensor, req: Req, greedy: int) -> int:
        p = req.params
        if p.greedy and not p.logit_bias:
            return greedy
        if p.logit_bias:
            ids, vals = _bias_tensors(p.logit_bias, row.numel())
            row = row.index_add(0, ids.to(row.device), vals.to(row.device, row.dtype))
        if p.greedy:
            return int(row.argmax())
        return self._sample_row(row / p.temperature, p.top_p, self._generator(req))

    def _generator(self, req: Req) -> torch.Generator:
        if req.generator is None:
            gen = torch.Generator(device="cpu")
            seed = req.params.seed
            if seed is None:
                self._seed += 1
                seed = self._seed
            gen.manual_seed(seed)
            req.generator = gen
        assert isinstance(req.generator, torch.Generator)
        return req.generator

    @staticmethod
    def _sample_row(row: torch.Tensor, top_p: float, gen: torch.Generator) -> int:
        probs = torch.softmax(row.float().cpu(), dim=-1)
        if top_p < 1.0:
            sorted_p, idx = probs.sort(descending=True)
            keep = sorted_p.cumsum(0) - sorted_p < top_p  # always keeps the top token
            probs = torch.zeros_like(probs).scatter_(0, idx[keep], sorted_p[keep])
        return int(torch.multinomial(probs, 1, generator=gen))


@lru_cache(maxsize=1024)
def _bias_tensors(
    logit_bias: tuple[tuple[int, float], ...], vocab: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids, biases) of the in-vocabulary entries, built once per distinct bias table
    (clients resend the same table with every request); repeated ids add up."""
    pairs = [(t, b) for t, b in logit_bias if 0 <= t < vocab]
    ids = torch.tensor([t for t, _ in pairs], dtype=torch.long)
    return ids, torch.tensor([b for _, b in pairs], dtype=torch.float32)
