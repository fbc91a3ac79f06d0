"""Full-tensor views: the rank-local rows of a sharded run merged into one row per tensor.

Under FSDP2, tensor parallelism and their mixes a rank writes the statistics of its *local*
piece of each parameter, gradient and optimizer moment. Each rank also writes what its pieces
are (``rank_<r>/tensor_layout.json``, :mod:`trainprobe.engine.tensor_layout`). From those,
:func:`add_full_views` defines, next to each view ``T`` that has layouts (``weight_grad``,
``param``, ``optimizer``), a view ``T_full`` with one row per tensor, step, micro-step and
scope:

==============  =================================================================================
``min``/``max`` the least / greatest over the pieces (exact; padding below)
``norm``        √Σ norm² over the distinct pieces
``mean``        Σ mean·numel / Σ numel (element-weighted: right for uneven shards)
``nans``        Σ over the distinct pieces; ``zeros`` (a fraction) element-weighted like ``mean``
``numel``       elements summarised (Σ over the distinct pieces, padding left out)
``pieces``      how many distinct pieces were merged; ``complete``: whether they add up to the
                tensor's elements (False: a rank's rows are missing)
``ranks``       the ranks holding the pieces merged (``"0,1"``), one rank per replicated piece
``kind``        ``merged``; or, for rows that are never merged, their layout's kind:
                ``rank_local`` (a rank's own value before a data-parallel reduction, e.g.
                ``unreduced`` gradients under DDP/FSDP: one row per rank, as written) and
                ``partial``
``rank``        the least of ``ranks`` (so that queries keyed by rank still run)
``file``,       the file and row of that rank's piece (provenance; ``trainprobe diff`` orders by them)
``file_row``
==============  =================================================================================

A piece is identified by its offsets and shape in the global tensor, or by its first element
and element count in the flattened tensor (``flat_offset``: FSDP1's 1-D views of a flat shard):
replicas (the same piece on several ranks: DDP, a ``Replicate`` mesh dimension, HSDP) are
counted once, the copy of the least rank. A piece whose offsets are unknown (Megatron attributes
only) counts as its rank's own. Empty pieces (an FSDP1 parameter outside a rank's flat shard:
its row's min/max are NaN by definition) are left out. Rows of a name with no layout entry are
kept as they are (``kind`` NULL).

FSDP1's padding (``padding``: the zeros at the end of a flat shard that belong to no parameter)
reaches no merged value: ``numel``, ``mean`` and ``zeros`` count the real elements only (exact,
as are ``norm`` and ``nans``: zeros add nothing), and a padded piece's ``min``/``max`` is used
where it cannot be a padding zero; where it may be, and no other piece decides the extreme, the
merged ``min`` (``max``) is NULL: unknown, never the padding's 0 (``exp_avg_sq``'s min of an
``use_orig_params=False`` unit whose last rank is padded, for one).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from trainprobe.engine.errors import ConfigError
from trainprobe.engine.layout import V2_RANK
from trainprobe.engine.safe_files import bounded_int
from trainprobe.engine.tensor_layout import KINDS, LAYOUT_FILE, RANK_LOCAL
from trainprobe.tools.sql.names import ident, text
from trainprobe.tools.sql.questions import nonfinite_sql, ops_of

LAYOUT_TABLE = "tensor_layout"
"""The table of every rank's layout entries (``rank, monitor, name, scope, kind, numel, piece,
global_numel``) on a connection with full views."""
PADDING_TABLE = "tensor_layout_padding"
"""The entries with FSDP padding (``rank, monitor, name, scope, padding``), beside :data:`LAYOUT_TABLE`."""
FULL_SUFFIX = "_full"
FULL_COMMENT = "trainprobe full-tensor view"
"""The comment on each full view: :func:`~trainprobe.tools.query.layer.describe` leaves them out unless asked."""
MAX_LAYOUT_BYTES = 64 << 20
_MERGED_TABLES = ("weight_grad", "param", "optimizer")


def layout_files(root: Path) -> list[tuple[int, Path]]:
    """``(rank, path)`` of each ``rank_<r>/tensor_layout.json`` of a V2 run (or of the rank folder
    ``root`` itself)."""
    found = []
    folders = [root] + (sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else [])
    for folder in folders:
        match = V2_RANK.fullmatch(folder.name)
        path = folder / LAYOUT_FILE
        if match and path.is_file() and not path.is_symlink():
            found.append((bounded_int(match["rank"], "rank", str(folder)), path))
    return found


def layout_rows(root: Path) -> list[tuple[Any, ...]]:
    """The layout entries of every rank of ``root`` as rows of :data:`LAYOUT_TABLE`.

    Raises:
        ConfigError: a layout file that is not JSON of the documented shape (the message names it).
    """
    from trainprobe.engine.safe_json import load_json_file

    rows: list[tuple[Any, ...]] = []
    for rank, path in layout_files(root):
        document = load_json_file(path, max_bytes=MAX_LAYOUT_BYTES, within=root)
        tensors = document.get("tensors") if isinstance(document, dict) else None
        if not isinstance(tensors, list):
            raise ConfigError(f"{path}: not a trainprobe tensor layout (no 'tensors' list)")
        for entry in tensors:
            rows.append(_row(rank, entry, path))
    return rows


def _row(rank: int, entry: Any, path: Path) -> tuple[Any, ...]:
    try:
        kind = entry["kind"]
        if kind not in KINDS:
            raise ValueError(kind)
        numel, padding = int(entry["numel"]), int(entry.get("padding") or 0)
        if not 0 <= padding <= numel:
            raise ValueError(f"padding {padding} of {numel} elements")
        full = entry.get("global_shape")
        return (rank, str(entry["monitor"]), str(entry["name"]), entry.get("scope"), kind, numel,
                _piece(entry), math.prod(int(s) for s in full) if full is not None else None, padding)
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"{path}: an entry that is not a tensor layout ({type(exc).__name__}: {exc})") from None


def _piece(entry: Mapping[str, Any]) -> str | None:
    """What identifies a piece among the ranks' (copies of one piece are replicas): its offsets
    and shape in the global tensor, or its first element and element count in the flattened
    tensor (``flat_offset``: FSDP1's 1-D views); None when neither is known."""
    if entry.get("flat_offset") is not None:
        return json.dumps(["flat", int(entry["flat_offset"]), int(entry["numel"])])
    offsets = entry.get("offsets")
    if offsets is None:
        return None
    return json.dumps([[int(o) for o in offsets], [int(s) for s in entry["local_shape"]]])


def add_full_views(con: Any, root: Path, views: Mapping[str, Sequence[str]]) -> list[str]:
    """Define :data:`LAYOUT_TABLE` and a ``<table>_full`` view (module docstring) for each of
    ``views`` (view → columns) that has layout entries; returns the full views made."""
    rows = layout_rows(root)
    if not rows:
        return []
    import pyarrow as pa  # the [query] extra, as DuckDB
    columns = ("rank", "monitor", "name", "scope", "kind", "numel", "piece", "global_numel", "padding")
    table = pa.table({c: [r[i] for r in rows] for i, c in enumerate(columns)})
    [(schema,)] = con.execute("SELECT current_schema()").fetchall()
    con.register("__layout_rows", table)
    try:  # tables of the current schema: ``trainprobe diff`` holds two runs, in schemas b and c
        con.execute(
            f"CREATE OR REPLACE TABLE {ident(schema)}.{ident(LAYOUT_TABLE)} AS "
            f"SELECT * EXCLUDE (padding) FROM __layout_rows"
        )
        con.execute(
            f"CREATE OR REPLACE TABLE {ident(schema)}.{ident(PADDING_TABLE)} AS "
            "SELECT rank, monitor, name, scope, padding FROM __layout_rows WHERE padding > 0"
        )
    finally:
        con.unregister("__layout_rows")
    monitors = {r[1] for r in rows}
    made = []
    for view, cols in views.items():
        if view in _MERGED_TABLES and view in monitors:
            con.execute(f"CREATE OR REPLACE VIEW {ident(view + FULL_SUFFIX)} AS {full_view_sql(view, cols, schema)}")
            con.execute(f"COMMENT ON VIEW {ident(view + FULL_SUFFIX)} IS {text(FULL_COMMENT)}")
            made.append(view + FULL_SUFFIX)
    return made


def _merge(op: str) -> str:
    """The merge of ``op`` over the distinct pieces of a tensor (``numel``: the elements a row
    summarises, FSDP's zero ``padding`` among them; padding zeros reach no merged value)."""
    q = ident(op)
    if op in ("min", "max"):  # a NaN piece makes the full tensor's min/max NaN, as torch's (DuckDB's skip it)
        return f"CASE WHEN bool_or(isnan({q})) THEN CAST('nan' AS DOUBLE) ELSE {_padded_extreme(op)} END"
    if op == "norm":
        return f"sqrt(sum({q} * {q}))"
    if op == "nans":
        return f"sum({q})"
    if op == "mean":
        return f"sum({q} * numel) / nullif(sum(numel - padding), 0)"
    if op == "zeros":  # a fraction of the row's elements, the padding zeros among them
        return f"(sum({q} * numel) - sum(padding)) / nullif(sum(numel - padding), 0)"
    return "CAST(NULL AS DOUBLE)"


def _padded_extreme(op: str) -> str:
    """``min``/``max`` over the pieces, leaving FSDP's padding zeros out. A padded piece's extreme
    on the far side of 0 (a min < 0) is one of its elements; one equal to 0 may be the padding, and
    then its elements lie on the near side of 0 (all >= 0 for a min). That leaves the merged value
    exact unless the other pieces lie on that side too: then it is unknown (NULL)."""
    q = ident(op)
    far = f"{q} < 0" if op == "min" else f"{q} > 0"
    near = f"{op}({q}) FILTER (WHERE padding = 0 OR {far})"
    unknown = f"bool_or(padding > 0 AND {q} = 0) AND coalesce(NOT ({near} {'<=' if op == 'min' else '>='} 0), true)"
    return f"CASE WHEN {unknown} THEN CAST(NULL AS DOUBLE) ELSE {near} END"


def full_view_sql(
    view: str, columns: Sequence[str], schema: str = "main", *, source: str | None = None, nonfinite_first: bool = False
) -> str:
    """The SELECT of ``<view>_full`` over view ``view`` (its ``columns``) and :data:`LAYOUT_TABLE`,
    both of ``schema``; ``source``: another relation with ``view``'s rows to read instead (SQL,
    e.g. ``"kept.weight_grad"``). ``nonfinite_first``: of the copies of one piece (replicas), the
    one kept is a copy holding a NaN/inf where one does (else the least rank's), so that a NaN on
    one replica is not hidden by a finite copy (``trainprobe diagnose``)."""
    ops = [c for c in ops_of(columns) if c not in ("shape", "dtype")]
    keys = "step, micro_step, vpp_stage, name, scope"
    merged_ops = ", ".join(f"{_merge(o)} AS {ident(o)}" for o in ops)
    kept_ops = ", ".join(ident(o) for o in ops)
    pad = f"{ident(schema)}.{ident(PADDING_TABLE)}"
    layout = (
        f"SELECT l.rank, l.name, l.scope, l.kind, l.numel, l.piece, l.global_numel, coalesce(p.padding, 0) AS padding "
        f"FROM {ident(schema)}.{ident(LAYOUT_TABLE)} l LEFT JOIN {pad} p ON p.rank = l.rank AND p.monitor = l.monitor "
        f"AND p.name = l.name AND p.scope IS NOT DISTINCT FROM l.scope WHERE l.monitor = {text(view)}"
    )
    joined = (
        f"SELECT v.*, coalesce(s.kind, a.kind) AS l_kind, coalesce(s.numel, a.numel) AS numel, "
        f"coalesce(s.piece, a.piece, 'rank:' || CAST(v.rank AS VARCHAR)) AS piece, "
        f"coalesce(s.global_numel, a.global_numel) AS global_numel, "
        f"CASE WHEN s.kind IS NOT NULL THEN s.padding ELSE coalesce(a.padding, 0) END AS padding "
        f"FROM {source or ident(schema) + '.' + ident(view)} v "
        f"LEFT JOIN ({layout}) s ON s.rank = v.rank AND s.name = v.name AND s.scope = v.scope "
        f"LEFT JOIN ({layout}) a ON a.rank = v.rank AND a.name = v.name AND a.scope IS NULL"
    )
    mergeable = f"l_kind IS NOT NULL AND l_kind NOT IN ({text(RANK_LOCAL)}, 'partial')"
    first = f"CASE WHEN {nonfinite_sql(ops)} THEN 0 ELSE 1 END, " if nonfinite_first and ops else ""
    distinct = (  # an empty piece (FSDP1: a parameter outside a rank's flat shard) or all padding: left out
        f"SELECT *, row_number() OVER (PARTITION BY {keys}, piece ORDER BY {first}rank) AS copy "
        f"FROM rows WHERE {mergeable} AND (numel > padding OR global_numel = 0)"
    )
    merged = (
        f"SELECT min(rank) AS rank, {keys}{', ' + merged_ops if ops else ''}, sum(numel - padding) AS numel, "
        "count(*) AS pieces, sum(numel - padding) = max(global_numel) AS complete, "
        "string_agg(CAST(rank AS VARCHAR), ',' ORDER BY rank) AS ranks, 'merged' AS kind, "
        "arg_min(file, rank) AS file, arg_min(file_row, rank) AS file_row "
        f"FROM ({distinct}) WHERE copy = 1 GROUP BY {keys}"
    )
    kept = (
        f"SELECT rank, {keys}{', ' + kept_ops if ops else ''}, numel, 1 AS pieces, "
        "CAST(NULL AS BOOLEAN) AS complete, CAST(rank AS VARCHAR) AS ranks, l_kind AS kind, file, file_row "
        f"FROM rows WHERE NOT ({mergeable})"
    )
    return f"WITH rows AS ({joined}) {merged} UNION ALL {kept}"


def is_sharded(root: Path) -> bool:
    """Whether any ``rank_<r>/tensor_layout.json`` of ``root`` marks a shard or a replica."""
    return any(row[4] in ("shard", "replica") for row in layout_rows(root))
