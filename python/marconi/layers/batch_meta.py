"""Index tensors describing one packed forward batch, built once and shared by every layer."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from itertools import accumulate
from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:
    from marconi.models.batch import SequenceInput


class SegmentPlan(NamedTuple):
    """Each request's new tokens cut into scan segments of at most `chunk_size` tokens.

    Cuts fall at absolute positions that are multiples of `chunk_size` (so a resumed prefill
    reproduces the one-pass segmentation) and at every capture position, so the state at a
    capture is the exact state at a segment end: no second pass. Only real segments are laid
    out (Q of them, request-major): a short request next to a long one is not padded to the
    long one's segment count.
    """

    #: [Q, Lc] packed token index of every segment, pad = T (a zero row); Lc = the longest one
    index: torch.Tensor
    #: recurrence step k: (the requests that have a k-th segment, the rows of `index` holding
    #: those segments); slices when that is every request (always for one request)
    steps: tuple[tuple[slice | torch.Tensor, slice | torch.Tensor], ...]
    capture_at: dict[int, tuple[torch.Tensor, torch.Tensor]]  # step -> (req idx, slot)
    initial_captures: tuple[torch.Tensor, torch.Tensor] | None  # captures at offset 0
    #: [T] flat position of each packed token inside the padded [Q * Lc] layout
    inverse: torch.Tensor
    #: the padded layout is the packed tokens in order plus zero rows at the end (one request,
    #: full segments except the last): segments are then a view, no gather
    dense: bool


class ConvRows(NamedTuple):
    """Where each request's rows sit in the packed conv input of a prefill (`causal_conv1d` over
    one sequence): request r's K-1 state rows, then its new tokens, then request r + 1's block.
    Every output row of a new token sees only its own request's rows."""

    head: torch.Tensor  # [B * (K-1)] rows of the incoming conv states
    tokens: torch.Tensor  # [T] rows of the packed new tokens
    outputs: torch.Tensor  # [T] rows of their conv outputs (``tokens`` - (K-1))
    ends: torch.Tensor  # [B, K-1] rows of each request's conv state after its new tokens
    captures: torch.Tensor  # [C, K-1] rows of each capture's conv state


class BatchPart(NamedTuple):
    """Rows ``rows`` of the packed batch, described by their own ``meta`` (see BatchMeta.parts)."""

    rows: slice
    meta: BatchMeta


@dataclass(frozen=True)
class BatchMeta:
    """Packed layout of a batch: T new tokens over B requests, with cached prefixes and captures.

    Request b has `prefix_lens[b]` cached tokens and `new_lens[b]` new ones; its new tokens are
    packed contiguously in request order. Capture c asks for the state after the first
    `prefix_lens[cap_req[c]] + cap_off[c]` tokens of its sequence, written to state slot
    `cap_slot[c]`.
    """

    tokens: torch.Tensor  # [T]
    positions: torch.Tensor  # [T] absolute positions
    tok_req: torch.Tensor  # [T] request of each token
    tok_off: torch.Tensor  # [T] offset of each token among its request's new tokens
    new_lens: tuple[int, ...]
    prefix_lens: tuple[int, ...]
    new_kv_slots: torch.Tensor  # [T]
    kv_index: torch.Tensor  # [B, Lk_max] slots of prefix + new tokens (padded with slot 0)
    state_slots: torch.Tensor  # [B]
    fresh: torch.Tensor  # [B] bool: no cached prefix, start from a zero state
    cap_req: torch.Tensor  # [C]
    cap_off: torch.Tensor  # [C] offsets 0..new_len
    cap_slot: torch.Tensor  # [C]
    last_index: torch.Tensor  # [B] packed index of each request's last token
    #: (first, end) when the batch is one request whose kv slots are first, first + 1, ... end - 1:
    #: attention then reads the KV pool through a slice instead of a gather
    kv_range: tuple[int, int] | None = None
    #: (decodes, the rest) when the batch starts with pure decodes and goes on with prefill
    #: chunks: the mixers run each part on its own path, so a decode is not padded to a chunk
    split: tuple[BatchPart, BatchPart] | None = None
    _plans: dict[int, SegmentPlan] = field(default_factory=dict, repr=False, compare=False)
    _conv_rows: dict[int, ConvRows] = field(default_factory=dict, repr=False, compare=False)

    @property
    def parts(self) -> tuple[BatchPart, ...]:
        """The sub-batches a mixer runs separately: ``split``, or the whole batch as one part.
        Per-token layers (norms, linears, MLPs) still run over every row at once."""
        return self.split or (BatchPart(slice(None), self),)

    def per_part(self, fn: Callable[[slice, BatchMeta], torch.Tensor]) -> torch.Tensor:
        """``fn(rows, part_meta)`` for every part, concatenated along rows in batch order."""
        outs = [fn(p.rows, p.meta) for p in self.parts]
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    @property
    def num_reqs(self) -> int:
        return len(self.new_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.numel())

    @property
    def max_new(self) -> int:
        return max(self.new_lens)

    @cached_property
    def is_decode(self) -> bool:
        """Every request feeds exactly one token and none starts fresh (pure decode step)."""
        return self.max_new == 1 and not self.any_fresh and self.cap_req.numel() == 0

    @cached_property
    def any_fresh(self) -> bool:
        """Some request has no cached prefix (host-side, no device sync)."""
        return 0 in self.prefix_lens

    @cached_property
    def fresh_all(self) -> bool:
        """No request has a cached prefix: every initial state is zero."""
        return not any(self.prefix_lens)

    @cached_property
    def single_state_slot(self) -> int | None:
        """The working state slot when the batch holds exactly one request, else None."""
        return int(self.state_slots[0]) if self.num_reqs == 1 else None

    @cached_property
    def row_starts(self) -> torch.Tensor:
        """[B + 1] packed row where each request's new tokens start, then T."""
        return torch.tensor([0, *accumulate(self.new_lens)], device=self.tokens.device)

    @cached_property
    def kv_lens(self) -> tuple[int, ...]:
        return tuple(p + n for p, n in zip(self.prefix_lens, self.new_lens, strict=True))

    @cached_property
    def kv_len_tensor(self) -> torch.Tensor:
        """``kv_lens`` as a host int64 tensor [B] (built once per batch, read by kernels)."""
        return torch.tensor(self.kv_lens, dtype=torch.int64)

    @cached_property
    def attn_mask(self) -> torch.Tensor | None:
        """Bool [B, 1, Lq_max, Lk_max] (True = attend), or None when plain causal suffices."""
        b = self.num_reqs
        if b == 1 and self.prefix_lens[0] == 0:
            return None
        if self.max_new == 1 and len(set(self.kv_lens)) == 1:
            return None
        dev = self.tokens.device
        lq, lk = self.max_new, self.kv_index.shape[1]
        i = torch.arange(lq, device=dev).view(1, lq, 1)
        j = torch.arange(lk, device=dev).view(1, 1, lk)
        pre = torch.tensor(self.prefix_lens, device=dev).view(b, 1, 1)
        new = torch.tensor(self.new_lens, device=dev).view(b, 1, 1)
        mask = (j <= pre + i) & (i < new)
        mask = mask | ((i >= new) & (j == 0))  # padded query rows: any finite row avoids NaN
        return mask.unsqueeze(1)

    def resume_states(self, pool: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Each request's resume state [B, ...] in `dtype`, read from its working slot of
        `pool` (a new tensor); zeros for requests with no cached prefix (their slot is stale)."""
        if self.fresh_all:
            return pool.new_zeros(self.num_reqs, *pool.shape[1:], dtype=dtype)
        out = pool[self.state_slots].to(dtype)
        if self.any_fresh:
            out[self.fresh] = 0.0
        return out

    def segment_plan(self, chunk_size: int) -> SegmentPlan:
        """The (cached) scan segmentation for `chunk_size`; see SegmentPlan."""
        if chunk_size not in self._plans:
            self._plans[chunk_size] = _build_plan(self, chunk_size)
        return self._plans[chunk_size]

    def conv_rows(self, km1: int) -> ConvRows:
        """The (cached) packed conv layout for a conv of K - 1 = `km1` state rows."""
        if km1 not in self._conv_rows:
            self._conv_rows[km1] = _build_conv_rows(self, km1)
        return self._conv_rows[km1]


def _build_conv_rows(meta: BatchMeta, km1: int) -> ConvRows:
    dev = meta.tokens.device
    lens = torch.tensor(meta.new_lens, device=dev)
    block = lens.cumsum(0) - lens + km1 * torch.arange(meta.num_reqs, device=dev)  # block starts
    win = torch.arange(km1, device=dev)
    tokens = torch.arange(meta.num_tokens, device=dev) + km1 * (meta.tok_req + 1)
    return ConvRows(
        head=(block.unsqueeze(1) + win).reshape(-1),
        tokens=tokens,
        outputs=tokens - km1,
        ends=(block + lens).unsqueeze(1) + win,
        captures=(block[meta.cap_req] + meta.cap_off).unsqueeze(1) + win,
    )


def _build_plan(meta: BatchMeta, chunk: int) -> SegmentPlan:
    captures = zip(
        meta.cap_req.tolist(), meta.cap_off.tolist(), meta.cap_slot.tolist(), strict=True
    )
    return build_segment_plan(
        meta.prefix_lens, meta.new_lens, chunk, meta.tokens.device, captures=captures
    )


def build_segment_plan(
    prefix_lens: Sequence[int],
    new_lens: Sequence[int],
    chunk: int,
    device: torch.device,
    captures: Iterable[tuple[int, int, int]] = (),
) -> SegmentPlan:
    """The SegmentPlan of requests with `prefix_lens` cached and `new_lens` new tokens packed in
    request order; `captures` are (request, offset among its new tokens, slot) triples."""
    caps: dict[int, list[tuple[int, int]]] = {}
    for r, off, slot in captures:
        caps.setdefault(r, []).append((off, slot))
    segs: list[list[tuple[int, int]]] = []  # per request: (start offset, length)
    cap_seg: dict[int, list[tuple[int, int]]] = {}
    init_caps: list[tuple[int, int]] = []
    for r, (pre, n) in enumerate(zip(prefix_lens, new_lens, strict=True)):
        cuts = set(range((pre // chunk + 1) * chunk, pre + n, chunk))
        cuts.add(pre + n)
        for off, _ in caps.get(r, []):
            if 0 < off < n:
                cuts.add(pre + off)
        bounds = sorted(cuts)
        starts = [pre, *bounds[:-1]]
        segs.append([(s - pre, e - s) for s, e in zip(starts, bounds, strict=True)])
        end_to_seg = {e - pre: k for k, e in enumerate(bounds)}
        for off, slot in caps.get(r, []):
            if off == 0:
                init_caps.append((r, slot))
            else:
                cap_seg.setdefault(end_to_seg[off], []).append((r, slot))
    b, t = len(new_lens), sum(new_lens)
    dev = device
    first = [0, *torch.tensor([len(r) for r in segs]).cumsum(0).tolist()]  # segment rows
    lc = max(ln for rsegs in segs for _, ln in rsegs)  # pad to the longest segment only
    index = torch.full((first[-1], lc), t, dtype=torch.long)
    starts_tok = [0, *torch.tensor(new_lens).cumsum(0).tolist()]
    ar = torch.arange(lc)
    for r, rsegs in enumerate(segs):
        for k, (off, ln) in enumerate(rsegs):
            index[first[r] + k, :ln] = ar[:ln] + starts_tok[r] + off
    steps: list[tuple[slice | torch.Tensor, slice | torch.Tensor]] = []
    for k in range(max(len(r) for r in segs)):
        reqs = [r for r in range(b) if len(segs[r]) > k]
        rows = [first[r] + k for r in reqs]
        if b == 1:
            steps.append((slice(None), slice(k, k + 1)))
        else:
            steps.append(
                (
                    slice(None) if len(reqs) == b else torch.tensor(reqs, device=dev),
                    torch.tensor(rows, device=dev),
                )
            )

    def pair(items: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        req, slot = zip(*items, strict=True)
        return torch.tensor(req, device=dev), torch.tensor(slot, device=dev)

    flat = index.reshape(-1)
    inverse = torch.nonzero(flat < t).reshape(-1)  # tokens appear in packed order
    dense = b == 1 and all(ln == lc for _, ln in segs[0][:-1])
    return SegmentPlan(
        index=index.to(dev),
        steps=tuple(steps),
        capture_at={k: pair(v) for k, v in sorted(cap_seg.items())},
        initial_captures=pair(init_caps) if init_caps else None,
        inverse=inverse.to(dev),
        dense=dense,
    )


def build_batch_meta(requests: Sequence[SequenceInput], device: torch.device) -> BatchMeta:
    """Validate `requests` and turn them into index tensors on `device`.

    Raises ValueError for empty requests, kv slot lists shorter than the new tokens, capture
    positions outside [prefix, prefix + new] or capture lists of mismatched length.
    """
    if not requests:
        raise ValueError("empty batch")
    toks: list[torch.Tensor] = []
    new_slots: list[torch.Tensor] = []
    kv_rows: list[torch.Tensor] = []
    new_lens: list[int] = []
    pre_lens: list[int] = []
    cap_req: list[int] = []
    cap_off: list[int] = []
    cap_slot: list[int] = []
    for r, req in enumerate(requests):
        ids = torch.as_tensor(req.token_ids, dtype=torch.long).reshape(-1)
        slots = torch.as_tensor(req.kv_slots, dtype=torch.long).reshape(-1)
        n = int(ids.numel())
        pre = int(slots.numel()) - n
        if n == 0 or pre < 0:
            raise ValueError(f"request {r}: {n} new tokens but {slots.numel()} kv slots")
        if len(req.capture_positions) != len(req.capture_slots):
            raise ValueError(f"request {r}: capture_positions and capture_slots differ in length")
        for pos, slot in zip(req.capture_positions, req.capture_slots, strict=True):
            if not pre <= pos <= pre + n:
                raise ValueError(f"request {r}: capture at {pos} outside [{pre}, {pre + n}]")
            cap_req.append(r)
            cap_off.append(pos - pre)
            cap_slot.append(int(slot))
        toks.append(ids)
        kv_rows.append(slots)
        new_slots.append(slots[pre:])
        new_lens.append(n)
        pre_lens.append(pre)
    lens_t = torch.tensor(new_lens)
    tok_req = torch.repeat_interleave(torch.arange(len(requests)), lens_t)
    starts = lens_t.cumsum(0) - lens_t
    tok_off = torch.arange(int(lens_t.sum())) - starts[tok_req]
    positions = tok_off + torch.tensor(pre_lens)[tok_req]
    kv_index = torch.nn.utils.rnn.pad_sequence(kv_rows, batch_first=True, padding_value=0)
    kv_range = None
    if len(kv_rows) == 1:
        row = kv_rows[0]
        first, last = int(row[0]), int(row[-1])
        if last - first == row.numel() - 1 and (row.numel() == 1 or bool((row.diff() == 1).all())):
            kv_range = (first, last + 1)

    def dev_long(x: list[int] | torch.Tensor) -> torch.Tensor:
        return torch.as_tensor(x, dtype=torch.long).to(device)

    split = None
    decodes = next(
        (
            i
            for i, (n, p, q) in enumerate(zip(new_lens, pre_lens, requests, strict=True))
            if n != 1 or p == 0 or q.capture_positions
        ),
        len(requests),
    )
    if 0 < decodes < len(requests):
        split = (
            BatchPart(slice(0, decodes), build_batch_meta(requests[:decodes], device)),
            BatchPart(slice(decodes, None), build_batch_meta(requests[decodes:], device)),
        )

    return BatchMeta(
        tokens=torch.cat(toks).to(device),
        positions=positions.to(device),
        tok_req=tok_req.to(device),
        tok_off=tok_off.to(device),
        new_lens=tuple(new_lens),
        prefix_lens=tuple(pre_lens),
        new_kv_slots=torch.cat(new_slots).to(device),
        kv_index=kv_index.to(device),
        state_slots=dev_long([int(q.state_slot) for q in requests]),
        fresh=torch.tensor([p == 0 for p in pre_lens], device=device),
        cap_req=dev_long(cap_req),
        cap_off=dev_long(cap_off),
        cap_slot=dev_long(cap_slot),
        last_index=(lens_t.cumsum(0) - 1).to(device),
        kv_range=kv_range,
        split=split,
    )
