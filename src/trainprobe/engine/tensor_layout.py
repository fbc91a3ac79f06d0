"""``tensor_layout.json``: what each row of a rank summarises (whole tensor, shard, replica, partial
sum, or a rank's own value before a reduction), written beside the rank's data files.

The CSV headers stay the reference's; the layout goes in its own file, one per rank folder
(``rank_<r>/tensor_layout.json``), written when the monitor starts (atomically) and again when
a tensor's layout changes. Example (tensor parallelism on two ranks, rank 0)::

    {
      "schema": "trainprobe.tensor_layout/1",
      "rank": 0, "world_size": 2, "step": 0,
      "tensors": [
        {"monitor": "weight_grad", "name": "fc1.weight", "scope": null, "kind": "shard",
         "numel": 32, "local_shape": [4, 8], "global_shape": [7, 8], "offsets": [0, 0],
         "placements": ["S(0)"], "mesh": {"shape": [2], "dim_names": ["tp"], "coordinate": [0]}},
        {"monitor": "weight_grad", "name": "fc1.weight", "scope": "unreduced", "kind": "rank_local", ...}
      ]
    }

An entry with ``"scope": null`` holds for every scope of that name; an entry naming a scope
overrides it for that scope. Kinds: ``whole``, ``shard``, ``replica`` and ``partial`` (see
:mod:`trainprobe.backends.torch.placement`), and ``rank_local``: the rank's own value before a
data-parallel reduction (``unreduced`` gradients under DDP or FSDP, activations under data
parallelism): each rank's row is a different tensor, never merged.

Optional fields (schema ``/1`` still: a reader that does not know them reads the rest as before):

* ``flat_offset``: the piece is ``numel`` consecutive elements of the flattened global tensor,
  from this index (FSDP1 with ``use_orig_params=True``: a parameter's 1-D view into the rank's
  flat shard; ``offsets`` is then None). An empty piece has ``numel`` 0 and no offset.
* ``padding``: the last ``padding`` of the ``numel`` elements are padding zeros of no tensor
  (FSDP1's flat shards); the read side leaves them out of the merged values.
* ``state_rank``: on ``optimizer`` entries, the rank that keeps this parameter's optimizer state
  (ZeRO-style sharding, ``ZeroRedundancyOptimizer``: only that rank has the entry and the rows).

Standard library only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LAYOUT_FILE = "tensor_layout.json"
SCHEMA = "trainprobe.tensor_layout/1"
RANK_LOCAL = "rank_local"
KINDS = ("whole", "shard", "replica", "partial", RANK_LOCAL)


@dataclass
class LayoutFile:
    """The entries of one rank's ``tensor_layout.json``, rewritten only when they change."""

    path: Path
    rank: int
    world_size: int
    entries: dict[tuple[str, str, str | None], dict[str, Any]] = field(default_factory=dict)

    def add(self, monitor: str, name: str, layout: Mapping[str, Any], scope: str | None = None) -> bool:
        """Record ``layout`` (a :func:`~trainprobe.backends.torch.placement.layout_of` result) of
        row ``name`` of ``monitor`` (every scope, or ``scope``); True when it changed."""
        key = (monitor, name, scope)
        entry = {"monitor": monitor, "name": name, "scope": scope, **layout}
        if self.entries.get(key) == entry:
            return False
        self.entries[key] = entry
        return True

    def write(self, step: int) -> None:
        """Write the file whole (temporary file, then rename)."""
        from trainprobe.engine.sinks.files import write_json_atomically

        document = {
            "schema": SCHEMA,
            "rank": self.rank,
            "world_size": self.world_size,
            "step": step,
            "tensors": list(self.entries.values()),
        }
        write_json_atomically(self.path, document)

