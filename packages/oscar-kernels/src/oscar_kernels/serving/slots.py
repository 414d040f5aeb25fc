"""Window slots: which row of the BF16 window pools each running request owns, and when a slot
must be restored before a step (a prefix-cache hit, a resumed request).

* :class:`RequestSlots` / :class:`FreshRows`: slots that follow request identity (vLLM's
  persistent request rows or request ids; SGLang's ``req_pool_indices``). A restore is due
  exactly at a request's first step in its slot, if it has cached tokens.
* :class:`SlotTracker` / :func:`plan_slots`: slots that follow their content (no request
  identity from the engine); :class:`WindowSlots`: slots keyed by a request's first KV block
  (prefix caching off).
* :class:`WindowTracker`: how many positions of each slot its current request wrote.

Host-side bookkeeping only; no engine imports.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence

import torch

from oscar_math.errors import OscarError

__all__ = [
    "WindowSlots",
    "RequestSlots",
    "FreshRows",
    "SlotTracker",
    "plan_slots",
    "WindowTracker",
]


class WindowSlots:
    """Window-pool row of every live request, for model runners that give no request row.

    Used while prefix caching is off (with caching on, :class:`SlotTracker` keys slots by their
    content and restores from the window pages where needed). Keyed by the request's first KV
    block, which no other live request holds while prefix caching is off. A request that starts (no cached
    tokens) takes a slot — its predecessor's if it got the same first block (that one
    has finished), else a free one, else the least recently seen slot of a request not
    in this batch. A request that continues must already have one: otherwise its BF16
    windows were never written here, and the step fails with one clear error instead of
    attending garbage.
    """

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # first block -> slot, LRU order
        self._free = list(range(num_slots - 1, -1, -1))

    def assign(self, first_blocks: list[int], starts: list[bool], active: list[bool]) -> list[int]:
        """Slots of a batch's rows (``0`` for inactive/padding rows)."""
        slots = [0] * len(first_blocks)
        in_batch = {b for b, a in zip(first_blocks, active, strict=True) if a}
        for i, (block, start, act) in enumerate(zip(first_blocks, starts, active, strict=True)):
            if not act:
                continue
            if block in self._slot_of:
                self._slot_of.move_to_end(block)
                slots[i] = self._slot_of[block]
                continue
            if not start:
                raise OscarError(
                    "OSCAR: a request arrived with cached tokens whose BF16 windows this worker never "
                    "wrote (a prefix-cache hit although OSCAR's exact prefix caching is not active; "
                    "see docs/vllm.md, 'Prefix caching')"
                )
            if not self._free:
                victim = next((b for b in self._slot_of if b not in in_batch), None)
                if victim is None:
                    raise OscarError(f"OSCAR: more than {self.num_slots} live requests (max_num_seqs)")
                self._free.append(self._slot_of.pop(victim))
            slot = self._free.pop()
            self._slot_of[block] = slot
            slots[i] = slot
        return slots


class RequestSlots:
    """Window slot of every running request, by request id, for vLLM's V1 model runner.

    The V1 runner gives the attention backend no persistent request row, but it tells its worker
    in every scheduler output which requests finished or were preempted
    (:func:`oscar_vllm.compat.track_v1_requests` passes them here, with the step's rows in batch
    order). A request takes the slot free the longest at its first step (so a slot's reuse
    comes late, and the tests see requests in several slots) and keeps it until it finishes or
    is preempted, however many steps vLLM skips it; vLLM runs at most
    ``max_num_seqs`` requests at once, so a free slot always exists and a running request never
    loses its windows. A preempted or resumed request comes back as a new one (vLLM recomputes
    it, or serves it from a prefix hit whose window records it has checked).
    """

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._slot_of: dict[str, int] = {}
        self._free = deque(range(num_slots))  # released slots go to the back
        #: this step's slots in batch order, ``None`` outside a step (dummy and capture runs)
        self.rows: list[int] | None = None
        #: per slot, how many requests it has been given (:class:`FreshRows` reads it)
        self.generation: dict[int, int] = {}

    def step(self, ended: Iterable[str], row_ids: Sequence[str]) -> list[int]:
        """Release the slots of ``ended`` requests, then give each row its request's slot."""
        for rid in sorted(ended):  # sorted: the same slots in every run
            slot = self._slot_of.pop(rid, None)
            if slot is not None:
                self._free.append(slot)
        rows = []
        for rid in row_ids:
            slot = self._slot_of.get(rid)
            if slot is None:
                if not self._free:
                    raise OscarError(f"OSCAR: more than {self.num_slots} running requests (max_num_seqs)")
                slot = self._slot_of[rid] = self._free.popleft()
                self.generation[slot] = self.generation.get(slot, 0) + 1
            rows.append(slot)
        self.rows = rows
        return rows

    def end_step(self) -> None:
        self.rows = None

    def rows_for(self, num_reqs: int) -> list[int] | None:
        """This step's slots for a batch of ``num_reqs`` rows, else ``None`` (no step running, or a
        batch of other requests). Rows past the step's requests are the runner's padding (a CUDA
        graph's batch size): slot 0, which they never write (no tokens)."""
        if self.rows is None or num_reqs < len(self.rows):
            return None
        return self.rows + [0] * (num_reqs - len(self.rows))


class FreshRows:
    """Which of a step's window slots hold a request that has not run a step in them yet.

    Where slots follow request identity (vLLM V2's persistent rows, :class:`RequestSlots` on the
    V1 runner) a slot is exclusive to its request from its first step until it finishes, so it
    holds that request's windows at every later step. A restore is then needed exactly at a
    request's first step in its slot, and only with cached tokens (a prefix hit, or a resumed
    request). The model-runner hook (or :class:`RequestSlots`) counts the requests each slot was
    given (``generation``); this object remembers the count it saw last per slot. Deciding this
    needs no block ids, so a step reads nothing back from the device (:func:`plan_slots` does).
    """

    def __init__(self, generation: dict[int, int]) -> None:
        self.generation = generation  # shared with the hook, which only ever increments it
        self._seen: dict[int, int] = {}

    def plan(
        self,
        query_start_loc_cpu: torch.Tensor,
        seq_lens_cpu: torch.Tensor,
        rows: Sequence[int],
        num_reqs: int,
    ) -> tuple[list[int], list[tuple[int, int, int]]]:
        """Slots of a batch's rows (padding rows, which have no tokens: slot 0) and the rows to
        restore, ``(row, slot, prefix)``, as :func:`plan_slots` returns them."""
        b = num_reqs
        qsl = query_start_loc_cpu[: b + 1].tolist()
        seq = seq_lens_cpu[:b].tolist()
        slots, restore = [0] * b, []
        for i in range(b):
            qlen = qsl[i + 1] - qsl[i]
            if qlen <= 0 or seq[i] <= 0:
                continue
            slot = int(rows[i])
            slots[i] = slot
            gen = self.generation.get(slot, 0)
            if self._seen.get(slot) != gen:  # the slot's request runs its first step
                self._seen[slot] = gen
                prefix = int(seq[i]) - qlen
                if prefix > 0:
                    restore.append((i, slot, prefix))
        return slots, restore


class SlotTracker:
    """What each window slot holds, so a request restores its windows only when its slot does
    not already hold them (docs/vllm.md, "Prefix caching").

    A slot's content is named by the key ``(INT2 block of position p - 1, p)`` of the step that
    last wrote it: a block full and cached names its whole prefix (vLLM hashes the chain), a
    partial block has one owner. A block that is written through another slot gets a new content,
    so every slot whose key names it is forgotten. A request whose key matches a slot reuses it
    without a restore; any other request with cached tokens (a prefix hit, a resumed or moved
    request) takes a free or least recently used slot and restores it from the window records,
    which vLLM's sliding-window manager keeps for every running request.
    """

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.key: list[tuple[int, int] | None] = [None] * num_slots
        self._lru: OrderedDict[int, None] = OrderedDict((s, None) for s in range(num_slots))
        self.restores = 0  # rows restored so far (diagnostics, tests)

    def plan(
        self,
        last_block_before: list[int],
        prefix: list[int],
        last_block_after: list[int],
        seq: list[int],
        written_blocks: list[set[int]],
        active: list[bool],
        fixed: list[int] | None = None,
    ) -> tuple[list[int], list[bool]]:
        """Slots of a batch's rows and whether each must be restored; records the step's writes.

        Per row: the INT2 block of position ``prefix - 1`` (any value when ``prefix == 0``),
        ``prefix``, the block of position ``seq - 1``, ``seq``, the INT2 blocks the step writes,
        and whether the row is real (padding rows get slot 0, no restore). ``fixed``: slots
        given by the model runner (vLLM V2's ``req_idx``), else chosen here.
        """
        b = len(prefix)
        slots, restore = [0] * b, [False] * b
        taken: set[int] = set()
        want = [(last_block_before[i], prefix[i]) if prefix[i] > 0 else None for i in range(b)]
        if fixed is not None:
            for i in range(b):
                if active[i]:
                    slots[i] = fixed[i]
                    taken.add(fixed[i])
                    restore[i] = want[i] is not None and self.key[fixed[i]] != want[i]
        else:
            by_key: dict[tuple[int, int], list[int]] = {}
            for s, k in enumerate(self.key):
                if k is not None:
                    by_key.setdefault(k, []).append(s)
            pending = []
            for i in range(b):
                if not active[i]:
                    continue
                match = [s for s in by_key.get(want[i], []) if s not in taken] if want[i] else []
                if match:
                    slots[i] = match[0]
                    taken.add(match[0])
                else:
                    pending.append(i)
            for i in pending:  # free slots first, then the least recently used
                free = [s for s in self._lru if s not in taken and self.key[s] is None]
                rest = [s for s in self._lru if s not in taken]
                if not rest:
                    raise OscarError(f"OSCAR: more than {self.num_slots} requests in one step (max_num_seqs)")
                slots[i] = (free or rest)[0]
                taken.add(slots[i])
                restore[i] = want[i] is not None
        written = set().union(*(written_blocks[i] for i in range(b) if active[i])) if b else set()
        for s in range(self.num_slots):  # contents overwritten through another slot
            k = self.key[s]
            if k is not None and s not in taken and k[0] in written:
                self.key[s] = None
        for i in range(b):
            if active[i]:
                self.key[slots[i]] = (last_block_after[i], seq[i])
                self._lru.move_to_end(slots[i])
        self.restores += sum(restore)
        return slots, restore


def plan_slots(
    tracker: SlotTracker,
    query_start_loc_cpu: torch.Tensor,
    seq_lens_cpu: torch.Tensor,
    block_table: torch.Tensor,
    num_reqs: int,
    block_size: int,
    fixed: list[int] | None = None,
) -> tuple[list[int], list[tuple[int, int, int]]]:
    """Window slots of a batch's rows and the rows to restore, ``(row, slot, prefix)``, from vLLM's
    per-step tensors (prefix caching; :class:`SlotTracker`).

    ``block_table``: the INT2 group's ``[B, max_blocks]`` table of ``block_size``-token blocks
    (any device): only the entries the tracker needs (the blocks of positions ``prefix - 1`` and
    ``seq - 1`` and the blocks the step writes) are gathered and copied to the host, in one copy.
    """
    b = num_reqs
    qsl = query_start_loc_cpu[: b + 1].tolist()
    seq = [int(x) for x in seq_lens_cpu[:b].tolist()]
    qlen = [qsl[i + 1] - qsl[i] for i in range(b)]
    prefix = [seq[i] - qlen[i] for i in range(b)]
    width = int(block_table.shape[1]) if block_table.dim() == 2 else 0
    cols: list[list[int]] = []
    for i in range(b):
        if qlen[i] <= 0 or seq[i] <= 0:
            cols.append([])
            continue
        before = [(prefix[i] - 1) // block_size] if prefix[i] > 0 else []
        cols.append(before + list(range(prefix[i] // block_size, (seq[i] - 1) // block_size + 1)))
    flat = [i * width + c for i, cs in enumerate(cols) for c in cs if c < width]
    if len(flat) != sum(len(cs) for cs in cols):
        raise OscarError(f"OSCAR: a row's positions lie past its block table ({width} blocks)")
    vals = block_table[:b].reshape(-1)[torch.tensor(flat, dtype=torch.long, device=block_table.device)]
    vals = vals.tolist() if flat else []
    blocks_before, blocks_after, written, k = [-1] * b, [-1] * b, [set() for _ in range(b)], 0
    for i, cs in enumerate(cols):
        if not cs:
            continue
        got = vals[k : k + len(cs)]
        k += len(cs)
        if prefix[i] > 0:
            blocks_before[i], got = int(got[0]), got[1:]
        written[i] = {int(x) for x in got}
        blocks_after[i] = int(got[-1])
    slots, again = tracker.plan(
        blocks_before, prefix, blocks_after, seq, written, [q > 0 for q in qlen], fixed
    )
    return slots, [(i, slots[i], prefix[i]) for i in range(b) if again[i]]


class WindowTracker:
    """Which positions of each window slot hold rows written for the request that owns it.

    SGLang's ``ReqToTokenPool.req_generation`` is bumped every time a row is handed to a
    new request. The tracker remembers, per slot, the generation it last saw and how many
    positions that request has written through this backend. A slot whose generation
    changed starts from zero, so rows left by an earlier request are never read.
    Host-side lists only: no device synchronisation.
    """

    def __init__(self, max_seqs: int) -> None:
        self.generation = [-1] * max_seqs
        self.valid = [0] * max_seqs

    def written(self, slot: int, generation: int) -> int:
        """Positions ``[0, n)`` of ``slot`` written by its current request."""
        if self.generation[slot] != generation:
            self.generation[slot] = generation
            self.valid[slot] = 0
        return self.valid[slot]

    def mark(self, slot: int, generation: int, length: int) -> None:
        self.generation[slot] = generation
        self.valid[slot] = length
