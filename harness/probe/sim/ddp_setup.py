"""DDP's setup in a synthesized journal: traced at the point's depth, not synthesized.

What DDP.__init__ allocates (sharded.ddp_buckets_are_gradients tags it: the setup's gradients) is
sized by all the parameters at once: the shapes it checks across ranks, the 250 MiB pieces it
broadcasts the model's state in (how many depends on where their edges fall, not on one layer), the
flat gradient bucket. Its transient entries (allocated and freed inside it) are cut from the shallow
journals before they are aligned; what outlives it (the bucket, freed when the first step's order
rebuilds the buckets) stays, an entry that grows with the depth (repeat: scaled). The point's own
setup, traced at its depth (the job built, no step: a second or two, where its steps take tens),
goes back in its place, its lasting entries checked against the synthesized ones.
"""

from __future__ import annotations

from harness.probe.sim.repeat import NotRepeating, referents
from harness.probe.sim.tracker import TraceEvent


def section(journal: list[TraceEvent]) -> range | None:
    """Where DDP's setup is in the journal (its run of the setup's gradients); None without one.
    Read up to the first step only: a deep journal's steps are most of it."""
    at = []
    for i, e in enumerate(journal):
        if e.step >= 0:
            break
        if e.phase == "setup" and e.kind == "gradient":
            at.append(i)
    if not at:
        return None
    if at != list(range(at[0], at[-1] + 1)):
        raise NotRepeating("the setup's gradients are not one run")
    return range(at[0], at[-1] + 1)


def _transient(journal: list[TraceEvent], where: range) -> set[int]:
    """The entries of `where` that allocate a storage freed inside it, and those frees."""
    named = referents(journal)
    out: set[int] = set()
    for i in where:
        if journal[i].action == "free" and named.get(i, -1) in where:
            out |= {i, named[i]}
    return out


def cut(journal: list[TraceEvent]) -> list[TraceEvent]:
    """The journal less its DDP setup's transient entries (the journal itself without one)."""
    where = section(journal)
    if where is None:
        return journal
    gone = _transient(journal, where)
    return [e for i, e in enumerate(journal) if i not in gone]


def splice(journal: list[TraceEvent], traced: list[TraceEvent]) -> list[TraceEvent]:
    """The synthesized `journal` with DDP's setup as `traced` (a setup-only journal at the same
    depth) has it: its lasting entries must be the synthesized ones (same actions, sizes, places),
    whose keys they take; its transient ones get keys of their own."""
    mine, theirs = section(journal), section(traced)
    if mine is None or theirs is None:
        raise NotRepeating("DDP's setup is in one of the journals only")
    gone = _transient(traced, theirs)
    lasting = [i for i in theirs if i not in gone]

    def look(e: TraceEvent) -> tuple:
        return (e.action, e.size, e.kind, e.phase, e.step, e.module, e.stream, e.kernel)

    if [look(traced[i]) for i in lasting] != [look(journal[i]) for i in mine]:
        raise NotRepeating(f"DDP's setup traced at depth is not the synthesized one ({len(lasting)} lasting "
                           f"entries, {len(mine)} synthesized)")
    # by entry, not key: the tracker's keys are storages' identities, used again once freed
    key_of = {i: journal[k].key for i, k in zip(lasting, mine)}
    fresh = max((abs(e.key) for e in journal), default=0) + 1  # no key of the journal's, alloc's or not
    for i in theirs:
        if i in gone and traced[i].action == "alloc":
            key_of[i] = fresh
            fresh += 1
    named = referents(traced)
    spliced = [traced[i]._replace(key=key_of[named[i]] if named.get(i, -1) in theirs else key_of[i])
               for i in theirs]
    out = journal[:mine.start] + spliced + journal[mine.stop:]
    return [e._replace(seq=n) for n, e in enumerate(out)]
