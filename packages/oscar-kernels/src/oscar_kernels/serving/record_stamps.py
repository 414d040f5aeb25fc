"""Which window records still hold what a restore would read, where records are transient
(vLLM frees a running request's window blocks once written; they stay cached for hits)."""

from __future__ import annotations

from oscar_math.errors import OscarError

__all__ = ["RecordStamps"]


class RecordStamps:
    """Which window records still hold what a restore would read (transient records only).

    With transient records (:mod:`oscar_vllm.records`) vLLM frees a running request's window
    blocks once written; they stay cached for hits but can be evicted and reused, as window
    blocks of other positions or as INT2 pages. A hit is only accepted while its records are
    cached, and on vLLM's V2 runner a running request never restores; on the V1 runner a
    request that lost its window slot would restore from its own records, which may be gone.
    This check makes that an error instead of wrong numbers: every record a restore reads must
    carry the stamp written with it.

    The stamp of window block ``b`` is ``(X, j, g)``: the INT2 block ``X`` that held the record's
    tokens when it was written, the window index ``j`` (positions ``[j*wb, (j+1)*wb)``) and the
    record page ``g``. A full INT2 block is immutable while any request holds it (vLLM's prefix
    cache shares it by a hash of the whole prefix), and a partial one has one owner, so a
    record whose stamp matches the restoring request's INT2 block ``X`` at ``j`` holds that
    request's rows. A stamp is dropped when ``b`` is written as an INT2 page, when another
    record of ``(X, j, g)`` is written (``X`` was freed and reused), and overwritten when ``b``
    holds another record.
    """

    def __init__(self) -> None:
        self.geometry: tuple[int, ...] | None = None
        self._stamp: dict[int, tuple[int, int, int]] = {}
        self._where: dict[tuple[int, int, int], int] = {}
        self.last_step = -1  # the step whose check ran (the other layers of that step skip it)
        self.checked = 0  # records checked so far (diagnostics, tests)

    def configure(self, window_block: int, int2_block: int, sink: int, recent: int, sink_parts: int) -> None:
        """Set the record geometry (the layers' :class:`WindowPlan`; the same for every layer)."""
        geometry = (window_block, int2_block, sink, recent, sink_parts)
        if self.geometry is not None and self.geometry != geometry:
            raise OscarError(f"OSCAR: window records of two geometries {self.geometry} / {geometry}")
        self.geometry = geometry
        self.wb, self.ib, self.sink, self.recent, self.parts = geometry

    def needed(self, n_cached: int) -> range:
        """Window indices whose records a restore at ``n_cached`` reads (:func:`restore_windows`)."""
        if n_cached <= 0:
            return range(0)
        last = (n_cached - 1) // self.wb
        ring_lo = max(0, n_cached - self.recent + 1)
        lo = ring_lo // self.wb
        if min(self.sink, n_cached) > ring_lo:  # older sink positions: parts of the last S blocks
            lo = min(lo, max(0, last - self.parts + 1))
        return range(lo, last + 1)

    def columns(
        self, prefix: list[int], seq: list[int], restore_rows: list[int]
    ) -> tuple[list[set[int]], list[set[int]]]:
        """The INT2 and window block-table columns :meth:`step` reads per row: the records a
        restore checks and the blocks the step writes (a few per row, not the whole table)."""
        wb, ib = self.wb, self.ib
        int2: list[set[int]] = [set() for _ in prefix]
        win: list[set[int]] = [set() for _ in prefix]
        for r in restore_rows:
            for j in self.needed(prefix[r]):
                win[r].add(j)
                int2[r].add((j * wb) // ib)
        for r, (p, n) in enumerate(zip(prefix, seq, strict=True)):
            if n <= p:
                continue
            int2[r].update(range(p // ib, (n - 1) // ib + 1))
            for j in range(p // wb, (n - 1) // wb + 1):
                win[r].add(j)
                int2[r].add((j * wb) // ib)
        return int2, win

    def _drop(self, b: int) -> None:
        key = self._stamp.pop(b, None)
        if key is not None and self._where.get(key) == b:
            del self._where[key]

    def step(
        self,
        step_no: int,
        int2_tables: list[list[int]],
        window_tables: list[list[list[int]]],
        prefix: list[int],
        seq: list[int],
        restore_rows: list[int],
    ) -> None:
        """Check this step's restores, then record its writes (once per ``step_no``).

        ``int2_tables[r]``: row ``r``'s INT2 block ids; ``window_tables[g][r]``: its window
        blocks of record page ``g``; ``prefix`` / ``seq``: tokens before / after the step.
        Raises :class:`OscarError` for a restore whose records are not intact."""
        if step_no == self.last_step:
            return
        self.last_step = step_no
        wb, ib = self.wb, self.ib
        for r in restore_rows:
            for j in self.needed(prefix[r]):
                x = int2_tables[r][(j * wb) // ib]
                for g, tables in enumerate(window_tables):
                    b = tables[r][j]
                    self.checked += 1
                    if b == 0 or self._stamp.get(b) != (x, j, g):
                        raise OscarError(
                            f"OSCAR: the window records of a request with {prefix[r]} computed tokens were "
                            "freed and reused before it restored from them (its window slot was lost on "
                            "vLLM's V1 model runner, or a hit was accepted without its records); serve with "
                            'additional_config {"oscar": {"window_records": "held"}} or the V2 model runner '
                            "(docs/vllm.md, 'Prefix caching')"
                        )
        for r in range(len(prefix)):
            p, s = prefix[r], seq[r]
            if s <= p:
                continue
            for i in range(p // ib, (s - 1) // ib + 1):  # INT2 pages written: no longer records
                self._drop(int2_tables[r][i])
            for j in range(p // wb, (s - 1) // wb + 1):
                x = int2_tables[r][(j * wb) // ib]
                for g, tables in enumerate(window_tables):
                    b = tables[r][j]
                    if b == 0:
                        continue
                    old = self._where.get((x, j, g))
                    if old is not None and old != b:
                        self._drop(old)  # X was reused by another prefix
                    self._drop(b)
                    self._stamp[b] = (x, j, g)
                    self._where[(x, j, g)] = b
