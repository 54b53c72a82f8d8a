"""The `family` task set: one-line bugs of eight kinds in fourteen generated packages, SWE-bench format.

    python -m app.tasksets.family            # writes data/tasks/family.jsonl
    python -m app.tasksets.family --check    # exit 1 when the bundled file differs from what it would write

Why: a held-out split is evidence of learning only when it is drawn from the train split's
distribution.  The `starter` set held out other packages and a skill train never showed; here
every package, bug kind and kind of issue text occurs in both train and held-out, and the
split is random (fixed seeds, `SPLIT_SEEDS`).  Kinds absent from train (`swap`, `drop_call`)
form a third split, `out_of_family`, reported separately: it measures transfer, not fit.

Rooms: `pool` (the functions, one `return` line each), `mutate` (the bug kinds), `packages`
(the packages dealt from the pool, the instances planted in them), `generate` (records, splits,
the JSONL file).  Split specs such as "family:heldout" or "family:train@1" are read by
`app.tasksets.starter.splits.instance_ids`.
"""
from __future__ import annotations

from app.tasksets.family.mutate import IN_FAMILY, KINDS, OUT_OF_FAMILY, mutate
from app.tasksets.family.packages import Instance, Package, instances, packages

__all__ = ["IN_FAMILY", "KINDS", "OUT_OF_FAMILY", "mutate", "Instance", "Package", "instances", "packages"]
